"""What one executor run is: model, batch, strategy layout and measurement settings (no torch).

:func:`run_specs` turns a loaded scenario (the same YAML ``hzpsim run`` reads) into one
:class:`RunSpec` per entry of its ``strategies:`` list, for ``world_size`` processes. A run
spec names its strategy as the simulator does (``zero`` with ``Layout.stage`` 3 or 2, ``hsdp``,
``nd``, ``asynchzp``), or ``reference`` (one process, the baseline). Try it::

    python -c "from hzpsim.executor.spec import demo; print(demo())"
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hzpsim.config import ScenarioError
from hzpsim.model import Model

SIMULATOR_STRATEGIES = ("zero", "hsdp", "nd", "asynchzp")
"""The simulator's strategies (``hzpsim.strategies`` plugin names) the executor runs."""
EXECUTOR_STRATEGIES = ("reference", *SIMULATOR_STRATEGIES)
"""What ``RunSpec.strategy`` may be: the simulator's names plus the single-process ``reference``."""

IMPLEMENTATIONS = {"zero": "fsdp2", "hsdp": "fsdp2", "nd": "dtensor", "asynchzp": "reference"}
"""The simulator's implementation profile (``strategies/_implementations.py``) of what the
executor runs for each strategy: FSDP2 for ZeRO-3/ZeRO-2/HSDP, DTensor TP+SP with
torch.distributed.pipelining for ND, our own AsyncHZP."""

TRAINER_KINDS = {"reference": "reference", "zero": "fsdp", "hsdp": "fsdp-replicated", "nd": "nd",
                 "asynchzp": "asynchzp"}
"""Which trainer (``executor/trainers.py`` ``TRAINERS``, by kind) runs each strategy: a new
strategy that an existing trainer runs registers here and in :func:`_layout_of` only."""

VALIDATION_STRATEGIES: tuple[dict[str, Any], ...] = (
    {"name": "zero", "stage": 3},
    {"name": "hsdp", "shard_group_size": 2},
    {"name": "nd", "tp": 2, "pp": 2, "sequence_parallel": True},
    {"name": "nd", "tp": 2, "dp": 2, "sequence_parallel": True},
    {"name": "asynchzp", "param_group_size": 2, "grad_group_size": 2, "optim_group_size": 4},
)
"""The scenario entries ``hzpsim validate executor`` runs by default, for world size 4
(:func:`fit_world` shrinks them for smaller worlds; ``examples/executor-world4.yaml``)."""

MEMORY_ENTRIES: dict[str, dict[str, Any]] = {
    "zero": {"name": "zero", "stage": 3},
    "hsdp": {"name": "hsdp", "shard_group_size": 4},
    "nd": {"name": "nd", "tp": 2, "pp": 2, "sequence_parallel": True},
    "asynchzp": {"name": "asynchzp", "param_group_size": 2, "grad_group_size": 2, "optim_group_size": 4},
}
"""The scenario entries ``hzpsim validate memory`` compares, for 8 ranks: the layouts of
``executor.memtrack.MEMORY_STRATEGIES``."""


@dataclass(frozen=True)
class Layout:
    """Strategy layout as the executor runs it (sizes in ranks)."""

    stage: int = 3  # zero: 3 = parameters resharded after the forward (gathered again), 2 = kept
    shard_group_size: int = 0  # hsdp: ranks of one shard group (0 = world)
    tp: int = 1  # nd: tensor-parallel size (DTensor, sequence parallel)
    pp: int = 1  # nd: pipeline stages (torch.distributed.pipelining)
    vpp: int = 1  # nd: model chunks per pipeline rank (interleaved 1F1B when > 1)
    param_group_size: int = 0  # asynchzp: 0 = world
    grad_group_size: int = 0  # asynchzp: 0 = param_group_size
    optim_group_size: int = 0  # asynchzp: 0 = world
    asynchronous: bool = True  # asynchzp: one background thread per stream (ag, rs, dp) vs one
    prefetch_depth: int = 1  # asynchzp: all-gathers issued ahead of use (ring of D + 1 buffers)
    reduce_buffers: int = 2  # asynchzp: gradient buffers awaiting their reduce-scatter


