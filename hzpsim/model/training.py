"""The ``training:`` section of a scenario: batch, precision, gradient dtype and recompute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Precision = Literal["bf16", "fp16", "fp8", "fp32"]
AttentionKernel = Literal["auto", "flash2", "flash3", "cudnn", "triton", "unfused"]
ATTENTION_KERNELS = ("flash2", "flash3", "cudnn", "triton", "unfused")


@dataclass(frozen=True)
class Training:
    """How the model is trained: batch, precision and recompute (DESIGN §5 defaults)."""

    global_batch_size: int = 1024  # sequences per optimizer step
    micro_batch_size: int = 1  # sequences per micro-batch per model replica
    precision: Precision = "bf16"  # dtype of GEMMs and of the working parameter copy
    grad_dtype: Literal["fp32", "bf16"] = "fp32"  # dtype gradients are accumulated and reduced in
    activation_recompute: Literal["none", "selective", "op", "full"] = "none"  # selective: the
    # attention core (Megatron, Korthikanti §5); op: per-op selective checkpointing (torchtitan's
    # policy: every second matmul and every memory-bound kernel, Model.op_sac_recomputed_linears)
    flash_attention: bool = True  # attention scores are never stored (no s^2 activation term)
    autocast: bool = False  # torch.autocast mixed precision: fp32 residual stream and elementwise
    # kernels, GEMM inputs cast to `precision` (LLM-Foundry amp_bf16); false = pure bf16 (Megatron, FSDP2)
    attention_kernel: AttentionKernel = "auto"  # the fused attention kernel family; "auto" = the
    # device's usual one (hardware/compute.py DEFAULT_ATTENTION_KERNEL); "unfused" = flash_attention false
    compile: bool = False  # torch.compile: pointwise kernels fused between GEMMs (fewer launches,
    # less HBM traffic); false = eager
    fused_kernels: bool = False  # the model code fuses its pointwise kernels by hand, as Megatron-LM
    # and Transformer Engine do (bias-dropout-add, norm + residual): the same traffic as compile
    num_steps: int = 2  # optimizer steps simulated; the last one is reported (steady state)

    def validate(self) -> None:
        if self.global_batch_size < 1:
            raise ValueError("global_batch_size: must be >= 1")
        if self.micro_batch_size < 1:
            raise ValueError("micro_batch_size: must be >= 1")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size: {self.global_batch_size} is not divisible by "
                f"micro_batch_size {self.micro_batch_size}"
            )
        if not self.flash_attention and self.attention_kernel not in ("auto", "unfused"):
            raise ValueError(
                f"attention_kernel: {self.attention_kernel!r} is a fused kernel but flash_attention is false "
                "(unfused attention); set attention_kernel: unfused or flash_attention: true"
            )
        if not 2 <= self.num_steps <= 100:
            raise ValueError("num_steps: must be between 2 and 100 (the last step is reported)")

    @property
    def fused_pointwise(self) -> bool:
        """Pointwise kernels fused between GEMMs (by torch.compile or by the model code)."""
        return self.compile or self.fused_kernels

    @property
    def fused_attention(self) -> bool:
        """Attention runs as one fused (flash-style) kernel: scores never reach HBM."""
        return self.flash_attention and self.attention_kernel != "unfused"

    @property
    def param_element_bytes(self) -> int:
        """Bytes per element of the working (compute) parameter copy."""
        return 4 if self.precision == "fp32" else 2

    @property
    def grad_element_bytes(self) -> int:
        return 4 if self.grad_dtype == "fp32" else 2


