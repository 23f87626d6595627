"""Units of work shared by every strategy: FLOPs by kernel class plus memory-bound bytes.

Memory-bound traffic [INF]: a layer's norm / activation-function / residual / dropout kernels,
counted kernel by kernel, forward (``activations.elementwise_bytes_per_token``) and backward
(``activations.elementwise_backward_over_forward``; see ``_mp_units.mp_units``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from hzpsim.model.kernels import Attention, Gemm, Shape, merged, packed, scaled
from hzpsim.model.ops import FlopsByClass, flops_by_class
from hzpsim.model.training import Training


@dataclass(frozen=True)
class Work:
    """FLOPs by kernel class and memory-bound bytes of one compute op, with the kernel shapes
    that make them up (``shapes``, see :mod:`hzpsim.model.kernels`). Build it with :meth:`of` from
    shapes; FLOP-only work (no shapes) is timed at the class's large-kernel rate."""

    gemm: float = 0.0
    attention_forward: float = 0.0
    attention_backward: float = 0.0
    bytes_accessed: float = 0.0
    shapes: tuple[Shape, ...] = ()

    @classmethod
    def of(cls, shapes: Iterable[Shape], bytes_accessed: float = 0.0) -> Work:
        """Work whose FLOP totals are exactly those of ``shapes``."""
        shapes = merged(shapes)
        gemm = attention_forward = attention_backward = 0.0
        for s in shapes:
            if isinstance(s, Gemm):
                gemm += s.flops
            elif isinstance(s, Attention) and s.backward:
                attention_backward += s.flops
            else:
                attention_forward += s.flops
        return cls(gemm, attention_forward, attention_backward, bytes_accessed, shapes)

    def flops(self) -> dict[str, float]:
        return {
            "gemm": self.gemm,
            "attention_forward": self.attention_forward,
            "attention_backward": self.attention_backward,
        }

    @cached_property
    def op_flops(self) -> FlopsByClass:
        """:meth:`flops` as an Op's ``flops`` field (converted once per Work, not per op)."""
        return flops_by_class(self.flops())

    def scaled(self, factor: float) -> Work:
        return Work(
            self.gemm * factor,
            self.attention_forward * factor,
            self.attention_backward * factor,
            self.bytes_accessed * factor,
            scaled(self.shapes, factor),
        )

    def packed(self, seq_len: float, tokens: float) -> Work:
        """This work with its attention over documents of token-weighted mean length ``tokens``
        (:func:`~hzpsim.model.kernels.packed`)."""
        shapes = packed(self.shapes, seq_len, tokens)
        return self if shapes is self.shapes else Work.of(shapes, self.bytes_accessed)

    def __add__(self, other: Work) -> Work:
        assert bool(self.shapes) == bool(other.shapes) or not (self.flops_total and other.flops_total), \
            "adding work with kernel shapes to FLOP-only work would lose its shapes"
        return Work(
            self.gemm + other.gemm,
            self.attention_forward + other.attention_forward,
            self.attention_backward + other.attention_backward,
            self.bytes_accessed + other.bytes_accessed,
            merged(self.shapes, other.shapes),
        )

    @property
    def flops_total(self) -> float:
        return self.gemm + self.attention_forward + self.attention_backward

    def __bool__(self) -> bool:
        return bool(self.gemm or self.attention_forward or self.attention_backward or self.bytes_accessed)


def optimizer_bytes_per_param(training: Training) -> float:
    """HBM bytes an Adam step moves per parameter of its shard [INF, from the update rule]:
    reads fp32 master, m, v and the gradient; writes master, m, v and the working copy."""
    return 3 * 4 + training.grad_element_bytes + 3 * 4 + training.param_element_bytes


def linear_gemms(linears: Sequence[tuple[int, int, str]], tokens: float, t: int) -> list[Gemm]:
    """The forward GEMMs of ``linears`` (``Model.layer_linears``) over ``tokens`` rows, each
    weight split ``t`` ways along N (column-parallel) or K (row-parallel)."""
    return [Gemm(tokens, n / t if split == "column" else n, k / t if split == "row" else k)
            for k, n, split in linears]


