"""Search a scenario's whole strategy space for the fastest layouts that fit (``hzpsim search``).

    hzpsim search examples/gpt3-175b-megatron.yaml                 # best per family, top 10
    hzpsim search SCENARIO --family nd --top 5 --json
    hzpsim search SCENARIO --dask tcp://scheduler:8786              # simulations on a Dask cluster
    python -c "from hzpsim.search import search; ..."               # the same from Python

The space (:class:`Space`) is every strategy plugin's layout knobs (ND: tp, pp, vpp, cp, ep,
zero stage, sequence parallelism; the ZeRO family: stages, shard/partition group sizes, AsyncHZP
group chains) times the training knobs (micro-batch size, activation recompute). It is searched
by branch and bound, exactly:

1. every candidate is checked by its plugin (``check``: layouts that cannot run are *invalid*);
2. two cheap analytic bounds (:func:`bound`), no graph built: a lower bound on peak memory
   (resident model states plus the activations a schedule must hold before its first backward)
   and a lower bound on step time (:class:`Bounder`: the step's dependency chain replayed at
   the least durations the engine can give its ops, stragglers' expected waits included, and
   the time the rank must spend talking). A candidate whose memory bound exceeds the device is
   *pruned (memory)*;
3. the rest are simulated in order of their step-time bound, in fixed batches, and a candidate
   whose bound exceeds both the N-th best fitting step time found so far and its family's best
   is *pruned (bound)*: it can enter neither the top N nor its family's best. An ND candidate
   whose bound passes gets a refined one first (the whole pipeline replayed, every stage's
   schedule micro-batch by micro-batch against the others'), which may still prune it.

Both bounds are tested against simulated values (``tests/test_search.py``), and the search's
answers against an exhaustive simulation of the same space. Batches are fixed, so the same
scenario gives the same answer and the same counts on one process, many, or a Dask cluster.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from hzpsim import strategies
from hzpsim.config import ScenarioError, from_mapping
from hzpsim.hardware.collectives import CollectiveModel
from hzpsim.hardware.compute import ComputeModel
from hzpsim.hardware.placement import expert_placement
from hzpsim.hardware.variability import expected_max_excess
from hzpsim.model.kernels import Gemm
from hzpsim.model.ops import GraphError
from hzpsim.model.training import Training
from hzpsim.report import format_summary
from hzpsim.scenario import Scenario, StrategyChoice
from hzpsim.strategies import _family, nd
from hzpsim.strategies._dims import ParallelDims
from hzpsim.strategies._implementations import Implementation
from hzpsim.strategies._layers import Work, optimizer_bytes_per_param
from hzpsim.strategies._model_parallel import MPUnit, mp_units
from hzpsim.strategies._sharded import NestedSharding, Schedule

#: Strategy names searched, in the order they are reported (one ``best_per_family`` key each).
FAMILIES = ("nd", "zero", "hsdp", "mics", "zeropp", "megatron_fsdp", "asynchzp", "ddp")
RECOMPUTE = ("none", "selective", "full")
#: Candidates simulated per round of the branch and bound; fixed (not the worker count) so
#: that every executor simulates the same candidates and reports the same counts.
BATCH = 8


# ---------------------------------------------------------------------------- the space


@dataclass(frozen=True)
class Space:
    """The knobs searched (every combination, minus those a plugin's ``check`` rejects)."""

    tp: tuple[int, ...] = (1, 2, 4, 8)
    pp: tuple[int, ...] = tuple(range(1, 17))
    vpp: tuple[int, ...] = (1, 2, 3, 4)
    cp: tuple[int, ...] = (1,)
    ep: tuple[int, ...] = (1,)
    zero_stage: tuple[int, ...] = (0, 1, 2, 3)
    sequence_parallel: tuple[bool, ...] = (False, True)
    micro_batch_size: tuple[int, ...] = (1, 2, 4)
    activation_recompute: tuple[str, ...] = RECOMPUTE
    group_sizes: tuple[int, ...] | None = None  # HSDP / MiCS / Megatron-FSDP groups; None = powers of two

    def replace(self, text: str) -> Space:
        """``KEY=V1,V2`` (``pp=1-16`` for a range), the ``--space`` syntax."""
        if "=" not in text:
            raise ScenarioError(f"--space {text!r}: expected KEY=V1,V2,... (keys: {', '.join(_space_keys())})")
        key, raw = (s.strip() for s in text.split("=", 1))
        if key not in _space_keys():
            raise ScenarioError(f"--space {key}: unknown key (keys: {', '.join(_space_keys())})")
        values: list[Any] = []
        for part in (p.strip() for p in raw.split(",")):
            if key == "activation_recompute":
                if part not in RECOMPUTE:
                    raise ScenarioError(f"--space {key}: {part!r} is not one of {', '.join(RECOMPUTE)}")
                values.append(part)
            elif key == "sequence_parallel":
                if part.lower() not in ("true", "false"):
                    raise ScenarioError(f"--space {key}: {part!r} is not true or false")
                values.append(part.lower() == "true")
            else:
                lo, _, hi = part.partition("-")
                try:
                    first, last = int(lo), int(hi or lo)
                except ValueError:
                    raise ScenarioError(f"--space {key}: {part!r} is not an integer or a range a-b") from None
                minimum = 0 if key == "zero_stage" else 1
                maximum = 3 if key == "zero_stage" else 1_000_000
                if first < minimum or last < first or last > maximum:
                    raise ScenarioError(f"--space {key}: {part!r} is out of range")
                values.extend(range(first, last + 1))
        if not values:
            raise ScenarioError(f"--space {key}: no values")
        return dataclasses.replace(self, **{key: tuple(sorted(set(values), key=str if key == "activation_recompute" else None))})


def _space_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(Space)]


def default_space(scenario: Scenario) -> Space:
    """The space searched when nothing else is said: tensor parallelism inside a node, up to 16
    pipeline stages, context parallelism for long sequences, expert parallelism for MoE."""
    model, topology = scenario.model, scenario.topology
    tp = tuple(t for t in (1, 2, 4, 8) if t <= topology.devices_per_node)
    cp = (1, 2) if model.seq_len >= 8192 else (1,)
    ep: tuple[int, ...] = (1,)
    if model.moe is not None:
        ep = tuple(e for e in (1, 2, 4, 8, 16, 32, 64) if e <= model.moe.num_experts and model.moe.num_experts % e == 0)
    return Space(tp=tp, pp=tuple(range(1, min(16, model.num_layers) + 1)), cp=cp, ep=ep)


@dataclass(frozen=True)
class Candidate:
    """One point of the space: a strategy (name and fields) and the training knobs."""

    name: str
    fields: tuple[tuple[str, Any], ...]
    micro_batch_size: int
    activation_recompute: str

    @functools.cached_property
    def key(self) -> str:
        """Stable identity and tie-breaker."""
        return json.dumps([self.name, self.fields, self.micro_batch_size, self.activation_recompute])

    def strategy(self) -> dict[str, Any]:
        return {"name": self.name, **dict(self.fields)}

    def training(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size, "activation_recompute": self.activation_recompute}

    def label(self) -> str:
        return f"{strategies.label(self.strategy())} mb={self.micro_batch_size} rc={self.activation_recompute}"

    def overrides(self) -> list[str]:
        """``--set`` arguments that make ``hzpsim run`` simulate this candidate."""
        out = [f"strategy.name={self.name}"]
        out += [f"strategy.{k}={json.dumps(v)}" for k, v in self.fields]
        out += [f"training.micro_batch_size={self.micro_batch_size}",
                f"training.activation_recompute={self.activation_recompute}"]
        return out


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, v = [], 1
    while v <= hi:
        if v >= lo:
            out.append(v)
        v *= 2
    return out