@dataclass(frozen=True)
class RunSpec:
    """One executor run: every rank builds the same model and data from this."""

    model: Model
    strategy: str  # one of EXECUTOR_STRATEGIES
    world_size: int
    global_batch_size: int  # sequences per optimizer step
    micro_batch_size: int  # sequences per micro-batch per data-parallel replica
    num_steps: int = 6  # optimizer steps run (losses of all are compared)
    warmup_steps: int = 2  # steps excluded from the step-time median
    seed: int = 1234
    device: str = "cpu"  # cpu (gloo) | cuda (nccl)
    layout: Layout = field(default_factory=Layout)
    lr: float = 1e-3  # Adam learning rate
    max_grad_norm: float = 1.0  # global gradient-norm clipping (one fp32 all-reduce per step)
    comm_delay_s: float = 0.0  # artificial host delay added to every collective call (seconds)
    threads_per_rank: int = 1  # torch intra-op threads per process
    measure_memory: bool = True  # run one extra step under the memory profiler (CPU) at the end
    measure_sharing: bool = False  # time the calibration's sharing probe right before and after the steps
    label: str = ""  # the scenario's strategy, for reports

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas (ranks that split the batch)."""
        return self.world_size // (self.layout.tp * self.layout.pp)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per replica per step."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def validate(self) -> None:
        """Raise ScenarioError for a run the executor cannot do."""
        m, lay, n = self.model, self.layout, self.world_size
        if self.strategy not in EXECUTOR_STRATEGIES:
            raise ScenarioError(f"strategy: executor has no {self.strategy!r} (known: {', '.join(EXECUTOR_STRATEGIES)})")
        if n < 1:
            raise ScenarioError("--world: must be >= 1")
        if self.device not in ("cpu", "cuda"):
            raise ScenarioError(f"--device: {self.device!r} is not cpu or cuda")
        if m.mla is not None or m.tied_embeddings:
            raise ScenarioError("model: the executor builds no MLA and no tied embeddings")
        if m.qkv_bias or m.qk_norm or (m.moe is not None and m.moe.shared_expert_gate):
            raise ScenarioError("model: the executor builds no qkv_bias, qk_norm or moe.shared_expert_gate")
        if m.position_embedding == "alibi":
            raise ScenarioError("model.position_embedding: the executor builds rope, learned or none")
        if m.windowed:
            raise ScenarioError("model.sliding_window: the executor builds full causal attention only")
        if self.strategy == "reference" and n != 1:
            raise ScenarioError("reference: runs on one process")
        if n % (lay.tp * lay.pp):
            raise ScenarioError(f"tp x pp = {lay.tp} x {lay.pp} does not divide the world size {n}")
        if self.global_batch_size % (self.micro_batch_size * self.dp_size):
            raise ScenarioError(
                f"training.global_batch_size: {self.global_batch_size} is not divisible by micro_batch_size x "
                f"data-parallel size = {self.micro_batch_size} x {self.dp_size}")
        if self.num_steps <= self.warmup_steps:
            raise ScenarioError(f"num_steps: {self.num_steps} must exceed warmup_steps {self.warmup_steps}")
        if self.strategy == "nd":
            if m.num_heads % lay.tp or m.kv_heads % lay.tp:
                raise ScenarioError(f"strategy.tp: {lay.tp} does not divide the heads")
            if m.seq_len % lay.tp:
                raise ScenarioError(f"strategy.tp: {lay.tp} does not divide seq_len (sequence parallel)")
            if m.moe is not None and lay.tp > 1:
                raise ScenarioError("strategy.tp: the executor's ND runs dense models only")
            if lay.pp > 1 and m.num_layers % (lay.pp * lay.vpp):
                raise ScenarioError(f"strategy.pp: pp x vpp = {lay.pp * lay.vpp} does not divide num_layers")
            if lay.pp > 1 and self.num_micro_batches < lay.pp:
                raise ScenarioError("strategy.pp: needs at least pp micro-batches per step")
            if lay.vpp > 1 and self.num_micro_batches % lay.pp:
                raise ScenarioError("strategy.vpp: micro-batches per step must be a multiple of pp")
        if self.strategy == "zero" and lay.stage not in (2, 3):
            raise ScenarioError(f"strategy.stage: the executor runs ZeRO stage 2 or 3 (FSDP2), not {lay.stage}")
        if self.strategy == "hsdp":
            g = lay.shard_group_size or n
            if n % g:
                raise ScenarioError(f"strategy.shard_group_size: {g} does not divide the world size {n}")
        if self.strategy == "asynchzp":
            p, g, o = self.group_sizes()
            for a, b, name in ((p, g, "param_group_size"), (g, o, "grad_group_size"), (o, n, "optim_group_size")):
                if b % a:
                    raise ScenarioError(f"strategy.{name}: {a} does not divide {b} (groups must nest)")
            if not 0 <= lay.prefetch_depth <= 4 or lay.reduce_buffers < 1:
                raise ScenarioError("strategy.prefetch_depth: 0..4 and reduce_buffers >= 1")

    def group_sizes(self) -> tuple[int, int, int]:
        """AsyncHZP (param, grad, optim) group sizes with defaults filled in."""
        lay, n = self.layout, self.world_size
        p = lay.param_group_size or n
        g = lay.grad_group_size or p
        o = lay.optim_group_size or n
        return p, g, o

    def to_mapping(self) -> dict[str, Any]:
        """Plain data (for pickling into worker processes and for reports)."""
        data = dataclasses.asdict(self)
        return data


def from_mapping(data: dict[str, Any]) -> RunSpec:
    """Inverse of :meth:`RunSpec.to_mapping`."""
    from hzpsim.config import from_mapping as typed

    data = dict(data)
    model = typed(Model, data.pop("model"), "model")
    layout = Layout(**data.pop("layout"))
    return RunSpec(model=model, layout=layout, **data)


def _layout_of(name: str, config: Any) -> tuple[str, Layout]:
    """The executor strategy and layout for one hzpsim strategy config."""
    def get(key: str, default: Any = None) -> Any:
        return getattr(config, key, default)

    if name == "zero":
        stage = get("stage", 3)
        if stage not in (2, 3):
            raise ScenarioError(f"strategy.stage: the executor runs ZeRO stage 2 or 3 (FSDP2), not {stage}")
        return "zero", Layout(stage=stage)
    if name == "hsdp":
        return "hsdp", Layout(shard_group_size=get("shard_group_size") or 0)
    if name == "nd":
        if get("cp", 1) != 1 or get("ep", 1) != 1 or get("etp") not in (None, 1, get("tp", 1)):
            raise ScenarioError("strategy: the executor's ND runs tp, pp, vpp and dp only (no cp/ep)")
        if get("sharding_stage", 0) != 0:  # zero_stage, or the implementation's default when unset
            raise ScenarioError("strategy.zero_stage: the executor's ND runs plain data parallelism (0)")
        if get("tp", 1) > 1 and not get("sequence_parallel", False):
            raise ScenarioError("strategy.sequence_parallel: the executor's TP always uses sequence parallelism")
        return "nd", Layout(tp=get("tp", 1), pp=get("pp", 1), vpp=get("vpp", 1))
    if name == "asynchzp":
        if get("adaptive", False):
            raise ScenarioError("strategy.adaptive: give the asynchzp group sizes explicitly for the executor")
        if get("tp", 1) != 1 or get("cp", 1) != 1 or get("ep", 1) != 1:
            raise ScenarioError("strategy: the executor's asynchzp runs without tp/cp/ep")
        return "asynchzp", Layout(
            param_group_size=get("param_group_size") or 0, grad_group_size=get("grad_group_size") or 0,
            optim_group_size=get("optim_group_size") or 0, asynchronous=get("async_", True),
            prefetch_depth=get("prefetch_depth", 1), reduce_buffers=get("reduce_buffers", 2))
    raise ScenarioError(f"strategy.name: the executor does not run {name!r} ({', '.join(SIMULATOR_STRATEGIES)})")


def fit_world(entry: dict[str, Any], world: int) -> dict[str, Any]:
    """A scenario strategy entry (``{"name": ..., field: value}``) with the group sizes that do
    not divide ``world`` shrunk (e.g. the world-4 :data:`VALIDATION_STRATEGIES` at --world 2)."""
    name = entry.get("name")
    if name == "hsdp" and entry.get("shard_group_size") and world % entry["shard_group_size"]:
        entry["shard_group_size"] = world
    if name == "hsdp" and entry.get("shard_group_size", 0) > world:
        entry["shard_group_size"] = world
    if name == "nd":
        tp, pp = entry.get("tp", 1), entry.get("pp", 1)
        while tp * pp > world or world % (tp * pp):
            if pp > 1:
                pp //= 2
            else:
                tp //= 2
        entry.update(tp=max(tp, 1), pp=max(pp, 1))
        if entry.get("dp") is not None:
            entry["dp"] = world // (entry["tp"] * entry["pp"])
        if entry["tp"] == 1:
            entry["sequence_parallel"] = False
    if name == "asynchzp":
        for key in ("param_group_size", "grad_group_size", "optim_group_size"):
            if entry.get(key) and (entry[key] > world or world % entry[key]):
                entry[key] = world
    return entry


def run_specs(scenario: Any, world_size: int, **overrides: Any) -> list[RunSpec]:
    """One RunSpec per strategy of a loaded :class:`hzpsim.scenario.Scenario`.

    The scenario must train in fp32 with fp32 gradients (exact comparison with the reference)
    and without recompute; ``overrides`` set RunSpec fields (num_steps, device, comm_delay_s ...).
    """
    training = scenario.training
    if training.precision != "fp32" or training.grad_dtype != "fp32":
        raise ScenarioError("training.precision: the executor runs fp32 with fp32 gradients (set precision: fp32)")
    if training.activation_recompute != "none":
        raise ScenarioError("training.activation_recompute: the executor runs without recompute (none)")
    if training.varying_lengths is not None:
        raise ScenarioError("training.sequence_lengths: the executor runs whole rows (fixed); it has no "
                            "per-document attention masks")
    if scenario.model.dropout:
        raise ScenarioError("model.dropout: the executor trains without dropout (set model.dropout: false)")
    specs = []
    for choice in scenario.strategies:
        strategy, layout = _layout_of(choice.name, choice.config)
        spec = RunSpec(model=scenario.model, strategy=strategy, world_size=world_size,
                       global_batch_size=training.global_batch_size, micro_batch_size=training.micro_batch_size,
                       layout=layout, label=_label(choice), **overrides)
        spec.validate()
        specs.append(spec)
    return specs


def _label(choice: Any) -> str:
    """``name(field=value,...)`` with the fields that differ from the strategy's defaults."""
    defaults = type(choice.config)()
    fields = {f.metadata.get("key", f.name): getattr(choice.config, f.name) for f in dataclasses.fields(choice.config)
              if getattr(choice.config, f.name) != getattr(defaults, f.name) or f.name == "stage"}
    return choice.name + "(" + ",".join(f"{k}={v}" for k, v in sorted(fields.items())) + ")"


def demo() -> RunSpec:
    """A two-layer model under ZeRO-3 on two processes."""
    model = Model(2, 64, 4, 128, 256, 32, name="demo", dropout=False)
    return RunSpec(model, "zero", 2, global_batch_size=4, micro_batch_size=1)
