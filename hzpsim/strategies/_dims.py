"""The parallel degrees of a layout, validated in one place (as torchtitan's ``ParallelDims``).

Every strategy describes how it splits the devices as one :class:`ParallelDims` (``nd`` with
all of its degrees, the ZeRO family with the ``tp``/``cp``/``ep`` it composes with, plain
ZeRO with none) and calls :meth:`ParallelDims.check`, which owns every rule a layout must
satisfy and its message: the degrees multiply to the devices, heads split over ``tp``, the
sequence over ``2·cp``, the batch over ``micro_batch_size × dp``, experts over ``ep``. The
messages start with the config key they concern (``tp: ...``), which the scenario loader
prefixes with the strategy's key path; the batch rule names ``training.global_batch_size``.

Rank order is Megatron's: tp fastest, then cp, dp, pp; experts fold over the same ranks as
etp, ep, edp, pp (``hzpsim.hardware.placement``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hzpsim.config import ScenarioError
from hzpsim.model import Model
from hzpsim.model.training import Training

MAX_MICRO_BATCHES = 4096  # per replica per step: the engine replays each one, so more would take minutes


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """How a layout splits the devices and the work."""

    tp: int = 1
    """Tensor-parallel ranks (attention heads and MLP columns split; Megatron TP)."""
    pp: int = 1
    """Pipeline stages."""
    cp: int = 1
    """Context-parallel ranks (the sequence split, K/V exchanged round a ring)."""
    dp: int | None = None
    """Data-parallel replicas splitting the batch; ``None`` = devices / (tp · pp · cp)."""
    ep: int = 1
    """Expert-parallel ranks (MoE); may fold over tp × cp × dp ranks."""
    etp: int = 1
    """Expert tensor-parallel ranks."""
    vpp: int = 1
    """Interleaved model chunks per pipeline rank (virtual pipeline stages)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism: norms and dropout split over the TP ranks."""
    tp_comm_overlap: float = 0.0
    """Fraction (0–1) of TP communication hidden behind compute."""
    tp_comm_overlap_backward: bool = True
    """Whether the backward's TP communication is hidden too (false: the forward's only)."""
    moe_imbalance: float = 1.0
    """Busiest expert rank's routed tokens over the mean (≥ 1)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "etp", "vpp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.dp is not None and self.dp < 1:
            raise ValueError("dp: must be >= 1")
        if not 0 <= self.tp_comm_overlap <= 1:
            raise ValueError("tp_comm_overlap: must be between 0 and 1")
        if self.moe_imbalance < 1:
            raise ValueError("moe_imbalance: must be >= 1 (busiest over mean)")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("vpp: interleaving needs pp > 1")

    # -- sizes ------------------------------------------------------------------------------------

    def data_parallel(self, num_devices: int) -> int:
        """Model replicas that split the batch (context parallelism splits sequences instead)."""
        return self.dp if self.dp is not None else num_devices // (self.tp * self.pp * self.cp)

    def sharding_world(self, num_devices: int) -> int:
        """Ranks of one dense data-parallel group (dp × cp): parameters are replicated over it."""
        return self.data_parallel(num_devices) * self.cp

    def expert_world(self, num_devices: int) -> int:
        """Ranks of one expert-data-parallel group (expert weights replicated over it)."""
        return num_devices // (self.pp * self.ep * self.etp)

    def num_micro_batches(self, training: Training, num_devices: int) -> int:
        """Micro-batches each replica runs per optimizer step."""
        return training.global_batch_size // (training.micro_batch_size * self.data_parallel(num_devices))

    # -- rules ------------------------------------------------------------------------------------

    def check(self, model: Model, training: Training, num_devices: int) -> None:
        """Raise ``ValueError("<key>: ...")`` (or ScenarioError for the batch) for a layout that
        cannot run on ``num_devices`` devices."""
        n, t, p, c = num_devices, self.tp, self.pp, self.cp
        if n % (t * p * c):
            key = _culprit({"tp": t, "pp": p, "cp": c}, n)
            raise ValueError(f"{key}: tp x pp x cp = {t} x {p} x {c} does not divide the {n} devices")
        dp = self.data_parallel(n)
        if t * p * dp * c != n:
            raise ValueError(f"dp: tp x pp x dp x cp = {t} x {p} x {dp} x {c} = {t * p * dp * c}, not the {n} devices")
        if model.num_heads % t:
            raise ValueError(f"tp: {t} does not divide model.num_heads {model.num_heads}")
        if model.kv_heads % t:
            raise ValueError(f"tp: {t} does not divide model.num_kv_heads {model.kv_heads}")
        if c > 1 and model.seq_len % (2 * c):
            raise ValueError(f"cp: model.seq_len {model.seq_len} is not divisible by 2 x cp (load-balanced causal split)")
        per_step = training.micro_batch_size * dp
        if training.global_batch_size % per_step:
            raise ScenarioError(
                f"training.global_batch_size: {training.global_batch_size} is not divisible by "
                f"micro_batch_size x data-parallel size = {training.micro_batch_size} x {dp}"
            )
        m = training.global_batch_size // per_step
        if m > MAX_MICRO_BATCHES:
            raise ScenarioError(
                f"training.global_batch_size: {m} micro-batches per replica per step exceed the "
                f"{MAX_MICRO_BATCHES} hzpsim replays; raise training.micro_batch_size"
            )
        if self.vpp > 1 and m % p:
            raise ValueError(f"vpp: interleaving needs the {m} micro-batches per step to be a multiple of pp={p}")
        if self.ep > 1 or self.etp > 1:
            if model.moe is None:
                raise ValueError("ep: expert parallelism needs an MoE model (model.moe)")
            if model.moe.num_experts % self.ep:
                raise ValueError(f"ep: {self.ep} does not divide model.moe.num_experts {model.moe.num_experts}")
            if (n // p) % (self.ep * self.etp):
                key = _culprit({"ep": self.ep, "etp": self.etp}, n // p)
                raise ValueError(f"{key}: ep x etp = {self.ep * self.etp} does not divide the {n // p} ranks of a stage")
            if t > 1 and not self.sequence_parallel:
                raise ValueError("sequence_parallel: Megatron requires it when ep > 1 and tp > 1")


def _culprit(degrees: dict[str, int], total: int) -> str:
    """The key to blame when the product of ``degrees`` does not divide ``total``: the first
    degree that alone does not, else the last one above 1."""
    alone = [k for k, v in degrees.items() if total % v]
    return alone[0] if alone else [k for k, v in degrees.items() if v > 1][-1]


NO_MODEL_PARALLELISM = ParallelDims()  # plain data parallelism: every degree 1