# HBM bytes per element of the standalone kernels that scale and cast an fp8 GEMM operand, by
# recipe (``Training.fp8_recipe``), for a bf16 tensor [INF, from Transformer Engine's kernels,
# TransformerEngine@d0067d0 transformer_engine/pytorch/csrc]: (a GEMM input a norm produced,
# any other GEMM input, an output gradient). Every operand is written twice, rowwise for its
# forward or data-gradient GEMM and columnwise for the weight-gradient GEMM (1 byte each).
#
# - ``delayed``: the scale is last steps' amax, so one cast-transpose kernel reads the tensor
#   (2 B) and writes both copies (2 B), and the norm quantises its own output
#   (``extensions/normalization.cpp``: a Float8Quantizer is ``Impl::FULLY_FUSED``): 0 extra;
# - ``tensorwise`` (current scaling): the scale needs this tensor's amax first
#   (``quantizer.cpp::Float8CurrentScalingQuantizer::quantize_impl``: ``nvte_compute_amax``,
#   then ``nvte_quantize_v2``): 2 + 2 + 2 B; after a norm the amax comes out of the norm kernel
#   (``Impl::FUSED_NORM_AMAX_FP8``), which writes its bf16 output for ``quantize_with_amax``
#   to read: 4 B;
# - ``mxfp8`` / ``blockwise``: each block of 32 (128) elements has its own scale, so one pass
#   reads 2 B and writes both copies with their scales (1 B per 32 elements, or 4 B per 128:
#   1/16 B); the norm is not fused with it (``Impl::UNFUSED`` unless NVTE_NORM_FWD_USE_CUDNN):
#   the same 4 1/16 B;
# - ``fused``: no standalone kernel (torch.compile fuses torchao's casts into their producers).
FP8_QUANTIZE_BYTES: dict[str, tuple[float, float, float]] = {
    "fused": (0.0, 0.0, 0.0),
    "delayed": (0.0, 4.0, 4.0),
    "tensorwise": (4.0, 6.0, 6.0),
    "mxfp8": (4.0625, 4.0625, 4.0625),
    "blockwise": (4.0625, 4.0625, 4.0625),
}


def fp8_quantize_bytes(linears: Sequence[tuple[int, int, str]], tokens: float, t: int, sequence_parallel: bool,
                       recipe: str, normed_input: bool) -> tuple[float, float]:
    """HBM bytes of the fp8 quantisation kernels around the GEMMs of ``linears``
    (``Model.layer_linears``'s (K, N, split) of one block) over ``tokens`` rows, weights split
    ``t`` ways: (forward, backward). The forward quantises each distinct input once (linears
    reading the same K-wide input share it, as Transformer Engine's fused QKV and gate/up
    linears do), the first one a norm's output when ``normed_input``; the backward quantises
    each output gradient. A column-parallel input under sequence parallelism, and a
    row-parallel output gradient, are quantised on the rank's 1/t of the sequence before their
    all-gather (``module/linear.py``: the quantizer is handed to ``gather_along_first_dim``);
    without it each TP rank quantises the whole tensor. :data:`FP8_QUANTIZE_BYTES` gives the
    bytes per element."""
    normed, other, grad = FP8_QUANTIZE_BYTES[recipe]
    if not (normed or other or grad):
        return 0.0, 0.0
    seq = 1 / t if sequence_parallel else 1.0
    forward = backward = 0.0
    seen: set[tuple[int, str]] = set()
    for k, n, split in linears:
        if (k, split) not in seen:
            per_byte = normed if normed_input and not seen else other
            seen.add((k, split))
            forward += per_byte * (k / t if split == "row" else k * seq)
        backward += grad * (n / t if split == "column" else n * seq)
    return forward * tokens, backward * tokens