def _family_layouts(name: str, scenario: Scenario, space: Space) -> list[dict[str, Any]]:
    """Strategy fields of one family's candidates (training knobs excluded)."""
    topology = scenario.topology
    n = topology.num_devices
    node = _family.level_group_sizes(topology)["node"]
    groups = list(space.group_sizes) if space.group_sizes is not None else _powers_of_two(2, n // 2)
    groups = sorted({g for g in groups if 1 < g < n and n % g == 0})
    if name == "nd":
        out = []
        for tp in space.tp:
            for pp in space.pp:
                for vpp in space.vpp:
                    if vpp > 1 and pp == 1:
                        continue
                    for cp in space.cp:
                        for ep in space.ep:
                            for stage in space.zero_stage:
                                if stage > 3:
                                    continue
                                for sp in space.sequence_parallel:
                                    if sp and tp == 1:
                                        continue
                                    out.append({"tp": tp, "pp": pp, "vpp": vpp, "cp": cp, "ep": ep,
                                                "zero_stage": stage, "sequence_parallel": sp})
        return out
    if name == "zero":
        return [{"stage": s} for s in (1, 2, 3) if s in space.zero_stage or not space.zero_stage]
    if name == "hsdp":
        return [{"shard_group_size": g} for g in groups]
    if name == "mics":
        return [{"partition_size": g, "hierarchical_params_gather": h}
                for g in groups for h in ((False, True) if g > node else (False,))]
    if name == "zeropp":
        return [{"hpz_partition_size": h} for h in sorted({1, node})]
    if name == "megatron_fsdp":
        return [{"shard_group_size": g, "outer_optim_sharding": o} for g in groups for o in (True, False)]
    if name == "asynchzp":
        plugin = plugin_of("asynchzp")
        out = []
        for c in plugin.candidates(plugin.Config(), scenario.model, scenario.training, topology):
            out.append({"param_group_size": c.param_group_size, "grad_group_size": c.grad_group_size,
                        "optim_group_size": c.optim_group_size})
        return out
    if name == "ddp":
        return [{}]
    return [{}]  # a plugin the search knows nothing about: its defaults


def enumerate_candidates(scenario: Scenario, families: Sequence[str], space: Space) -> list[Candidate]:
    """Every candidate of ``families`` in ``space``, in a stable order."""
    out = []
    for name in families:
        for fields in _family_layouts(name, scenario, space):
            for mbs in space.micro_batch_size:
                for rc in space.activation_recompute:
                    out.append(Candidate(name, tuple(sorted(fields.items())), mbs, rc))
    return out


# ---------------------------------------------------------------------------- scenario variants


def _training(scenario: Scenario, candidate: Candidate) -> Training:
    return dataclasses.replace(scenario.training, micro_batch_size=candidate.micro_batch_size,
                               activation_recompute=candidate.activation_recompute)  # type: ignore[arg-type]


def variant(scenario: Scenario, candidate: Candidate) -> Scenario:
    """``scenario`` with the candidate's training knobs and the candidate as its one strategy."""
    training = _training(scenario, candidate)
    out = dataclasses.replace(scenario, training=training, strategies=(choice_of(candidate),))
    out.__dict__["topology"] = scenario.topology  # share the built topology (a cached_property)
    return out


@functools.cache
def plugin_of(name: str) -> Any:
    """``strategies.get`` once per name (it scans entry points on every call)."""
    return strategies.get(name)


def choice_of(candidate: Candidate) -> StrategyChoice:
    return _choice(candidate.name, candidate.fields)


@functools.lru_cache(maxsize=65536)
def _choice(name: str, fields: tuple[tuple[str, Any], ...]) -> StrategyChoice:
    config_type = plugin_of(name).Config
    names = {f.name for f in dataclasses.fields(config_type)}
    if all(k in names for k, _ in fields):  # the search's own fields: typed already, no coercion needed
        config = config_type(**dict(fields))
        if hasattr(config, "validate"):
            config.validate()
        return StrategyChoice(name, config)
    return StrategyChoice(name, from_mapping(config_type, dict(fields), "strategy"))


def check(scenario: Scenario, candidate: Candidate) -> str | None:
    """Why the candidate cannot run (its plugin's ``check``), or None."""
    return _check(scenario, candidate)


def _check(scenario: Scenario, candidate: Candidate) -> str | None:
    try:
        choice = choice_of(candidate)
        training = _training(scenario, candidate)
        training.validate()
        plugin_of(candidate.name).check(choice.config, scenario.model, training, scenario.topology)
        if candidate.name == "nd":
            cfg = choice.config
            layers = nd.stage_layers(scenario.model.num_layers, cfg.pp, cfg.vpp, cfg.first_stage_layers,
                                     cfg.last_stage_layers)
            if min(layers) == 0:
                # nd.check lets these through, and nd.build then fails: skipped here
                return f"vpp: {len(layers)} virtual stages for {scenario.model.num_layers} layers leave a stage empty"
    except (ValueError, GraphError) as exc:  # ScenarioError is a ValueError
        return str(exc)
    return None


# ---------------------------------------------------------------------------- bounds


@dataclass(frozen=True)
class Bound:
    """Lower bounds of what the simulator would report for one candidate."""

    step_time_s: float  # <= simulated step_time_s
    compute_s: float  # critical rank's compute-stream work: kernels at best-case rates, TP/EP collectives
    comm_s: float  # of which: collectives on the compute stream (TP, EP) and the stragglers they wait for
    bubble_s: float  # pipeline fill and drain the critical stage cannot avoid
    memory_bytes: float  # <= simulated peak_memory_bytes
    link_s: float = 0.0  # least talking time: busiest link's bytes at full rate, or busiest communication stream
    link_limited: bool = False  # the talking term, not the compute-stream chain, set step_time_s
    exposed_s: float = 0.0  # data-parallel gathers before the first forward, reductions after the last backward

    @property
    def limited_by(self) -> str:
        """What makes this candidate slow, by its bound."""
        if self.link_limited:
            return "communication (bytes on the links)"
        if self.bubble_s > max(self.comm_s, self.exposed_s) and self.bubble_s > 0.02 * self.step_time_s:
            return "pipeline bubble"
        if self.comm_s >= self.exposed_s and self.comm_s > 0.02 * self.step_time_s:
            return "exposed TP/EP communication"
        if self.exposed_s > 0.02 * self.step_time_s:
            return "exposed data-parallel communication"
        return "more compute (recompute, imbalance, optimizer)"


class _Costs:
    """Least seconds of kernels and collectives on one topology and precision.

    Kernels: :meth:`ComputeModel.duration_s` of a stand-in op carrying the work's kernel shapes
    (GEMMs and attention) and HBM bytes: exactly the time the simulator charges an op of that
    work (it times an op by its shapes, and a shape's time is linear in its calls, so the
    units' parts add up to the simulator's merged ops). Without shapes, the FLOP totals at the
    large-GEMM rate, which no shape beats, and attention FLOPs at the device's dense peak,
    which no kernel exceeds. Collectives: NCCL's isolated time (``CollectiveModel.plan``),
    stretched, when ``variability`` is credited, by the ``1 + cv · E[max]`` every ring step of
    the symmetric simulation takes (``hardware/variability.py``)."""

    def __init__(self, scenario: Scenario, precision: str, variability: bool) -> None:
        topology = scenario.topology
        self.topology = topology
        self.compute = ComputeModel(topology.device, precision)
        self.collectives = CollectiveModel(topology)
        self.slowdown = self.compute.efficiency.comm_overlap_slowdown
        self.cv = float(topology.spec.variability) if variability else 0.0
        self._spans: dict[Any, Any] = {}
        self._work: dict[Any, float] = {}

    def work_s(self, work: Work) -> float:
        key = (work.gemm, work.attention_forward, work.attention_backward, work.bytes_accessed, work.shapes)
        seconds = self._work.get(key)
        if seconds is None:
            seconds = None
            if work.shapes:  # exactly the time the simulator gives an op of these shapes and bytes
                op = SimpleNamespace(duration_s=0.0, flops=(), bytes_accessed=work.bytes_accessed, shapes=work.shapes)
                try:
                    seconds = self.compute.duration_s(op)  # type: ignore[arg-type]
                except ValueError:  # an attention kernel the device cannot run: the GEMMs only, below
                    seconds = None
            if seconds is None:
                gemms = tuple(s for s in work.shapes if isinstance(s, Gemm))
                if gemms:  # the GEMMs at exactly the time the simulator gives their shapes
                    op = SimpleNamespace(duration_s=0.0, flops=(), bytes_accessed=work.bytes_accessed, shapes=gemms)
                else:  # FLOP totals only: the large-GEMM rate, which no shape beats
                    op = SimpleNamespace(duration_s=0.0, flops=(("gemm", work.gemm),) if work.gemm else (),
                                         bytes_accessed=work.bytes_accessed, shapes=())
                seconds = self.compute.duration_s(op)  # type: ignore[arg-type]
                # attention FLOPs at the dense peak, which no kernel exceeds
                seconds += (work.attention_forward + work.attention_backward) / self.compute.peak_flops_per_s
            self._work[key] = seconds
        return seconds

    def stretch(self, group_size: int) -> float:
        """Factor on a collective's time over ``group_size`` ranks (waiting for the slowest step)."""
        return 1.0 + self.late(group_size)

    def late(self, group_size: int) -> float:
        """A rendezvous of ``group_size`` ranks starts this many seconds late per second of device
        work its ranks did since their previous rendezvous (the symmetric run's expectation)."""
        return self.cv * expected_max_excess(group_size) if self.cv and group_size > 1 else 0.0

    def collective_s(self, kind: str, size: float, ranks: Sequence[int], count: int = 1) -> float:
        if not count or size <= 0 or len(ranks) < 2:
            return 0.0
        return self.collectives.plan(kind, size, self._span(ranks)).isolated_time_s * count * self.stretch(len(ranks))

    def send_s(self, size: float, src: int, dst: int) -> float:
        """A point-to-point send (never stretched: a stage already waits for its neighbour)."""
        if size <= 0 or src == dst:
            return 0.0
        plan = self.collectives.plan("send_recv", size, self._span((src, dst)), self.topology.level_between(src, dst))
        return plan.isolated_time_s

    def _span(self, ranks: Sequence[int]):
        key = ranks if isinstance(ranks, range) else tuple(ranks)
        span = self._spans.get(key)
        if span is None:
            span = self._spans[key] = self.topology.span(key)
        return span

    def add_demand(self, demand: dict[str, float], kind: str, size: float, ranks: Sequence[int],
                   count: float = 1) -> None:
        """Add the bytes a collective puts on each of a rank's links (per level), stretched."""
        if not count or size <= 0 or len(ranks) < 2:
            return
        factor = count * self.stretch(len(ranks))
        for level, b in self.collectives.plan(kind, size, self._span(ranks)).demand_by_level.items():
            demand[level] = demand.get(level, 0.0) + b * factor

    def link_s(self, demand: dict[str, float]) -> float:
        """Least time a rank's links need to carry ``demand`` (each level at its full rate)."""
        return max((b / self.topology.link(level).achieved_bytes_per_s for level, b in demand.items()), default=0.0)


@dataclass(frozen=True)
class _UnitCost:
    forward_s: float  # compute-stream time of one micro-batch's forward: kernels, TP/EP collectives, waits
    backward_s: float
    comm_s: float  # forward + backward compute-stream collectives and the stragglers they wait for
    activation_bytes: float
    dense_params: float
    expert_params: float
    link_bytes: tuple[tuple[str, float], ...] = ()  # per micro-batch, by level: TP/EP bytes (fwd + bwd)
    p2p_bytes: float = 0.0  # activation handed to the next pipeline stage
    tensors: tuple[float, ...] = ()  # dense parameter tensors (the implementation's collective calls)
    after_forward_s: float = 0.0  # the compute stream's next kernel waits this long after the forward
    after_backward_s: float = 0.0
    kernels_s: float = 0.0  # of forward_s + backward_s: the kernels alone (what talking slows)
    kernels_sq: float = 0.0  # sum of the squares of the unit's compute ops' least durations (fwd + bwd)
    forward_sq: float = 0.0  # of which the forward's
    # a pass that is one compute op, then collectives only (no CP, no EP): its kernel time
    # (0: the pass is not one op and gets no slowdown in _nd_pipeline)
    forward_kernel_s: float = 0.0
    backward_kernel_s: float = 0.0
    launches: float = 0.0  # kernels its forward and backward launch (MPUnit.kernels_*)
    tp_calls: int = 0  # TP collective calls of its forward and backward (the logits' gather counted)

    @property
    def forward_and_wait_s(self) -> float:
        return self.forward_s + self.after_forward_s

    @property
    def backward_and_wait_s(self) -> float:
        return self.backward_s + self.after_backward_s


def _unit_costs(costs: _Costs, units: Sequence[MPUnit], deg: ParallelDims, n: int, pp: int) -> list[_UnitCost]:
    """Each unit's forward and backward on the compute stream. A TP or EP collective that
    directly follows a compute op rendezvouses with a stretch of device work at least that op
    long behind it, so it starts ``late(group)`` × that op's time late (``Stragglers.delay_s``:
    W >= the last stretch); one that follows another collective is charged no wait. The engine
    then makes the rank's next kernel wait for that straggler again, counting from the end of
    the stream's previous op (``Engine._stream``: ``waited_s`` starts at ``previous_end_s``, the
    collective's end): ``after_*_s``, which delays the next kernel on the same stream but not
    what depends on the collective itself (sends, reductions)."""
    tp_ranks = range(deg.tp)
    ep_ranks = list(expert_placement(n, deg.ep, deg.etp, pp).group("ep", 0)) if deg.ep > 1 else []
    late_tp, late_ep = costs.late(deg.tp), costs.late(len(ep_ranks))
    out = []
    for u in units:
        w = costs.work_s
        exposed = 1 - deg.tp_comm_overlap
        tp_f = sum(costs.collective_s(k, b * exposed, tp_ranks, c) for k, c, b in u.tp_calls(True))
        tp_b = sum(costs.collective_s(k, b * exposed, tp_ranks, c) for k, c, b in u.tp_calls(False))
        moe = bool(u.is_moe and u.ep_bytes)
        a2a = costs.collective_s("all_to_all", u.ep_bytes, ep_ranks) if moe else 0.0
        pre, remote, post, back, back_remote = (w(u.pre), w(u.remote), w(u.post), w(u.backward),
                                                w(u.backward_remote))
        cp = bool(u.cp_bytes)
        wait_tp_f = late_tp if tp_f else 0.0
        wait_tp_b = late_tp if tp_b else 0.0
        if not cp and not moe:  # one compute op, then the TP all-reduces
            wait_f = after_f = wait_tp_f * (pre + post)
            wait_b = after_b = wait_tp_b * back
        elif moe:  # (remote) TP, dispatch, experts, combine; backward: combine, main, (remote), dispatch, TP
            before = remote if cp else pre
            first = wait_tp_f * before if tp_f else late_ep * before  # TP's, or the dispatch's
            after_f = late_ep * post  # the combine's
            wait_f = 2 * first + after_f  # the experts wait for the first straggler again
            wait_b = after_b = late_ep * (back_remote if cp else back)  # the dispatch's
        else:  # context parallel: the TP all-reduces follow the MLP (or the remote attention)
            wait_f = after_f = wait_tp_f * (post if u.post else remote)
            wait_b = after_b = wait_tp_b * back_remote
        simple = not cp and not moe
        forward_sq = (pre + post) ** 2 if simple else pre ** 2 + remote ** 2 + post ** 2
        fwd = pre + remote + post + tp_f + 2 * a2a + wait_f
        bwd = back + back_remote + tp_b + 2 * a2a + wait_b
        demand: dict[str, float] = {}
        for k, c, b in [*u.tp_calls(True), *u.tp_calls(False)]:
            costs.add_demand(demand, k, b * exposed, tp_ranks, c)
        if moe:
            costs.add_demand(demand, "all_to_all", u.ep_bytes, ep_ranks, 4)
        out.append(_UnitCost(fwd, bwd, tp_f + tp_b + 4 * a2a + wait_f + wait_b, u.activation_bytes, u.dense_params,
                             u.expert_params, tuple(sorted(demand.items())), u.p2p_bytes,
                             tuple(u.tensors) or (u.dense_params,), after_f, after_b,
                             kernels_s=pre + remote + post + back + back_remote,
                             # one op (pre + post) without CP or EP; else pre, remote, post apart
                             kernels_sq=forward_sq + back ** 2 + back_remote ** 2, forward_sq=forward_sq,
                             forward_kernel_s=pre + post if simple else 0.0, backward_kernel_s=back if simple else 0.0,
                             launches=u.kernels_forward + u.kernels_backward,
                             tp_calls=sum(c for _, c, _ in [*u.tp_calls(True, True), *u.tp_calls(False)])))
    return out


def _static_bytes(params: float, sizes: tuple[int, int, int], training, implementation: Implementation) -> float:
    """Resident model states of ``params`` sharded over (param, grad, optim) groups, as
    ``_sharded.ShardedParams`` holds them in ``implementation``'s layout (buffers, which only
    add, left out)."""
    p, g, o = sizes
    per = implementation.state_bytes_per_param(training.param_element_bytes, training.grad_element_bytes)
    return params * per["params"] / p + params * per["grads"] / g + per["optimizer"] * params / o


def _sharded_demand(costs: _Costs, demand: dict[str, float], params: Sequence[float], m: int,
                    sizes: tuple[int, int, int], dp_group: Sequence[int], training, schedule: Schedule,
                    step_gather: bool = True) -> None:
    """Add the link bytes one rank moves in a step for the data-parallel collectives of
    ``_sharded.ShardedParams`` (gathers and reduce-scatters every micro-batch, the step-end
    reductions and the previous step's step-end gather), all of which fall inside the step."""
    p, g, o = sizes
    sharding = NestedSharding(p, g, o, (tuple(dp_group),))
    rank = dp_group[0]
    bw, bg = training.param_element_bytes, training.grad_element_bytes
    inner = schedule.hierarchical_gather

    def members(role: str, size: int = 1) -> tuple[int, ...]:
        return tuple(sharding.group_of(role, rank, size)[1])

    for unit_params, k in sorted(Counter(x for x in params if x > 0).items()):
        if p > 1:
            phases = [("fwd", schedule.forward_gather_bytes_per_element or bw)]
            if schedule.reshard_after_forward:
                phases.append(("bwd", bw))
            for phase, per in phases:
                size = unit_params * per
                if phase == "bwd" and schedule.backward_gather_size:
                    costs.add_demand(demand, "all_gather", size, members("secondary", schedule.backward_gather_size), m * k)
                elif inner > 1:
                    costs.add_demand(demand, "all_gather", size / inner, members("param_outer", inner), m * k)
                    costs.add_demand(demand, "all_gather", size, members("param_inner", inner), m * k)
                else:
                    costs.add_demand(demand, "all_gather", size, members("param"), m * k)
        if g > 1:
            costs.add_demand(demand, "reduce_scatter", unit_params * (schedule.grad_reduce_bytes_per_element or bg), members("grad"), m * k)
        if o > g:
            costs.add_demand(demand, "reduce_scatter", unit_params / g * bg, members("step_rs"), k)
        if len(dp_group) // o > 1:
            costs.add_demand(demand, "all_reduce", unit_params / o * bg, members("replica"), k)
        if o > p and step_gather:
            costs.add_demand(demand, "all_gather", unit_params / p * bw, members("step_ag"), k)


def _group_spans(costs: _Costs, sizes: tuple[int, int, int], dp_group: Sequence[int], schedule: Schedule) -> tuple:
    """Where the data-parallel groups of ``dp_group[0]`` sit (their :class:`GroupSpan`, which
    alone sets a collective's cost): groups placed alike cost alike, whatever their ranks."""
    p, g, o = sizes
    sharding = NestedSharding(p, g, o, (tuple(dp_group),))
    roles = [("param", 1), ("grad", 1), ("step_rs", 1), ("replica", 1), ("step_ag", 1)]
    if schedule.hierarchical_gather > 1:
        roles += [("param_outer", schedule.hierarchical_gather), ("param_inner", schedule.hierarchical_gather)]
    if schedule.backward_gather_size:
        roles.append(("secondary", schedule.backward_gather_size))
    return (len(dp_group), *(costs._span(sharding.group_of(role, dp_group[0], size)[1]) for role, size in roles))


@dataclass(frozen=True)
class _DPUnit:
    """Least seconds of one unit's data-parallel collectives (``_sharded.ShardedParams``), in
    the calls its implementation issues, stretched for stragglers."""

    gather_fwd: float = 0.0  # the forward's all-gather (ag stream), every micro-batch
    gather_bwd: float = 0.0  # the backward's (re-)gather
    reduce: float = 0.0  # the backward's reduce-scatter (rs stream), every micro-batch
    step_rs: float = 0.0  # step end (dp stream): reduce-scatter over the optimizer group
    replica_ar: float = 0.0  # step end: all-reduce over the replicas
    step_ag: float = 0.0  # after the optimizer (dp stream): all-gather of the updated shard


def _dp_units(costs: _Costs, units: Sequence[_UnitCost], sizes: tuple[int, int, int], dp_group: Sequence[int],
              training, schedule: Schedule, memo: dict[Any, _DPUnit] | None = None) -> list[_DPUnit]:
    """Each unit's :class:`_DPUnit` (``memo``: by the unit's parameters and tensors, for one
    sharding, group placement, training and schedule)."""
    p, g, o = sizes
    sharding = NestedSharding(p, g, o, (tuple(dp_group),))
    rank = dp_group[0]
    impl = schedule.implementation
    full = training.activation_recompute == "full"
    regather = full and impl.regather_for_recompute
    bw, bg = training.param_element_bytes, training.grad_element_bytes
    forward_bytes = schedule.forward_gather_bytes_per_element or bw
    reduce_bytes = schedule.grad_reduce_bytes_per_element or bg
    replicas = len(dp_group) // o
    inner, secondary = schedule.hierarchical_gather, schedule.backward_gather_size
    cs = costs.collective_s

    def members(role: str, size: int = 1) -> Sequence[int]:
        return sharding.group_of(role, rank, size)[1]

    def gather(x: float, per_element: float, share: float, calls: int, backward: bool) -> float:
        count = max(calls, 1)
        size = x * per_element * share / count
        if backward and secondary:
            return cs("all_gather", size, members("secondary", secondary), count)
        if inner > 1:
            return (cs("all_gather", size / inner, members("param_outer", inner), count)
                    + cs("all_gather", size, members("param_inner", inner), count))
        return cs("all_gather", size, members("param"), count)

    out = []
    for u in units:
        x, tensors = u.dense_params, u.tensors
        key = (x, tensors)
        if memo is not None and key in memo:
            out.append(memo[key])
            continue
        if x <= 0:
            out.append(_DPUnit())
            continue
        gf = gb = 0.0
        if p > 1:
            gathered = impl.gathered(tensors)
            gf = gather(x, forward_bytes, 1.0, impl.gather_calls(tensors), False)
            if schedule.reshard_after_forward:
                again = impl.backward_gathered(tensors, full)
                calls = (impl.gather_calls(tensors) if regather else 0) + impl.gather_calls(again)
                share = ((1.0 if regather else 0.0) + sum(again) / max(sum(gathered), 1e-30)) if gathered else 1.0
                gb = gather(x, bw, share, calls, True)
        calls = max(impl.reduce_calls(tensors), 1)
        out.append(_DPUnit(
            gf, gb,
            cs("reduce_scatter", x * reduce_bytes / calls, members("grad"), calls) if g > 1 else 0.0,
            cs("reduce_scatter", x / g * bg / calls, members("step_rs"), calls) if o > g else 0.0,
            cs("all_reduce", x / o * bg / calls, members("replica"), calls) if replicas > 1 else 0.0,
            cs("all_gather", x / p * bw / calls, members("step_ag"), calls) if o > p else 0.0,
        ))
        if memo is not None:
            memo[key] = out[-1]
    return out


def _whole_buffer_s(costs: _Costs, params: float, sizes: tuple[int, int, int], dp_group: Sequence[int],
                    training, schedule: Schedule) -> float | None:
    """The step end's one all-reduce of the whole gradient buffer (Megatron 2021), or None when
    the implementation reduces unit by unit."""
    p, g, o = sizes
    if not (schedule.implementation.whole_buffer_step_reduce and o == g and len(dp_group) // o > 1):
        return None
    sharding = NestedSharding(p, g, o, (tuple(dp_group),))
    replica = sharding.group_of("replica", dp_group[0])[1]
    return costs.collective_s("all_reduce", params / o * training.grad_element_bytes, replica)


def _stream_sums(schedule: Schedule, sums: dict[str, float]) -> float:
    """Busiest communication stream: the roles' serial sums added per stream they run on."""
    streams: dict[str, float] = {}
    for role, seconds in sums.items():
        name = schedule.stream(role)
        streams[name] = streams.get(name, 0.0) + seconds
    return max(streams.values(), default=0.0)


def _slowed(kernel_s: float, talking_s: float, slowdown: float, exposed_s: float = 0.0) -> float:
    """Least time for ``kernel_s`` of kernels on a rank that also talks for ``talking_s``, of
    which ``exposed_s`` cannot overlap kernels: kernels run 1/(1 + slowdown) as fast while it
    talks, so at best all the rest of the talking overlaps kernels."""
    talking_s = max(talking_s, exposed_s)
    overlapped = min(talking_s - exposed_s, (1 + slowdown) * kernel_s)
    return kernel_s + talking_s - overlapped / (1 + slowdown)


class Bounder:
    """Lower bounds on the step time and peak memory the simulator reports for a candidate of
    one scenario (caches unit costs across candidates; the candidate must be valid, see
    :func:`check`).

    Why they hold (the engine can only be slower or fuller than this):

    - Step time. Each rank's streams run one op at a time, in program order, each after its
      dependencies; the reported step lies between the optimizer ends of the last two steps,
      and everything a rank does for its last step (forwards, backwards, the collectives they
      wait for, the reductions the gradient norm waits for, the optimizer) falls after its
      previous optimizer. Kernels run at most at the compute model's best-case rates
      (communication only slows them: ``comm_overlap_slowdown``), a collective takes at least
      NCCL's isolated time (links are shared, never faster), stretched by the expected slowest
      ring step and, on the compute stream, started late by the expected slowest member.
      Two bounds follow, and the larger is taken:

      * the chain: a replay of the step's dependencies at those least durations — the
        data-parallel gathers the first forward waits for (prefetch depth and buffer rings
        included), the pipeline's fill and drain with its point-to-point sends, every
        compute-stream op, the reductions after the last backward, the gradient norm (and
        its straggler, twice: :func:`_norm_s`) and the optimizer (for the ZeRO family every
        micro-batch's gathers and reductions). A pipeline stage's body is longer by what its
        reduce-scatters and step-end reductions must slow of its kernels
        (:func:`_slowed_bodies`); refined, the whole pipeline is replayed, every stage's
        schedule against the others' (:func:`_nd_pipeline`);
      * the talking: a rank's communication takes at least its busiest stream's serial sum
        and its busiest link's bytes at full rate; what of it overlaps kernels slows them.

      Pipeline stages restart after a common gradient-norm all-reduce (every stage waits the
      same norm straggler: no other rendezvous of the step is later or larger), so their
      optimizers end apart by at most the largest optimizer's time.
    - Memory. Resident model states (parameters, gradients and optimizer states in their
      shard groups) plus the activations of every forward a stage runs before its first
      backward frees any (one micro-batch through every unit without pipelining; the
      schedule's warm-up with it).
    - Host costs (kernel launches, collective calls) are left out: without synchronisations the
      simulated host thread runs a step ahead of the device, so they are not provably on the
      critical path of the reported step.
    """

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self._costs: dict[tuple[str, bool], _Costs] = {}
        self._units: dict[tuple, list[_UnitCost]] = {}
        self._demand: dict[tuple, dict[str, float]] = {}
        self._dp: dict[tuple, list[_DPUnit]] = {}
        self._dp_unit: dict[tuple, dict[Any, _DPUnit]] = {}
        self._spans: dict[tuple, tuple] = {}
        self._layouts: dict[tuple, Any] = {}
        self._prefix: dict[int, tuple[list[_UnitCost], dict[str, Any]]] = {}
        self._last_action: dict[tuple[int, int, int], tuple[str, int, int]] = {}

    def sharded_demand(self, costs: _Costs, params: Sequence[float], m: int, sizes: tuple[int, int, int],
                       dp_group: Sequence[int], training, schedule: Schedule) -> dict[str, float]:
        # with experts, the dense step-end gather may start before the experts' optimizer ends
        # (outside the window the bound looks at): left out
        step_gather = self.scenario.model.moe is None
        key = (id(costs), tuple(params), m, sizes, self.spans(costs, sizes, dp_group, schedule),
               training.param_element_bytes, training.grad_element_bytes, schedule)
        if key not in self._demand:
            demand: dict[str, float] = {}
            _sharded_demand(costs, demand, params, m, sizes, dp_group, training, schedule, step_gather)
            self._demand[key] = demand
        return self._demand[key]

    def dp_units(self, costs: _Costs, units: list[_UnitCost], lo: int, hi: int, sizes: tuple[int, int, int],
                 dp_group: Sequence[int], training, schedule: Schedule) -> list[_DPUnit]:
        spans = self.spans(costs, sizes, dp_group, schedule)
        key = (id(units), lo, hi, sizes, spans, training.param_element_bytes, training.grad_element_bytes,
               training.activation_recompute, schedule)
        if key not in self._dp:
            memo = self._dp_unit.setdefault(key[3:] + (id(costs),), {})
            self._dp[key] = _dp_units(costs, units[lo:hi], sizes, dp_group, training, schedule, memo)
        return self._dp[key]

    def spans(self, costs: _Costs, sizes: tuple[int, int, int], dp_group: Sequence[int], schedule: Schedule) -> tuple:
        key = (id(costs), sizes, _range_key(dp_group), schedule.hierarchical_gather, schedule.backward_gather_size)
        if key not in self._spans:
            self._spans[key] = _group_spans(costs, sizes, dp_group, schedule)
        return self._spans[key]

    def prefix(self, unit_costs: list[_UnitCost]) -> dict[str, Any]:
        """Cumulative sums over the units of each cost (sums over any run of units in O(1))."""
        key = id(unit_costs)
        if key not in self._prefix:
            out: dict[str, Any] = {}
            levels = sorted({level for u in unit_costs for level, _ in u.link_bytes})
            columns = {attr: [getattr(u, attr) for u in unit_costs] for attr in
                       ("forward_s", "backward_s", "comm_s", "activation_bytes", "dense_params", "expert_params",
                        "forward_and_wait_s", "backward_and_wait_s", "kernels_s", "kernels_sq")}
            for level in levels:
                columns["link." + level] = [dict(u.link_bytes).get(level, 0.0) for u in unit_costs]
            for attr, values in columns.items():
                running, acc = [0.0], 0.0
                for value in values:
                    acc += value
                    running.append(acc)
                out[attr] = running
            out["levels"] = levels
            self._prefix[key] = (unit_costs, out)  # keep the list alive: its id is the key
        return self._prefix[key][1]

    def nd_layout(self, cfg: Any, training) -> Any:
        key = (cfg, training.micro_batch_size, training.global_batch_size)
        if key not in self._layouts:
            self._layouts[key] = nd.layout(cfg, self.scenario.model, training, self.scenario.topology)
        return self._layouts[key]

    def last_action(self, p: int, v: int, m: int) -> tuple[str, int, int]:
        """The last action of every stage's pipeline schedule (the same on every stage)."""
        key = (p, v, m)
        if key not in self._last_action:
            self._last_action[key] = nd.pipeline_actions(p, v, m, 0)[-1]
        return self._last_action[key]

    def actions(self, p: int, v: int, m: int, s: int) -> list[tuple[str, int, int]]:
        return nd.pipeline_actions(p, v, m, s)

    def costs(self, precision: str, variability: bool = True) -> _Costs:
        key = (precision, variability)
        if key not in self._costs:
            self._costs[key] = _Costs(self.scenario, precision, variability)
        return self._costs[key]

    def units(self, training, deg: ParallelDims, pp: int, variability: bool = True) -> list[_UnitCost]:
        # a unit as one model-parallel rank runs it does not depend on the pipeline or the data
        # parallelism (mp_units reads tp, cp, ep, etp, sequence parallelism, the MoE imbalance;
        # _unit_costs the TP overlap and, for the expert groups' placement, pp): shared by them
        deg = dataclasses.replace(deg, pp=1, vpp=1, dp=None)
        pp = pp if deg.ep > 1 else 1
        key = (training.micro_batch_size, training.activation_recompute, deg, pp, variability)
        if key not in self._units:
            sc = self.scenario
            self._units[key] = _unit_costs(self.costs(training.precision, variability),
                                           mp_units(sc.model, training, deg), deg, sc.topology.num_devices, pp)
        return self._units[key]

    def __call__(self, candidate: Candidate, refine: bool = False) -> Bound:
        """The bounds; ``refine`` adds what is too slow to compute for every candidate (for the
        few the search is about to simulate): ND stages replayed with every micro-batch's
        data-parallel collectives."""
        cfg = choice_of(candidate).config
        training = _training(self.scenario, candidate)
        if candidate.name == "nd":
            return _nd_bound(self, cfg, training, refine)
        return _family_bound(self, candidate.name, cfg, training)


def _range_key(ranks: Sequence[int]) -> Any:
    return (ranks.start, ranks.stop, ranks.step) if isinstance(ranks, range) else tuple(ranks)


def bound(scenario: Scenario, candidate: Candidate) -> Bound:
    """:class:`Bounder` for one candidate."""
    return Bounder(scenario)(candidate)


def _norm_s(costs: _Costs, n: int, squares: float = 0.0) -> float:
    """The global gradient-norm all-reduce (one fp32 scalar over every rank, compute stream),
    and, given ``squares``, the wait for its straggler twice: in the collective and before the
    optimizer after it (``Engine._collective`` / ``Engine._stream``).

    The norm is the step's only rendezvous of all ``n`` ranks when ``squares`` is passed, so its
    slowest member is late by ``cv · E[max of n] · W`` with ``W² `` the sum of the squared
    stretches of device work since the previous norm (``Stragglers._since``). Each compute op
    adds its whole duration to the stretch it ends in, and (a + b)² >= a² + b², so W² is at
    least the sum of the squares of the ops' least durations on the slowest simulated rank:
    ``squares``. The optimizer after the norm starts when the norm ends and waits the same
    straggler again (``waited_s`` counts from the norm's end)."""
    seconds = costs.collective_s("all_reduce", 4.0, range(n))
    if squares > 0:
        seconds += 2 * costs.late(n) * math.sqrt(squares)
    return seconds


def _nd_bound(bounder: Bounder, cfg: Any, training, refine: bool = False) -> Bound:
    scenario = bounder.scenario
    topology = scenario.topology
    n = topology.num_devices
    deg = nd.dims(cfg)
    lay = bounder.nd_layout(cfg, training)
    p, v, m = cfg.pp, cfg.vpp, lay.num_micro_batches
    # the symmetric run charges stragglers' expectations when each simulated stage stands for
    # several devices (with one device per stage it draws them: no credit then)
    credit = n // p > 1
    costs = bounder.costs(training.precision, credit)
    sd = costs.slowdown
    opt_rate = optimizer_bytes_per_param(training)
    unit_costs = bounder.units(training, deg, p, credit)
    pre = bounder.prefix(unit_costs)
    schedule = nd.schedule(cfg)
    # units of each virtual stage, [lo, hi): the embedding on the first, the head on the last
    edges = [0]
    for count in lay.layers_per_virtual_stage:
        edges.append(edges[-1] + count)
    spans = [(0 if j == 0 else edges[j] + 1, len(unit_costs) if j == len(edges) - 2 else edges[j + 1] + 1)
             for j in range(len(edges) - 1)]

    def run_sum(attr: str, j: int) -> float:
        lo, hi = spans[j]
        column = pre[attr]
        return column[hi] - column[lo]

    fwd = [run_sum("forward_and_wait_s", j) for j in range(len(spans))]  # passes with their trailing waits
    bwd = [run_sum("backward_and_wait_s", j) for j in range(len(spans))]
    waits = [fwd[j] + bwd[j] - run_sum("forward_s", j) - run_sum("backward_s", j) for j in range(len(spans))]
    comm = [run_sum("comm_s", j) for j in range(len(spans))]
    acts = [run_sum("activation_bytes", j) for j in range(len(spans))]
    dense_dp = lay.dp * cfg.cp
    sizes = nd._sharding_sizes(cfg.zero_stage, dense_dp)
    ps, gs, os_ = sizes
    block = cfg.tp * cfg.cp * lay.dp
    last = bounder.last_action(p, v, m)
    drains = last[1] == 0 and last[2] == m - 1  # every stage ends on chunk 0's last micro-batch
    wait_all = not schedule.effective_overlap_grad_reduce

    opt_lo, opt_up, early, work, talk, idle, memory = [], [], [], [], [], [], 0.0
    heads, tails, exposed, windows = [], [], [], []
    for s in range(p):
        vstages = [c * p + s for c in range(v)]
        work.append(m * sum(fwd[j] + bwd[j] for j in vstages))
        talk.append(m * sum(comm[j] for j in vstages))
        idle.append(m * sum(waits[j] for j in vstages))
        dense = sum(run_sum("dense_params", j) for j in vstages)
        expert = sum(run_sum("expert_params", j) for j in vstages)
        # the stage's optimizers: at least the dense one's, at most (slowed, experts unsharded)
        opt_lo.append(costs.work_s(Work(bytes_accessed=dense / os_ * opt_rate)))
        opt_up.append((1 + sd) * costs.work_s(Work(bytes_accessed=(dense / os_ + expert) * opt_rate)))
        # the dense step-end gathers follow the dense optimizer, which ends before the experts'
        early.append((1 + sd) * costs.work_s(Work(bytes_accessed=expert * opt_rate)) if expert else 0.0)
        # forwards before the first backward (Megatron's warm-up, then one steady forward)
        warmup = min(p - s - 1, m) if v == 1 else min((p - s - 1) * 2 + (v - 1) * p, m * v)
        held = sum(acts[((k // p) % v) * p + s] for k in range(warmup + (1 if m * v > warmup else 0)))
        memory = max(memory, _static_bytes(dense, sizes, training, schedule.implementation) + held)
    max_up = max(opt_up)
    # the norm's straggler: the stages' compute ops since the previous norm (every other group
    # is smaller than the world, so no other rendezvous resets the stretch)
    moe = scenario.model.moe is not None
    groups = (cfg.tp, cfg.cp, dense_dp, cfg.ep, n // (cfg.ep * cfg.etp * p) if moe else 1)
    squares = 0.0
    if max(groups) < n:
        squares = max(m * sum(run_sum("kernels_sq", c * p + s) for c in range(v)) + opt_lo[s] ** 2 for s in range(p))
    norm = _norm_s(costs, n, squares)

    # the chain: fill (chunk 0 of micro-batch 0 through the stages, each behind its own step-end
    # gathers), each stage's own work, drain (chunk 0 of the last micro-batch back), reductions
    ends: list[float] = []
    readies: list[list[float]] = []
    arrival = -math.inf
    stage_dp: list[list[_DPUnit]] = []
    for s in range(p):
        lo, hi = spans[s]
        # the (dp, cp) group of stage s's first rank; ranks are placed tp, cp, dp, pp (tp fastest)
        dp_group = range(s * block, (s + 1) * block, cfg.tp)
        local = [(spans[c * p + s]) for c in range(v)]
        dpu = [d for a, b in local for d in bounder.dp_units(costs, unit_costs, a, b, sizes, dp_group, training, schedule)]
        stage_dp.append(dpu)
        release = opt_lo[s]
        ready0 = release - early[s]
        all_gathered = ready0 + sum(d.step_ag for d in dpu)
        t = max(release, arrival)
        t_dp = t_ag = ready0
        stage_ready = [ready0] * len(dpu)  # when each local unit's parameters are ready
        for i, d in enumerate(dpu):
            if d.step_ag:
                t_dp += d.step_ag
                stage_ready[i] = t_dp
        if not schedule.overlap_param_gather:
            stage_ready = [all_gathered] * len(dpu)
        readies.append(stage_ready)
        t_dp = ready0
        for k in range(lo, hi):
            d = dpu[k - lo]
            ready = ready0
            if d.step_ag:
                t_dp = max(t_dp, ready) + d.step_ag
                ready = t_dp if schedule.overlap_param_gather else all_gathered
            if d.gather_fwd:
                t_ag = max(t_ag, ready) + d.gather_fwd
                ready = t_ag
            if k == lo:  # talking before the stage's first kernel (less what may precede the boundary)
                heads.append(max(0.0, d.step_ag + d.gather_fwd - early[s]))
            t = max(t, ready) + unit_costs[k].forward_s + (unit_costs[k].after_forward_s if k < hi - 1 else 0.0)
        first_forward_end = t
        # the rest of the stage's work, but not the last pass's trailing wait (what follows the
        # last pass, the send and the reductions, depends on its collectives, not on the wait)
        ends.append(first_forward_end + work[s] - fwd[s] + unit_costs[hi - 1].after_forward_s
                    - unit_costs[lo].after_backward_s)
        if s + 1 < p:
            arrival = first_forward_end + costs.send_s(unit_costs[hi - 1].p2p_bytes, s * block, (s + 1) * block)
    last_pass = [bwd[s] - unit_costs[spans[s][0]].after_backward_s for s in range(p)]
    bodies = [e - last_pass[s] for s, e in enumerate(ends)]  # the last pass (chunk 0's) begins after the rest
    backs = [costs.send_s(unit_costs[spans[s + 1][0]].p2p_bytes, (s + 1) * block, s * block) for s in range(p - 1)]
    starts = _drain(bodies, last_pass, backs, drains)
    ends = [starts[s] + last_pass[s] for s in range(p)]
    readies_s: list[float] = []
    for s in range(p):
        lo, hi = spans[s]
        dpu = stage_dp[s]
        dp_group = range(s * block, (s + 1) * block, cfg.tp)
        z = ends[s]
        # chunk 0's units in the last backward (the stage's last action when ``drains``), in
        # reverse order from the pass's earliest start; their reductions, then the step-end ones
        # (which the dp stream runs last, after the other chunks' units)
        finals = []
        last_chain = 0.0
        if drains:
            at = starts[s]
            t_rs = -math.inf
            for k in range(hi - 1, lo - 1, -1):  # k = lo is the last backward
                d = dpu[k - lo]
                at += unit_costs[k].backward_s
                done = at
                at += unit_costs[k].after_backward_s  # before the next unit's kernel
                if d.reduce:
                    t_rs = max(t_rs, done) + d.reduce
                    done = t_rs
                finals.append((k, done, d))
            d = dpu[0]
            last_chain = d.reduce + d.step_rs + d.replica_ar
        t_dp = -math.inf
        ready = z
        whole = _whole_buffer_s(costs, sum(unit_costs[k].dense_params for a, b in
                                           [spans[c * p + s] for c in range(v)] for k in range(a, b)),
                                sizes, dp_group, training, schedule)
        if whole is not None:
            after = [f for _, f, _ in finals] + ([z] if drains or wait_all else [])
            if after:
                ready = max(ready, max(after) + whole)
            last_chain = dpu[0].reduce + whole if drains else 0.0
        else:
            for _, done, d in finals:  # descending unit index: the order the dp stream reduces them
                if d.step_rs:
                    t_dp = max(t_dp, done, z if wait_all else -math.inf) + d.step_rs
                    done = t_dp
                if d.replica_ar:
                    t_dp = max(t_dp, done, z if wait_all else -math.inf) + d.replica_ar
                    done = t_dp
                ready = max(ready, done)
        tails.append(ready - z)
        readies_s.append(ready)
        exposed.append(last_chain)
    norm_ready = max(readies_s)
    if sd > 0:
        # talking slows the kernels it overlaps (see _slowed_bodies): the bodies end later
        after = [readies_s[s] - starts[s] for s in range(p)]  # from the last pass's start to the norm
        later = _slowed_bodies(bounder, costs, unit_costs, spans, p, v, m, stage_dp, work, after, last_pass, backs,
                               drains, sizes, block, cfg.tp, training, schedule)
        if any(later):
            moved = _drain([b + x for b, x in zip(bodies, later)], last_pass, backs, drains)
            norm_ready = max(norm_ready, max(moved[s] + after[s] for s in range(p)))
    if refine:
        wholes = [_whole_buffer_s(costs, sum(unit_costs[k].dense_params for c in range(v) for k in range(*spans[c * p + s])),
                                  sizes, range(s * block, (s + 1) * block, cfg.tp), training, schedule) for s in range(p)]
        # the first step-end reduction's straggler (_nd_pipeline), when its group is the
        # largest the stage meets after the previous optimizer's step-end gathers
        group = os_ // gs if os_ > gs else dense_dp // os_
        others = (cfg.tp, cfg.cp, cfg.ep if moe else 1, gs, ps)
        first_late = costs.late(group) if group > 1 and max(others) < group and not moe else 0.0
        piped = _nd_pipeline(costs, unit_costs, spans, p, v, m, block, lambda s: bounder.actions(p, v, m, s), stage_dp,
                             readies, opt_lo, wholes, schedule, first_late, os_ > ps,
                             _host_ahead(unit_costs, spans, p, v, m, training, topology, schedule, sizes, moe or cfg.cp > 1))
        norm_ready = max(norm_ready, piped)
    chain = norm_ready + norm + max(opt_lo) - max_up
    critical = max(range(p), key=lambda s: (ends[s] + tails[s], -s))

    # the talking: per stage, within its own window (from its step-end gathers to its optimizer)
    for s in range(p):
        dpu = stage_dp[s]
        vstages = [c * p + s for c in range(v)]
        dp_group = range(s * block, (s + 1) * block, cfg.tp)
        params = tuple(unit_costs[u].dense_params for j in vstages for u in range(*spans[j]))
        demand = dict(bounder.sharded_demand(costs, params, m, sizes, dp_group, training, Schedule()))
        for level in pre["levels"]:
            lb = sum(run_sum("link." + level, j) for j in vstages)
            if lb:
                demand[level] = demand.get(level, 0.0) + m * lb
        whole = _whole_buffer_s(costs, sum(params), sizes, dp_group, training, schedule)
        streams = {
            "ag": m * sum(d.gather_fwd + d.gather_bwd for d in dpu),
            "rs": m * sum(d.reduce for d in dpu),
            "dp": sum(d.step_ag for d in dpu) + (whole if whole is not None else sum(d.step_rs + d.replica_ar for d in dpu)),
        }
        talking = max(costs.link_s(demand), _stream_sums(schedule, streams))
        non_overlapping = talk[s] + norm + heads[s] + exposed[s]
        kernels = work[s] - talk[s] - idle[s] + opt_lo[s]
        windows.append(_slowed(kernels, talking, sd, non_overlapping) - (max_up - opt_lo[s] + early[s]))
    window = max(windows)
    step = max(chain, window, 0.0)
    w, tk = work[critical], talk[critical]
    exp = tails[critical] + norm + heads[critical]
    return Bound(step, w, tk, max(0.0, chain - w - exp), memory, window, window > chain, exp)


def _drain(bodies: list[float], last_pass: list[float], backs: list[float], drains: bool) -> list[float]:
    """When each stage's last pass can start: after the rest of its work (``bodies``) and, when
    every stage ends on chunk 0's last micro-batch (``drains``), after the next stage's last
    pass and the send of its gradient (``backs[s]``: stage s + 1 to s)."""
    starts = list(bodies)
    if drains:
        for s in range(len(starts) - 2, -1, -1):
            starts[s] = max(starts[s], starts[s + 1] + last_pass[s + 1] + backs[s])
    return starts


def _slowed_bodies(bounder: Bounder, costs: _Costs, unit_costs: list[_UnitCost], spans: list[tuple[int, int]],
                   p: int, v: int, m: int, stage_dp: list[list[_DPUnit]], work: list[float], after: list[float],
                   last_pass: list[float], backs: list[float], drains: bool, sizes: tuple[int, int, int],
                   block: int, tp: int, training, schedule: Schedule) -> list[float]:
    """How much later each stage's body (its passes after the first forward and before the last
    one) ends than the chain says, because kernels run 1/(1 + slowdown) as fast while the rank
    talks (``Engine._talk``: any collective it sends in is in flight).

    Stage j's body of length L holds kernels K (at full rate: K_fast + K_slow/(1 + sd) = K),
    non-kernel time Y >= N (compute-stream collectives, straggler waits, idle; N the chain's)
    and the rank talks for T of it: the slowed kernel time K_slow >= T - Y, so
    L = K + Y + K_slow·sd/(1 + sd) >= K + N + sd/(1 + sd)·max(0, T - N) (increasing in Y).
    A communication stream whose ops all start after the body starts (a backward's gradient
    reduce-scatters; the step-end reductions) and all end before the gradient norm starts
    (which waits for them) is busy at least R in the step; of that, x falls after the body's
    end, and the norm cannot start before the body's end + x, nor before the body's end + D
    (D: the chain's longest path from there to the norm: this stage's last pass, the drain
    through the stages before it, their reductions). So T >= R - x, and the norm starts at
    least at body end + sd'·max(0, R - x - N) + max(D, x), whose least value over x is
    D + sd'·max(0, R - N - D) (sd' = sd/(1 + sd)): the body ends sd'·max(0, R - N - D) later,
    whatever x is. The bound takes the busiest such stream."""
    sdp = costs.slowdown / (1 + costs.slowdown)
    pre = bounder.prefix(unit_costs)
    # D: the longest path from a body's end to the norm (the last passes drain down the stages)
    longest: list[float] = []
    for j in range(p):
        d = after[j]
        if drains and j > 0:
            d = max(d, last_pass[j] + backs[j - 1] + longest[j - 1])
        longest.append(d)
    out = []
    for j in range(p):
        dpu = stage_dp[j]
        dp_group = range(j * block, (j + 1) * block, tp)
        kernels = sum(pre["kernels_s"][b] - pre["kernels_s"][a] for a, b in (spans[c * p + j] for c in range(v)))
        # the body's non-kernel time, at most all passes' (a larger N only lowers the bound)
        non_kernel = work[j] - m * kernels + unit_costs[spans[j][1] - 1].after_forward_s
        whole = _whole_buffer_s(costs, sum(unit_costs[k].dense_params for c in range(v)
                                           for k in range(*spans[c * p + j])), sizes, dp_group, training, schedule)
        busy: dict[str, float] = {}
        for role, seconds in (("rs", m * sum(d.reduce for d in dpu)),
                              ("dp", whole if whole is not None else sum(d.step_rs + d.replica_ar for d in dpu))):
            name = schedule.stream(role)
            busy[name] = busy.get(name, 0.0) + seconds
        talking = max(busy.values(), default=0.0)
        out.append(sdp * max(0.0, talking - non_kernel - longest[j]))
    return out


def _host_ahead(unit_costs: list[_UnitCost], spans: list[tuple[int, int]], p: int, v: int, m: int, training,
                topology, schedule: Schedule, sizes: tuple[int, int, int], other_calls: bool) -> bool:
    """Whether every host op of the reported step has ended before the step begins, so that no
    device op of it waits for its launch or call (the step-end reductions are called after the
    step's last launch).

    Without synchronisations (no ``sync_*`` of the implementation, asynchronous kernels, calls
    paid by the training thread) a rank's host ops depend on nothing but each other: the host
    thread runs them back to back from time 0, and the ops of steps 0 .. k end by (k + 1) x its
    time per step. Step k begins after every stage ran step k - 1's kernels, at least k x the
    largest stage's kernel time. A step's host ops are the launches of its compute ops
    (``Implementation.launch_s`` of their kernels, with the TP calls that follow them) and the
    calls of its data-parallel collectives and gradient norm; each call costs at most
    ``call_host_s(1, n)``. Left undecided (False) with parameter gathers, CP or EP calls."""
    impl = schedule.implementation.on_device(topology.device)
    if not impl.host:
        return True
    if (impl.synchronous or impl.sync_before_gather or impl.sync_after_reduce or impl.sync_after_p2p
            or impl.calls_from_comm_threads or sizes[0] > 1 or other_calls):
        return False
    per_call = impl.call_host_s(1, topology.num_devices)
    host = kernels = 0.0
    for s in range(p):
        local = [unit_costs[k] for c in range(v) for k in range(*spans[c * p + s])]
        reduce_calls = sum(max(impl.reduce_calls(u.tensors), 1) for u in local if u.dense_params > 0)
        calls = m * sum(u.tp_calls for u in local) + (m if sizes[1] > 1 else 0) * reduce_calls + 3 * reduce_calls + 3
        host = max(host, impl.launch_s(m * sum(u.launches for u in local)) + per_call * calls)
        kernels = max(kernels, m * sum(u.kernels_s for u in local))
    steps = training.num_steps
    return steps * host <= (steps - 1) * kernels


def _nd_pipeline(costs: _Costs, unit_costs: list[_UnitCost], spans: list[tuple[int, int]], p: int, v: int, m: int,
                 block: int, actions: Callable[[int], list[tuple[str, int, int]]], stage_dp: list[list[_DPUnit]],
                 readies: list[list[float]], release: list[float], wholes: list[float | None], schedule: Schedule,
                 first_late: float = 0.0, step_gathers: bool = False, host_ahead: bool = False) -> float:
    """When the norm can start at the earliest, by the whole pipeline replayed: every stage's
    schedule (``nd.pipeline_actions``), pass by pass and unit by unit, each op at its least
    duration after its dependencies (the previous op of its stream, the activation or gradient
    sent point to point by the neighbouring virtual stage, the parameters' gathers and prefetch
    ring, the gradient-buffer ring of the reduce-scatters, the step-end reductions as each
    unit's last backward ends). Every real time is at least the replayed one: the engine's ops
    wait for the same dependencies (and more), take at least these durations, and each op's end
    only grows with the times it depends on.

    Talking slows kernels (``Engine._talk``). A communication stream whose op was started by an
    earlier op of the compute stream (a reduce-scatter after a backward, a step-end reduction,
    a point-to-point send, the step-end gathers after the previous optimizer) stays busy from
    that op's end until the stream's last issued op ends: every queued op's dependencies are
    done by then, and so is its host call, issued before the launch of the kernel that follows
    (the step-end reductions are called after the step's last launch: they count only when the
    host thread is provably ahead). Not counted: a stream shared with another role, or one
    whose calls are paid on the stream itself (both leave gaps without talking).
    A pass that is one compute op then collectives, starting at s before that busy end
    b, runs its kernels 1/(1 + slowdown) as fast until b: it ends at least
    s + d + sd/(1 + sd)·min(b - s, (1 + sd)·d), which only grows with s and b. (A merged op of
    several units is slowed at least as much: the replay's collectives between the units only
    take window time away from its kernels.)

    ``host_ahead``: see :func:`_host_ahead`.

    ``first_late``: the stage's first step-end reduction rendezvouses a group larger than any
    other of the step since the previous optimizer's step-end gathers, so it starts late by
    ``first_late`` · W, W² at least the sum of the squared least durations of the compute ops
    that ended since the last of those gathers (when ``step_gathers``, from the first forward
    of the unit gathered last, which waits for it; see :func:`_norm_s`)."""
    depth, slots = schedule.effective_prefetch_depth, schedule.reduce_buffers
    reshard = schedule.reshard_after_forward
    wait_all = not schedule.effective_overlap_grad_reduce
    sd = costs.slowdown
    sdp = sd / (1 + sd)
    # which streams' busy spells are talking from a kernel's start to their end (see above)
    impl = schedule.implementation
    exclusive = {role: sum(schedule.stream(r) == schedule.stream(role) for r in ("ag", "rs", "dp")) == 1
                 for role in ("rs", "dp")}
    paid_on_stream = impl.host and impl.calls_from_comm_threads  # call ops, not talking, on the stream
    rs_talks = exclusive["rs"] and not paid_on_stream
    dp_talks = exclusive["dp"] and not paid_on_stream
    # the step-end reductions are issued after the step's last launch: only without a host
    # thread, or with one provably ahead of the device (_host_ahead), are they started when
    # their units' last backward ends
    reductions_talk = dp_talks and (not impl.host or host_ahead)
    last_vs = p * v - 1
    # per stage: compute stream (free at t, next kernel waits ``after`` more), its streams
    t = list(release)
    after = [0.0] * p
    t_ag = [-math.inf] * p
    t_rs = [-math.inf] * p
    t_fwd = [-math.inf] * p  # pp_fwd send stream
    t_bwd = [-math.inf] * p
    # the dp stream: the previous optimizer's step-end gathers, then the reductions
    t_dp = [max(r, default=-math.inf) for r in readies]
    gathers_end = list(t_dp)
    consumed: list[list[float]] = [[] for _ in range(p)]
    scatters: list[list[float]] = [[] for _ in range(p)]
    final: list[list[float]] = [[-math.inf] * len(stage_dp[s]) for s in range(p)]
    reduced = [-math.inf] * p  # when the stage's step-end reductions issued so far end
    next_reduce = [len(stage_dp[s]) - 1 for s in range(p)]  # reduce_step's order: descending unit index
    squares = [0.0] * p
    counting = [not step_gathers or not any(d.step_ag for d in stage_dp[s]) for s in range(p)]
    late_paid = [not first_late] * p
    inline = not wait_all and all(w is None for w in wholes)
    offsets = []
    for s in range(p):
        offset = [0]
        for c in range(v):
            lo, hi = spans[c * p + s]
            offset.append(offset[-1] + hi - lo)
        offsets.append(offset)
    plans = [actions(s) for s in range(p)]
    position = [0] * p
    sent: dict[tuple[str, int, int], float] = {}  # (direction, virtual stage, micro-batch) -> arrival
    sends: dict[tuple[int, int, float], float] = {}

    def send_s(src: int, dst: int, size: float) -> float:
        key = (src, dst, size)
        if key not in sends:
            sends[key] = costs.send_s(size, src * block, dst * block)
        return sends[key]

    def reduce(s: int) -> None:
        """Issue the stage's step-end reductions whose turn has come (their units' last
        backward done), in the dp stream's order."""
        dpu = stage_dp[s]
        while next_reduce[s] >= 0 and final[s][next_reduce[s]] > -math.inf:
            i = next_reduce[s]
            done = final[s][i]
            for seconds in (dpu[i].step_rs, dpu[i].replica_ar):
                if seconds:
                    if not late_paid[s]:
                        seconds += first_late * math.sqrt(squares[s])
                        late_paid[s] = True
                    t_dp[s] = max(t_dp[s], done) + seconds
                    done = t_dp[s]
            reduced[s] = max(reduced[s], done)
            next_reduce[s] -= 1

    pending = True
    while pending:
        pending = progressed = False
        for s in range(p):
            plan, dpu, params_ready, offset = plans[s], stage_dp[s], readies[s], offsets[s]
            # the unit whose step-end gather the dp stream runs last
            top = max((i for i, d in enumerate(dpu) if d.step_ag), default=-1)
            while position[s] < len(plan):
                kind, c, mb = plan[position[s]]
                vs = c * p + s
                forward = kind == "F"
                if forward:
                    key = ("F", vs - 1, mb)
                    if vs > 0 and key not in sent:
                        break
                else:
                    key = ("B", vs + 1, mb)
                    if vs < last_vs and key not in sent:
                        break
                incoming = sent.pop(key, -math.inf)
                lo, hi = spans[vs]
                now, wait = t[s], after[s]
                order = range(lo, hi) if forward else range(hi - 1, lo - 1, -1)
                # a pass whose units wait for nothing but each other may run as one merged op
                # (nd._Stage.merged: its collectives after all its kernels, one straggler wait
                # after the pass): its units' waits are charged after the pass, not between
                free = not any(
                    (dpu[offset[c] + k - lo].gather_fwd or mb == 0) if forward
                    else (dpu[offset[c] + k - lo].gather_bwd and reshard) or dpu[offset[c] + k - lo].reduce
                    for k in list(order)[1:])
                deferred = 0.0
                first = True
                for k in order:
                    i = offset[c] + k - lo
                    d, uc = dpu[i], unit_costs[k]
                    if first:
                        start = max(now + wait, incoming)
                        first = False
                    elif free:
                        deferred += wait
                        start = now
                    else:
                        start = now + wait
                    gathered = bool(d.gather_fwd) if forward else bool(d.gather_bwd and reshard)
                    if gathered:
                        slot = len(consumed[s]) - depth - 1
                        t_ag[s] = max(t_ag[s], params_ready[i], consumed[s][slot] if slot >= 0 else -math.inf) + (
                            d.gather_fwd if forward else d.gather_bwd)
                        start = max(start, t_ag[s])
                    elif forward and mb == 0:
                        start = max(start, params_ready[i])
                    if not forward and d.reduce and len(scatters[s]) >= slots:
                        start = max(start, scatters[s][-slots])
                    if forward:
                        seconds, kernel, wait = uc.forward_s, uc.forward_kernel_s, uc.after_forward_s
                    else:
                        seconds, kernel, wait = uc.backward_s, uc.backward_kernel_s, uc.after_backward_s
                    if sd and kernel:
                        busy = max(t_rs[s] if rs_talks else -math.inf, gathers_end[s] if dp_talks else -math.inf,
                                   t_dp[s] if reductions_talk else -math.inf, t_fwd[s], t_bwd[s])
                        if busy > start:
                            seconds += sdp * min(busy - start, (1 + sd) * kernel)
                    now = start + seconds
                    if counting[s]:
                        squares[s] += uc.forward_sq if forward else uc.kernels_sq - uc.forward_sq
                    elif forward and mb == 0 and i == top:
                        counting[s] = True
                        squares[s] += uc.forward_sq
                    if gathered:
                        consumed[s].append(now)
                    if not forward:
                        done = now
                        if d.reduce:
                            t_rs[s] = max(t_rs[s], now) + d.reduce
                            scatters[s].append(t_rs[s])
                            done = t_rs[s]
                        if mb == m - 1:
                            final[s][i] = done
                            if inline:
                                reduce(s)
                t[s], after[s] = now, deferred + wait
                if forward and vs < last_vs:
                    dst = (s + 1) % p
                    t_fwd[s] = max(t_fwd[s], now) + send_s(s, dst, unit_costs[hi - 1].p2p_bytes)
                    sent[("F", vs, mb)] = t_fwd[s]
                elif not forward and vs > 0:
                    dst = (s - 1) % p
                    t_bwd[s] = max(t_bwd[s], now) + send_s(s, dst, unit_costs[lo].p2p_bytes)
                    sent[("B", vs, mb)] = t_bwd[s]
                position[s] += 1
                progressed = True
            pending |= position[s] < len(plan)
        assert progressed or not pending, "pipeline replay deadlocked"
    out = -math.inf
    for s in range(p):
        dpu = stage_dp[s]
        end = t[s]
        ready = max(end, *final[s], reduced[s])
        whole = wholes[s]
        if whole is not None:
            ready = max(ready, max(t_dp[s], end if wait_all else -math.inf, *final[s]) + whole)
        elif not inline:
            for i in range(next_reduce[s], -1, -1):  # descending unit index, as reduce_step issues them
                done = final[s][i]
                for seconds in (dpu[i].step_rs, dpu[i].replica_ar):
                    if seconds:
                        t_dp[s] = max(t_dp[s], done, end if wait_all else -math.inf) + seconds
                        done = t_dp[s]
                ready = max(ready, done)
        out = max(out, ready)
    return out


def _family_bound(bounder: Bounder, name: str, cfg: Any, training) -> Bound:
    scenario = bounder.scenario
    topology = scenario.topology
    n = topology.num_devices
    plugin = plugin_of(name)
    plan: _family.FamilyPlan = plugin.plan(cfg, topology)
    schedule = plan.schedule
    deg = plan.dims
    dp = deg.data_parallel(n)
    m = training.global_batch_size // (training.micro_batch_size * dp)
    credit = n > 1  # one simulated rank stands for all n
    costs = bounder.costs(training.precision, credit)
    sd = costs.slowdown
    opt_rate = optimizer_bytes_per_param(training)
    unit_costs = bounder.units(training, deg, 1, credit)
    dense = sum(u.dense_params for u in unit_costs)
    expert = sum(u.expert_params for u in unit_costs)
    sizes = (plan.param_size, plan.grad_size, plan.optim_size)
    p, g, o = sizes
    expert_world = n // (deg.ep * deg.etp)
    expert_sizes = tuple(min(s, expert_world) for s in sizes)
    opt_dense = costs.work_s(Work(bytes_accessed=dense / o * opt_rate))
    opt_expert = costs.work_s(Work(bytes_accessed=expert / expert_sizes[2] * opt_rate)) if expert else 0.0
    optimizer = opt_dense + opt_expert
    # the dense optimizer (and what waits for it) may end before the step boundary, the experts'
    early = (1 + sd) * opt_expert
    impl = plan.schedule.implementation
    static = (_static_bytes(dense, sizes, training, impl)
              + _static_bytes(expert, expert_sizes, training, impl))  # type: ignore[arg-type]
    memory = static + sum(u.activation_bytes for u in unit_costs)
    # the (dp, cp) group of rank 0; ranks are placed tp, cp, dp (tp fastest)
    dp_group = range(0, n, deg.tp)
    num = len(unit_costs)
    dpu = bounder.dp_units(costs, unit_costs, 0, num, sizes, dp_group, training, schedule)
    impl = schedule.implementation
    copy = [costs.work_s(Work(bytes_accessed=2.0 * impl.copy_bytes_per_gathered_byte * u.dense_params
                                                  * training.param_element_bytes))
            if impl.copy_bytes_per_gathered_byte and p > 1 and u.dense_params else 0.0 for u in unit_costs]
    reshard = schedule.reshard_after_forward
    depth = schedule.effective_prefetch_depth
    slots = schedule.reduce_buffers

    # the chain: every micro-batch's forward and backward behind its gathers (prefetch depth),
    # gradient buffers and reduce-scatters, then the step-end reductions, the norm, the optimizer
    ready = [-early] * num
    t_dp = -early
    if o > p:
        for u in range(num):
            if dpu[u].step_ag:
                t_dp += dpu[u].step_ag
                ready[u] = t_dp
        if not schedule.overlap_param_gather:
            ready = [t_dp] * num
    t = 0.0
    t_ag = t_rs = -math.inf
    consumed: list[float] = []  # end of the compute that used each gather
    scatters: list[float] = []
    final = [0.0] * num
    first_start = None
    after = 0.0  # the last pass's straggler wait before the next kernel
    for mb in range(m):
        for phase, order in (("fwd", range(num)), ("bwd", range(num - 1, -1, -1))):
            for u in order:
                d = dpu[u]
                start = t + after
                gathered = p > 1 and unit_costs[u].dense_params > 0 and (phase == "fwd" or reshard)
                if gathered:
                    slot = len(consumed) - depth - 1
                    t_ag = max(t_ag, ready[u], consumed[slot] if slot >= 0 else -math.inf) + (
                        d.gather_fwd if phase == "fwd" else d.gather_bwd)
                    start = max(start, t_ag)
                elif p == 1 and mb == 0 and phase == "fwd":
                    start = max(start, ready[u])
                if phase == "bwd" and d.reduce and len(scatters) >= slots:
                    start = max(start, scatters[-slots])
                if first_start is None:
                    first_start = start
                copied = copy[u] if (phase == "fwd" or reshard) else 0.0
                t = start + copied + (unit_costs[u].forward_s if phase == "fwd" else unit_costs[u].backward_s)
                after = unit_costs[u].after_forward_s if phase == "fwd" else unit_costs[u].after_backward_s
                if gathered:
                    consumed.append(t)
                if phase == "bwd":
                    done = t
                    if d.reduce:
                        t_rs = max(t_rs, t) + d.reduce
                        scatters.append(t_rs)
                        done = t_rs
                    final[u] = done
    end_backward = t
    wait = end_backward if not schedule.effective_overlap_grad_reduce else -math.inf
    norm_ready = max([end_backward] + final)
    whole = _whole_buffer_s(costs, dense, sizes, dp_group, training, schedule)
    d0 = dpu[0]
    if whole is not None:
        t_dp = max(t_dp, norm_ready) + whole
        norm_ready = t_dp
        tail = d0.reduce + whole
    else:
        for u in range(num - 1, -1, -1):
            done = final[u]
            for seconds in (dpu[u].step_rs, dpu[u].replica_ar):
                if seconds:
                    t_dp = max(t_dp, done, wait) + seconds
                    done = t_dp
            norm_ready = max(norm_ready, done)
        tail = d0.reduce + d0.step_rs + d0.replica_ar
    # the norm's straggler, when no other rendezvous of the world resets its stretch
    world = deg.data_parallel(n) * deg.cp
    groups = [p, g, o, world // o, deg.tp, deg.cp, deg.ep] + ([expert_world] if expert else [])
    squares = 0.0
    if max(groups) < n:
        squares = m * sum(u.kernels_sq for u in unit_costs) + opt_dense ** 2 + opt_expert ** 2
    norm = _norm_s(costs, n, squares)
    chain = norm_ready + norm + optimizer

    # the talking: streams' serial sums and the links' bytes in the step (with experts, less
    # what may have run before the boundary)
    units_talk = m * sum(u.comm_s for u in unit_costs)
    demand = dict(bounder.sharded_demand(costs, [u.dense_params for u in unit_costs], m, sizes, dp_group,
                                         training, schedule))
    for uc in unit_costs:
        for level, b in uc.link_bytes:
            demand[level] = demand.get(level, 0.0) + m * b
    streams = {
        "ag": m * sum(d.gather_fwd + (d.gather_bwd if reshard else 0.0) for d in dpu),
        "rs": m * sum(d.reduce for d in dpu),
        "dp": sum(d.step_ag for d in dpu) + (whole if whole is not None else sum(d.step_rs + d.replica_ar for d in dpu)),
    }
    talking = max(costs.link_s(demand), _stream_sums(schedule, streams)) - early
    head = max(0.0, min(first_start if first_start is not None else 0.0,
                        (d0.step_ag if o > p else 0.0) + (d0.gather_fwd if p > 1 else 0.0)) - early)
    non_overlapping = units_talk + norm + head + tail
    kernels = m * sum(u.forward_s + u.backward_s for u in unit_costs) - units_talk + m * sum(copy) * (2 if reshard else 1) + optimizer
    slow = _slowed(kernels, talking, sd, non_overlapping)
    step = max(chain, slow)
    work = m * sum(u.forward_s + u.backward_s for u in unit_costs)
    return Bound(step, work + optimizer, units_talk, 0.0, memory, talking, slow > chain, head + tail + norm)


# ---------------------------------------------------------------------------- evaluation


def evaluate(scenario: Scenario, candidate: Candidate) -> dict[str, Any]:
    """Build and simulate one candidate (runs in a worker process or on a Dask worker).

    Returns ``{"report": contract}`` or ``{"rejected": reason}`` when its resident model states
    (from the built graph) exceed the device memory, ``{"error": message}`` for a graph error."""
    from hzpsim.run import _report, _resolve

    try:
        sc = variant(scenario, candidate)
        choice = sc.strategies[0]
        graph = plugin_of(choice.name).build(choice.config, sc.model, sc.training, sc.topology)
        capacity = sc.topology.device.memory_bytes
        states = max(sum(memory.values()) for memory in graph.static_memory.values())
        if states > capacity:
            return {"rejected": f"resident states {states / 2**30:.1f} GiB exceed {capacity / 2**30:.1f} GiB",
                    "memory_bytes": states}
        report = _report(sc, _resolve(sc, choice.name, choice.config), graph, None)
    except (ValueError, GraphError) as exc:
        return {"error": str(exc)}
    report["training_resolved"] = candidate.training()
    return {"report": report}


def _evaluate_task(task: tuple[Scenario, Candidate]) -> dict[str, Any]:
    return evaluate(*task)


class Runner:
    """Runs evaluations: in this process, in local worker processes, or on a Dask cluster."""

    def map(self, tasks: list[tuple[Scenario, Candidate]]) -> list[dict[str, Any]]:
        return [_evaluate_task(t) for t in tasks]

    def close(self) -> None:
        pass


class ProcessRunner(Runner):
    def __init__(self, workers: int) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))

    def map(self, tasks: list[tuple[Scenario, Candidate]]) -> list[dict[str, Any]]:
        return list(self.pool.map(_evaluate_task, tasks))

    def close(self) -> None:
        self.pool.shutdown()


class DaskRunner(Runner):
    """``address``: a scheduler address (``tcp://host:8786``) or a ``distributed`` Client /
    LocalCluster object."""

    def __init__(self, address: Any) -> None:
        try:
            from distributed import Client
        except ImportError:
            raise ScenarioError("--dask: needs the 'distributed' package (pip install 'hzpsim[dask]')") from None
        self.own = not hasattr(address, "submit")
        try:
            self.client = Client(address, timeout=5) if self.own else address
        except (OSError, TimeoutError, ValueError) as exc:
            raise ScenarioError(f"--dask {address}: cannot reach the scheduler ({exc})") from None

    def map(self, tasks: list[tuple[Scenario, Candidate]]) -> list[dict[str, Any]]:
        futures = self.client.map(_evaluate_task, tasks, pure=False)
        return list(self.client.gather(futures))

    def close(self) -> None:
        if self.own:
            self.client.close()


# ---------------------------------------------------------------------------- the search


@dataclass
class Row:
    """What became of one candidate."""

    candidate: Candidate
    status: str  # invalid | pruned_memory | pruned_bound | rejected | simulated | error | skipped
    reason: str = ""
    bound: Bound | None = None
    report: dict[str, Any] | None = None

    @property
    def feasible(self) -> bool:
        return self.report is not None and bool(self.report["fits_in_memory"])


@dataclass
class SearchResult:
    scenario: Scenario
    families: tuple[str, ...]
    rows: list[Row]
    top_n: int
    wall_s: float
    exact: bool  # False when --max-evals stopped the search before the bound did
    exhaustive: bool = False
    ranked: list[Row] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ranked = sorted((r for r in self.rows if r.feasible), key=_rank)

    @property
    def best(self) -> Row | None:
        return self.ranked[0] if self.ranked else None

    def best_of(self, family: str) -> Row | None:
        return next((r for r in self.ranked if r.candidate.name == family), None)

    def count(self, *statuses: str) -> int:
        return sum(r.status in statuses for r in self.rows)

    def why_infeasible(self, family: str) -> str:
        rows = [r for r in self.rows if r.candidate.name == family]
        if not rows:
            return "no candidates in the searched space"
        if all(r.status == "invalid" for r in rows):
            return f"every one of {len(rows)} candidates is invalid, e.g. {rows[0].reason}"
        memory = [(r.report["peak_memory_bytes"] if r.report else (r.bound.memory_bytes if r.bound else math.inf), r)
                  for r in rows if r.status in ("pruned_memory", "rejected", "simulated")]
        if memory and all(r.status in ("invalid", "pruned_memory", "rejected", "simulated") for r in rows):
            least, row = min(memory, key=lambda x: (x[0], x[1].candidate.key))
            capacity = self.scenario.topology.device.memory_bytes
            return (f"out of memory: the least hungry candidate ({row.candidate.label()}) needs at least "
                    f"{least / 2**30:.1f} GiB of {capacity / 2**30:.1f} GiB")
        skipped = sum(r.status == "skipped" for r in rows)
        return f"not found within --max-evals ({skipped} candidates not evaluated)"

    def to_json(self) -> dict[str, Any]:
        """``{best, best_per_family, infeasible, top, num_candidates, num_simulated, num_pruned,
        wall_s, ...}`` (docs/contract.md)."""
        best = self.best
        return {
            "best": best.report if best else None,
            "best_per_family": {f: (r.report if (r := self.best_of(f)) else None) for f in self.families},
            "infeasible": {f: self.why_infeasible(f) for f in self.families if self.best_of(f) is None},
            "top": [r.report for r in self.ranked[: self.top_n]],
            "num_candidates": len(self.rows),
            "num_simulated": self.count("simulated", "rejected", "error"),
            "num_pruned": self.count("pruned_memory", "pruned_bound"),
            "num_pruned_memory": self.count("pruned_memory"),
            "num_pruned_bound": self.count("pruned_bound"),
            "num_invalid": self.count("invalid"),
            "num_skipped": self.count("skipped"),
            "exact": self.exact,
            "wall_s": self.wall_s,
        }


def _rank(row: Row) -> tuple[float, str]:
    assert row.report is not None
    return (row.report["step_time_s"], row.candidate.key)


def search(scenario: Scenario, families: Sequence[str] | None = None, top: int = 10,
           max_evals: int | None = None, space: Space | None = None, runner: Runner | None = None,
           progress: bool = False, exhaustive: bool = False) -> SearchResult:
    """Branch and bound over the space (module docstring). ``exhaustive`` simulates every
    valid candidate (no pruning; for checking the search)."""
    start = time.perf_counter()
    families = tuple(families or FAMILIES)
    space = space or default_space(scenario)
    runner = runner or Runner()
    capacity = scenario.topology.device.memory_bytes
    rows: list[Row] = []
    alive: list[Row] = []
    bounder = Bounder(scenario)
    checked: dict[tuple, str | None] = {}  # plugins' checks do not look at the recompute mode
    candidates = enumerate_candidates(scenario, families, space)
    first = _progress(len(candidates), progress, "hzpsim search: bounding")
    for index, candidate in enumerate(candidates):
        if first is not None and index % 256 == 0:
            first.update(min(256, len(candidates) - index))
        layout_key = (candidate.name, candidate.fields, candidate.micro_batch_size)
        if layout_key not in checked:
            checked[layout_key] = check(scenario, candidate)
        reason = checked[layout_key]
        if reason is not None:
            rows.append(Row(candidate, "invalid", reason))
            continue
        b = bounder(candidate)
        row = Row(candidate, "alive", bound=b)
        rows.append(row)
        if b.memory_bytes > capacity and not exhaustive:
            row.status = "pruned_memory"
            row.reason = f"needs at least {b.memory_bytes / 2**30:.1f} GiB of {capacity / 2**30:.1f} GiB"
            continue
        alive.append(row)
    alive.sort(key=lambda r: (r.bound.step_time_s, r.candidate.key))  # type: ignore[union-attr]
    if first is not None:
        first.close()

    feasible_steps: list[float] = []  # sorted
    family_best: dict[str, float] = {}
    evals = 0
    exact = True
    bar = _progress(len(alive), progress, "hzpsim search: simulating")
    i = 0
    try:
        while i < len(alive):
            batch: list[Row] = []
            while i < len(alive) and len(batch) < BATCH:
                row = alive[i]
                i += 1
                lb = row.bound.step_time_s  # type: ignore[union-attr]
                threshold = max(feasible_steps[top - 1] if len(feasible_steps) >= top else math.inf,
                                family_best.get(row.candidate.name, math.inf))
                if not exhaustive and lb <= threshold and row.candidate.name == "nd":
                    row.bound = bounder(row.candidate, refine=True)  # worth it for the few about to run
                    lb = row.bound.step_time_s
                if exhaustive or lb <= threshold:
                    if max_evals is not None and evals >= max_evals:
                        row.status, row.reason = "skipped", "not evaluated (--max-evals)"
                        exact = False
                        continue
                    batch.append(row)
                    evals += 1
                else:
                    row.status = "pruned_bound"
                    row.reason = f"cannot beat {threshold:.3f} s: at least {lb:.3f} s" + _bound_parts(row.bound)
                if bar is not None:
                    bar.update(1)
            if not batch:
                continue
            for row, result in zip(batch, runner.map([(scenario, r.candidate) for r in batch])):
                if "report" in result:
                    row.status, row.report = "simulated", result["report"]
                    assert row.report is not None
                    if row.report["fits_in_memory"]:
                        step = row.report["step_time_s"]
                        feasible_steps.append(step)
                        feasible_steps.sort()
                        family_best[row.candidate.name] = min(family_best.get(row.candidate.name, math.inf), step)
                    else:
                        row.reason = (f"out of memory: peak {row.report['peak_memory_bytes'] / 2**30:.1f} GiB of "
                                      f"{capacity / 2**30:.1f} GiB")
                elif "rejected" in result:
                    row.status, row.reason = "rejected", "out of memory: " + result["rejected"]
                else:
                    row.status, row.reason = "error", result["error"]
    finally:
        if bar is not None:
            bar.close()
    return SearchResult(scenario, families, rows, top, time.perf_counter() - start, exact, exhaustive)


def _bound_parts(b: Bound | None) -> str:
    if b is None:
        return ""
    parts = [f"compute {b.compute_s - b.comm_s:.2f} s"]
    if b.comm_s:
        parts.append(f"exposed TP/EP {b.comm_s:.2f} s")
    if b.bubble_s:
        parts.append(f"bubble {b.bubble_s:.2f} s")
    if b.link_s:
        parts.append(f"link traffic {b.link_s:.2f} s")
    return " (" + ", ".join(parts) + f"; limited by {b.limited_by})"


def _progress(total: int, enabled: bool, desc: str):
    if not enabled or total == 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="cand", file=sys.stderr, leave=False)


def make_runner(dask: Any = None, workers: int | None = None) -> Runner:
    """Dask when ``dask`` is given, else ``workers`` local processes (None: one per core, at
    most 8; 1: this process)."""
    if dask is not None:
        return DaskRunner(dask)
    workers = workers if workers is not None else min(os.cpu_count() or 1, 8)
    return ProcessRunner(workers) if workers > 1 else Runner()


# ---------------------------------------------------------------------------- text output


def loss_reason(row: Row, best: Row) -> str:
    """Why a simulated candidate is slower than the best: the part of its step that grew most."""
    assert row.report is not None and best.report is not None
    mine, theirs = row.report["time_breakdown_s"], best.report["time_breakdown_s"]

    def group(breakdown: dict[str, float]) -> dict[str, float]:
        out = {"compute": 0.0, "bubble": 0.0, "exposed communication": 0.0}
        for key, seconds in breakdown.items():
            out["compute" if key.startswith("compute.") else "bubble" if key == "idle" else "exposed communication"] += seconds
        return out

    a, b = group(mine), group(theirs)
    worst = max(a, key=lambda k: (a[k] - b[k], k))
    delta = a[worst] - b[worst]
    if delta <= 0:
        return "-"
    return f"+{_seconds(delta)} s {worst}"


def _seconds(x: float) -> str:
    """3 decimals for human-scale steps, 3 significant digits for tiny test models."""
    return f"{x:.3f}" if abs(x) >= 0.1 else f"{x:.3g}"


def format_search(result: SearchResult, source: str | None = None) -> str:
    """The ``hzpsim search`` text: counts, best per family, top N with why they lost."""
    sc = result.scenario
    data = result.to_json()
    rate = len(result.rows) / result.wall_s if result.wall_s > 0 else math.inf
    lines = [format_summary(sc), ""]
    lines.append(
        f"searched {data['num_candidates']:,} candidates in {result.wall_s:.1f} s ({rate:,.0f}/s): "
        f"{data['num_invalid']:,} invalid, {data['num_pruned_memory']:,} pruned by the memory bound, "
        f"{data['num_pruned_bound']:,} by the step-time bound, {data['num_simulated']:,} simulated"
        + ("" if result.exact else f", {data['num_skipped']:,} not evaluated (--max-evals: answer not exact)")
    )
    best = result.best
    lines += ["", "best of each family:"]
    header = f"  {'family':<14} {'layout':<46} {'step s':>8} {'tokens/s':>11} {'MFU':>6} {'peak GiB':>9}  vs best"
    lines += [header, "  " + "-" * (len(header) - 2)]
    for family in result.families:
        row = result.best_of(family)
        if row is None:
            lines.append(f"  {family:<14} infeasible: {result.why_infeasible(family)}")
            continue
        lines.append(_row_line(family, row, best))
    lines += ["", f"top {min(result.top_n, len(result.ranked))} overall:", header.replace("family        ", "rank          "),
              "  " + "-" * (len(header) - 2)]
    for i, row in enumerate(result.ranked[: result.top_n], 1):
        lines.append(_row_line(str(i), row, best))
    losers = [r for r in result.rows if r.status in ("pruned_memory", "pruned_bound", "rejected", "simulated")
              and not r.feasible]
    if losers:
        lines += ["", "the others lost because:"]
        counts: dict[str, int] = {}
        for r in result.rows:
            if r.status in ("pruned_memory", "rejected") or (r.status == "simulated" and not r.feasible):
                counts["out of memory"] = counts.get("out of memory", 0) + 1
            elif r.status == "pruned_bound":
                b = r.bound
                assert b is not None
                key = b.limited_by
                counts[f"slower by bound: {key}"] = counts.get(f"slower by bound: {key}", 0) + 1
            elif r.status == "simulated" and r is not best:
                counts["simulated, slower"] = counts.get("simulated, slower", 0) + 1
            elif r.status == "invalid":
                counts["invalid layout"] = counts.get("invalid layout", 0) + 1
        for key, count in sorted(counts.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {count:>7,}  {key}")
    if best is not None:
        where = f" {source}" if source else ""
        lines += ["", "run the best: hzpsim run" + where + " " + " ".join(f"--set {o}" for o in best.candidate.overrides())]
    return "\n".join(lines)


def _row_line(tag: str, row: Row, best: Row | None) -> str:
    r = row.report
    assert r is not None
    layout = f"{strategies.label(r['strategy_resolved'])} mb{row.candidate.micro_batch_size} {row.candidate.activation_recompute}"
    why = "best" if row is best else (loss_reason(row, best) if best else "")
    return (f"  {tag:<14} {layout:<46} {_seconds(r['step_time_s']):>8} {r['tokens_per_s']:>11,.0f} {r['mfu']:>6.1%} "
            f"{r['peak_memory_bytes'] / 2**30:>9.1f}  {why}")


def parse_families(values: Iterable[str] | None) -> tuple[str, ...]:
    """``--family`` values (repeatable, comma-separated) -> strategy names; ScenarioError otherwise."""
    if not values:
        return FAMILIES
    out: list[str] = []
    known = strategies.available()
    for value in values:
        for name in (v.strip() for v in value.split(",")):
            if name not in known:
                raise ScenarioError(f"--family {name!r}: unknown strategy (known: {', '.join(known)})")
            if name not in out:
                out.append(name)
    return tuple(out)


Progress = Callable[[int], None]
