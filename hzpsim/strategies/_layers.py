"""Units of work shared by every strategy: FLOPs by kernel class plus memory-bound bytes.

Memory-bound traffic [INF]: every stored activation is written once in the forward and read
once in the backward, where the gradient of the same size is also written, so a layer's
norm / activation-function / residual / dropout kernels move about its activation bytes in the
forward and twice that in the backward (see ``_mp_units.mp_units``).
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
