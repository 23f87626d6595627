"""The ``training:`` section of a scenario: batch, precision, gradient dtype and recompute."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from hzpsim.model.checkpointing import DEFAULT_SELECTIVE_MODULES, RecomputeModule, selective_modules
from hzpsim.model.sequences import SequenceLengths

Precision = Literal["bf16", "fp16", "fp8", "fp32"]
AttentionKernel = Literal["auto", "flash2", "flash3", "cudnn", "triton", "unfused"]
ATTENTION_KERNELS = ("flash2", "flash3", "cudnn", "triton", "unfused")
Fp8Recipe = Literal["auto", "fused", "delayed", "tensorwise", "mxfp8", "blockwise"]
FP8_RECIPES = ("fused", "delayed", "tensorwise", "mxfp8", "blockwise")


# Llama 3 (Dubey et al. 2024, arXiv 2407.21783, section 3.3.4): 419 unexpected interruptions in a
# 54-day snapshot of pre-training on 16,384 H100 GPUs: 16,384 x 54 x 24 / 419 device-hours each
LLAMA3_MTBF_DEVICE_HOURS = 16_384 * 54 * 24 / 419
# Llama 3, section 3.3.1: Tectonic serves checkpoints at 2 TB/s sustained to the 16,384 GPUs
LLAMA3_WRITE_BYTES_PER_S_PER_DEVICE = 2e12 / 16_384
# PCIe Gen5 x16: 64 GB/s each way (NVIDIA H100 SXM datasheet: "PCIe Gen5: 128 GB/s", both ways),
# what an asynchronous save's device-to-host copy of the shard moves at most
PCIE_GEN5_X16_BYTES_PER_S = 64e9


@dataclass(frozen=True)
class Failures:
    """``training.failures``: how often a device fails and what a restart costs (goodput)."""

    restart_s: float  # from a failure to training again (re-scheduling, NCCL initialisation,
    # loading the checkpoint, compiling): required, no published figure is general enough for a default
    mtbf_device_hours: float = LLAMA3_MTBF_DEVICE_HOURS  # mean time between failures of one device

    def validate(self) -> None:
        if not self.mtbf_device_hours > 0:
            raise ValueError(f"mtbf_device_hours: must be > 0, got {self.mtbf_device_hours}")
        if self.restart_s < 0:
            raise ValueError(f"restart_s: must be >= 0, got {self.restart_s}")


@dataclass(frozen=True)
class Checkpoint:
    """``training.checkpoint``: how often and how fast the model states are saved (goodput)."""

    interval: int | Literal["auto"] = "auto"  # optimizer steps between saves; auto = Young's optimum
    write_bytes_per_s_per_device: float = LLAMA3_WRITE_BYTES_PER_S_PER_DEVICE  # storage write
    # bandwidth each device gets (every rank writes its shard of the states)
    snapshot_bytes_per_s: float = PCIE_GEN5_X16_BYTES_PER_S  # an asynchronous save's device-to-host copy
    async_: bool = field(default=False, metadata={"key": "async"})  # training resumes after the
    # snapshot (torch.distributed.checkpoint.async_save); false: after the write

    def validate(self) -> None:
        if self.interval != "auto" and self.interval < 1:
            raise ValueError(f"interval: must be >= 1 step or auto, got {self.interval}")
        for name in ("write_bytes_per_s_per_device", "snapshot_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 bytes/s, got {getattr(self, name)}")


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
    recompute_modules: tuple[RecomputeModule, ...] | None = field(default=None, metadata={"omit_if_none": True})
    # what selective recompute runs again, Megatron-Core's --recompute-modules (checkpointing.py
    # RECOMPUTE_MODULES); unset: its default, the attention core
    flash_attention: bool = True  # attention scores are never stored (no s^2 activation term)
    autocast: bool = False  # torch.autocast mixed precision: fp32 residual stream and elementwise
    # kernels, GEMM inputs cast to `precision` (LLM-Foundry amp_bf16); false = pure bf16 (Megatron, FSDP2)
    attention_kernel: AttentionKernel = "auto"  # the fused attention kernel family; "auto" = the
    # device's usual one (hardware/compute.py DEFAULT_ATTENTION_KERNEL); "unfused" = flash_attention false
    fp8_recipe: Fp8Recipe = "auto"  # how fp8 GEMM operands are scaled and cast (precision fp8 only;
    # Megatron-Core's --fp8-recipe names, strategies/_layers.py FP8_QUANTIZE_BYTES): "fused" = the casts ride
    # in the producing kernels (torch.compile'd torchao float8); "auto" = the implementation's default
    compile: bool = False  # torch.compile: pointwise kernels fused between GEMMs (fewer launches,
    # less HBM traffic); false = eager
    fused_kernels: bool = False  # the model code fuses its pointwise kernels by hand, as Megatron-LM
    # and Transformer Engine do (bias-dropout-add, norm + residual): the same traffic as compile
    num_steps: int = 2  # optimizer steps simulated; the last one is reported (steady state)
    total_tokens: float | None = None  # tokens of the whole run: time_to_train_s (and cost) in the report
    failures: Failures | None = None  # device failures: goodput in the report (model/goodput.py)
    checkpoint: Checkpoint | None = None  # checkpoint saves (with failures: auto interval by default)
    sequence_lengths: Literal["fixed"] | SequenceLengths = "fixed"  # every row one seq_len sequence, or
    # documents of varying length packed into the rows (model/sequences.py)

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
        if self.recompute_modules is not None:
            if self.activation_recompute != "selective":
                raise ValueError(f"recompute_modules: names what selective recompute runs again, but "
                                 f"activation_recompute is {self.activation_recompute!r} (set it to selective)")
            if not self.recompute_modules:
                raise ValueError("recompute_modules: empty; name at least one module, or set "
                                 "activation_recompute: none")
            if len(set(self.recompute_modules)) < len(self.recompute_modules):
                raise ValueError(f"recompute_modules: names a module twice: {list(self.recompute_modules)}")
        if not self.flash_attention and self.attention_kernel not in ("auto", "unfused"):
            raise ValueError(
                f"attention_kernel: {self.attention_kernel!r} is a fused kernel but flash_attention is false "
                "(unfused attention); set attention_kernel: unfused or flash_attention: true"
            )
        if self.fp8_recipe != "auto" and self.precision != "fp8":
            raise ValueError(f"fp8_recipe: {self.fp8_recipe!r} scales fp8 GEMM operands, but precision is "
                             f"{self.precision!r}; set precision: fp8 or drop fp8_recipe")
        if self.fp8_recipe not in ("auto", *FP8_RECIPES):
            raise ValueError(f"fp8_recipe: {self.fp8_recipe!r} is not one of auto, {', '.join(FP8_RECIPES)}")
        if not 2 <= self.num_steps <= 100:
            raise ValueError("num_steps: must be between 2 and 100 (the last step is reported)")
        if self.total_tokens is not None and not self.total_tokens > 0:
            raise ValueError(f"total_tokens: must be > 0, got {self.total_tokens}")

    @property
    def varying_lengths(self) -> SequenceLengths | None:
        """The document lengths when they change what a micro-batch costs (per-document
        attention masks), else None."""
        spec = self.sequence_lengths
        return spec if isinstance(spec, SequenceLengths) and spec.varies else None

    @property
    def recomputed_modules(self) -> frozenset[str]:
        """The submodules selective recompute runs again (empty unless ``selective``)."""
        return selective_modules(self.activation_recompute, self.recompute_modules)

    def resolved_recompute(self) -> Training:
        """This training with ``recompute_modules`` spelled out where the default applies (for
        ``training_resolved``)."""
        if self.activation_recompute == "selective" and self.recompute_modules is None:
            return replace(self, recompute_modules=DEFAULT_SELECTIVE_MODULES)  # type: ignore[arg-type]
        return self

    @property
    def fused_pointwise(self) -> bool:
        """Pointwise kernels fused between GEMMs (by torch.compile or by the model code)."""
        return self.compile or self.fused_kernels

    @property
    def pointwise_fusion(self) -> str:
        """How the pointwise kernels are fused: ``"compile"`` (Inductor fuses the forward's and
        the backward's), ``"hand"`` (Megatron-LM / Transformer Engine's hand-fused forward
        kernels; the backwards stay apart) or ``"eager"``
        (``activations.elementwise_backward_over_forward``)."""
        return "compile" if self.compile else "hand" if self.fused_kernels else "eager"

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


