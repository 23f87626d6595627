"""What one model replica computes and stores per unit, shared by every strategy.

A *unit* is what a sharded strategy gathers and reduces at once (FSDP's wrapped module): the
token embedding, each transformer layer, and the output head with the final norm. For every
unit this module gives the parameter count, the forward / backward / recompute work of one
micro-batch (FLOPs by kernel class plus memory-bound bytes) and the activations kept for the
backward. Strategies divide these by their tensor / context parallel degrees and wrap them in
communication; the engine turns them into seconds.

Memory-bound traffic [INF]: every stored activation is written once in the forward and read
once in the backward, where the gradient of the same size is also written, so a layer's
norm / activation-function / residual / dropout kernels move about its activation bytes in the
forward and twice that in the backward. The LM head's fp32 logits (4 bytes x tokens x vocab)
are written, read for the softmax and read again for the loss gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

from hzpsim.model import Model
from hzpsim.training import Training


@dataclass(frozen=True)
class Work:
    """FLOPs by kernel class and memory-bound bytes of one compute op."""

    gemm: float = 0.0
    attention_forward: float = 0.0
    attention_backward: float = 0.0
    bytes_accessed: float = 0.0

    def flops(self) -> dict[str, float]:
        return {
            "gemm": self.gemm,
            "attention_forward": self.attention_forward,
            "attention_backward": self.attention_backward,
        }

    def scaled(self, factor: float) -> Work:
        return Work(
            self.gemm * factor,
            self.attention_forward * factor,
            self.attention_backward * factor,
            self.bytes_accessed * factor,
        )


@dataclass(frozen=True)
class Unit:
    """One gather/reduce unit and its per-micro-batch work on one (unsplit) replica."""

    name: str
    num_params: int
    forward: Work
    backward: Work
    recompute: Work  # extra forward work before the backward (activation recompute)
    activation_bytes: float  # kept from forward to backward
    recompute_bytes: float  # extra activations alive during the backward of a recomputed unit
    layer: int | None = None

    @property
    def backward_with_recompute(self) -> Work:
        """The recompute forward and the backward as one op (they run back to back)."""
        r, b = self.recompute, self.backward
        return Work(r.gemm + b.gemm, r.attention_forward + b.attention_forward,
                    r.attention_backward + b.attention_backward, r.bytes_accessed + b.bytes_accessed)


def model_units(model: Model, training: Training) -> list[Unit]:
    """Units in forward order: embedding, layers 0..L-1, head (+ final norm)."""
    b = training.micro_batch_size
    tokens = b * model.seq_len
    h, vocab = model.hidden_size, model.vocab_size
    act = 4 if training.precision == "fp32" else 2
    mode = training.activation_recompute
    units: list[Unit] = []

    # Embedding lookup: read and write tokens x h activations; its backward scatters the
    # same bytes into the (sharded) gradient.
    lookup_bytes = 2.0 * tokens * h * act
    units.append(
        Unit("embed", model.embedding_params(), Work(bytes_accessed=lookup_bytes),
             Work(bytes_accessed=2 * lookup_bytes), Work(), 0.0, 0.0)
    )
    for i in range(model.num_layers):
        flops = model.layer_forward_flops(i, tokens, causal=True)
        stored_full = model.activation_bytes_per_layer(
            i, b, recompute="none", flash_attention=training.flash_attention, act_bytes=act
        )
        kept = model.activation_bytes_per_layer(
            i, b, recompute=mode, flash_attention=training.flash_attention, act_bytes=act
        )
        forward = Work(gemm=flops["gemm"], attention_forward=flops["attention"], bytes_accessed=stored_full)
        backward = Work(
            gemm=2 * flops["gemm"], attention_backward=2 * flops["attention"], bytes_accessed=2 * stored_full
        )
        if mode == "full":
            recompute = forward
        elif mode == "selective":
            recompute = Work(attention_forward=flops["attention"])
        else:
            recompute = Work()
        units.append(
            Unit(f"layer{i}", model.layer_params(i), forward, backward, recompute, kept,
                 max(stored_full - kept, 0.0) if mode != "none" else 0.0, layer=i)
        )
    head_flops = model.head_forward_flops(tokens)
    logits_bytes = 4.0 * tokens * vocab
    head_params = model.head_params() + model.final_norm_params()
    units.append(
        Unit("head", head_params, Work(gemm=head_flops, bytes_accessed=2 * logits_bytes),
             Work(gemm=2 * head_flops, bytes_accessed=logits_bytes), Work(), logits_bytes, 0.0)
    )
    return units


def optimizer_bytes_per_param(training: Training) -> float:
    """HBM bytes an Adam step moves per parameter of its shard [INF, from the update rule]:
    reads fp32 master, m, v and the gradient; writes master, m, v and the working copy."""
    return 3 * 4 + training.grad_bytes + 3 * 4 + training.param_bytes
