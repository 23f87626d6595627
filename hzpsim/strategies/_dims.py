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

from dataclasses import dataclass, replace
from typing import Any

from hzpsim.config import ScenarioError
from hzpsim.hardware.placement import expert_placement
from hzpsim.hardware.topology import Topology
from hzpsim.model import Model
from hzpsim.model.training import Training
from hzpsim.strategies import _implementations

MOE_DISPATCHERS = ("alltoall", "allgather", "deepep")
"""Token dispatchers of an MoE layer (``_model_parallel``)."""
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
    """Busiest expert rank's routed tokens over the mean (≥ 1): it sets the pace of the grouped
    GEMM and of the all-to-all's receiving side on every EP rank (1 = perfectly balanced)."""
    moe_capacity_factor: float | None = None
    """Tokens an expert accepts, over the mean (Megatron ``--moe-expert-capacity-factor``,
    DeepSpeed-MoE ``capacity_factor``); None = dropless. Routed tokens beyond it are dropped, so
    the busiest rank's load is min(imbalance, capacity factor) × the mean."""
    moe_pad_to_capacity: bool = False
    """Every expert's input is padded to its capacity (Megatron
    ``--moe-pad-expert-input-to-capacity``): the load is the capacity factor × the mean."""
    moe_dispatcher: str = "alltoall"
    """How tokens reach their experts: ``alltoall``, ``allgather`` or ``deepep``
    (``_model_parallel``: the dispatchers); the strategy's setting or its implementation's."""
    moe_ep_overlap: bool = False
    """The dispatch and combine exchanges overlap another micro-batch's compute (Megatron-Core
    ``--overlap-moe-expert-parallel-comm``: the combined 1F1B schedule)."""
    moe_grouped_gemm: bool = True
    """Local experts run as one grouped GEMM per linear (else one GEMM per expert)."""
    moe_permute_fusion: bool = True
    """The token permutation and un-permutation run fused (else as the eager sequences)."""
    ep_nodes: int = 1
    """Nodes one expert-parallel group spans (:meth:`placed`; the ``deepep`` dispatcher's
    network deduplication depends on it)."""

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
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            raise ValueError("moe_capacity_factor: must be > 0 (or null for dropless)")
        if self.moe_pad_to_capacity and self.moe_capacity_factor is None:
            raise ValueError("moe_pad_to_capacity: needs moe_capacity_factor")
        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise ValueError(f"moe_dispatcher: {self.moe_dispatcher!r} is not one of {', '.join(MOE_DISPATCHERS)}")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("vpp: interleaving needs pp > 1")

    @property
    def moe_load(self) -> float:
        """The busiest expert rank's tokens over the mean: the imbalance, capped by the capacity
        factor (tokens beyond it dropped), or the capacity itself when inputs are padded to it.
        1 without expert parallelism: one rank then runs every expert on its own tokens."""
        if self.ep == 1:
            return 1.0
        if self.moe_capacity_factor is None:
            return self.moe_imbalance
        if self.moe_pad_to_capacity:
            return self.moe_capacity_factor
        return min(self.moe_imbalance, self.moe_capacity_factor)

    def placed(self, topology: Topology) -> ParallelDims:
        """These dims with ``ep_nodes`` read from where the expert groups sit on ``topology``
        (MoE parallel folding: ``hardware.placement.expert_placement``)."""
        if self.ep == 1:
            return self
        n = topology.num_devices
        group = expert_placement(n, self.ep, self.etp, self.pp).group("ep", 0)
        return replace(self, ep_nodes=topology.span(group).num_nodes)

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
        if c > 1 and model.windowed:
            raise ValueError("cp: context parallelism with sliding-window attention (model.sliding_window) is not modelled")
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
        if model.moe is None and (self.ep > 1 or self.etp not in (1, t)):  # etp = tp: Megatron-Core's default, moot
            key = "ep" if self.ep > 1 else "etp"
            raise ValueError(f"{key}: expert parallelism needs an MoE model (model.moe)")
        if model.moe is not None and (self.ep > 1 or self.etp > 1):
            if model.moe.num_experts % self.ep:
                raise ValueError(f"ep: {self.ep} does not divide model.moe.num_experts {model.moe.num_experts}")
            if (n // p) % (self.ep * self.etp):
                key = _culprit({"ep": self.ep, "etp": self.etp}, n // p)
                raise ValueError(f"{key}: ep x etp = {self.ep * self.etp} does not divide the {n // p} ranks of a stage")
            if t > 1 and not self.sequence_parallel:
                raise ValueError("sequence_parallel: Megatron requires it when ep > 1 and tp > 1")


def moe_fields(config: Any) -> dict[str, Any]:
    """ParallelDims' MoE settings from a plugin's config: its own, and where it leaves the
    dispatcher unset (``""``), the grouped GEMM or the permutation's fusion unset (None) the
    implementation profile's."""
    profile = _implementations.get(config.implementation)
    return {"moe_imbalance": config.moe_imbalance, "moe_capacity_factor": config.moe_capacity_factor,
            "moe_pad_to_capacity": config.moe_pad_to_capacity,
            "moe_dispatcher": config.moe_dispatcher or profile.moe_dispatcher,
            "moe_ep_overlap": config.moe_ep_overlap,
            "moe_grouped_gemm": profile.moe_grouped_gemm if config.moe_grouped_gemm is None else config.moe_grouped_gemm,
            "moe_permute_fusion": profile.moe_permute_fusion if config.moe_permute_fusion is None
            else config.moe_permute_fusion}


def _culprit(degrees: dict[str, int], total: int) -> str:
    """The key to blame when the product of ``degrees`` does not divide ``total``: the first
    degree that alone does not, else the last one above 1."""
    alone = [k for k, v in degrees.items() if total % v]
    return alone[0] if alone else [k for k, v in degrees.items() if v > 1][-1]


NO_MODEL_PARALLELISM = ParallelDims()  # plain data parallelism: every degree 1
