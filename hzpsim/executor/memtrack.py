"""Peak memory of one training step of rank 0, measured in THIS process with PyTorch's own
memory tracker (the measured side of ``hzpsim validate memory``).

:func:`measure` builds the spec's trainer for rank 0 of ``spec.world_size`` ranks on a FAKE
process group (``torch.testing._internal.distributed.fake_pg``: one process, every collective
a no-op that leaves its output buffer as allocated), runs one warm-up step (step 0: Adam
creates its moments, FSDP2 its lazy state, the RoPE table cache fills), then step 1 under
``torch.distributed._tools.mem_tracker.MemTracker`` (``fsdp2_mem_tracker.FSDPMemTracker`` for
FSDP2), and returns the tracker's peak and its breakdown. Three methods:

- ``"fake"``: everything under ``torch._subclasses.fake_tensor.FakeTensorMode``: tensors have
  shapes, dtypes and storages of the right size but no data, so a Llama-3-8B-shaped model is
  measured at full size in seconds and megabytes (:func:`llama3_8b`).
- ``"cpu"``: real CPU tensors, real compute, the same fake process group and tracker.
- ``"cuda"``: real tensors on the current CUDA device, the same fake process group and tracker;
  the caching allocator's own peaks of the measured step are returned beside the tracker's
  (``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` after
  ``reset_peak_memory_stats``): allocated is what the tracker counts plus what it cannot see
  (cuBLAS workspaces, kernels' own scratch), reserved adds the allocator's cached, fragmented
  segments (``CUDACachingAllocator.cpp``: blocks are rounded to 512 bytes, small requests
  share 2 MiB segments, large ones 20 MiB or their rounded size).

:func:`crosscheck` runs both on one spec and returns their relative difference (the tests
require < 1 % at a small shape for every strategy). Try it::

    python -c "from hzpsim.executor.memtrack import demo; demo()"

What the tracker counts (``mem_tracker.py``, ``MemTracker.__torch_dispatch__``): every tensor
storage an ATen op returns on the tracking thread, by ``UntypedStorage`` identity, live until
the storage is freed (a weakref finalizer, ``_WeakRefInfo.create_winfo``), its size updated
when ``UntypedStorage.resize_`` runs (``MemTracker._track_resize``: FSDP2 frees and
re-allocates its unsharded parameters with ``resize_``, ``_fsdp_param.py``
``FSDPParam.free_unsharded_param`` / ``alloc_storage``); bytes are ``numel x element_size``
(CUDA's 512-byte rounding only for CUDA tensors: ``_WeakRefInfo._calculate_mem_consumed``).
The category of a storage is set when it is first seen: module parameters and buffers at the
module's pre-forward (``_track_module_params_and_buffers``), gradients by hooks, every
allocation inside ``Optimizer.step`` as optimizer state (``_register_global_optimizer_hook``:
Adam's temporaries too), other allocations in a backward as temporaries, in a forward as
activations. ``FSDPMemTracker`` adds FSDP2's own categories: sharded / unsharded parameters
and gradients, the all-gather output (``c10d._allgather_base_`` issued in pre-forward /
pre-backward) and the reduce-scatter input (``c10d._reduce_scatter_base_`` in post-backward);
FSDP2 allocates both in ``_fsdp_collectives.py`` (``foreach_all_gather``:
``all_gather_output = torch.empty(...)``; ``foreach_reduce``: ``reduce_scatter_input =
torch.empty(...)`` and the ``reduce_output`` sharded gradient). State created before the
tracker starts (parameters of modules never called, our AsyncHZP's flat shards and buffer ring)
is registered with ``MemTracker._update_and_maybe_create_winfos`` in the category it belongs
to.

Caveats (each also returned in ``notes``):

- The trackers are ``TorchDispatchMode``s, which are thread-local: they see the calling thread
  only. AsyncHZP runs its communication pool inline (``AsyncHZPTrainer(..., inline=True)``),
  so its gathers, reduce-scatters and step-end work allocate on the measured thread, in
  program order: a lower bound on what the background threads hold at once (their temporaries
  can overlap the training thread's in a real run).
- Fake process group: a collective allocates nothing itself (``FakeProcessGroup``'s ops return
  a finished work and leave the output as the caller allocated it), like gloo and NCCL, whose
  outputs are preallocated by the caller (``dist.all_gather_into_tensor`` etc.). gloo's and
  NCCL's internal staging buffers (gloo's reduce-scatter runs an all-reduce of the whole
  input) are outside PyTorch's allocator and uncounted here, as in
  ``torch.cuda.max_memory_allocated``. Functional collectives (DTensor) allocate their outputs
  in ``_c10d_functional`` ops, which the tracker sees; ``wait_tensor`` under fake tensors is
  made to return its input by the tracker itself (``MemTracker.__torch_dispatch__``).
- ND with pipelining: see :func:`_nd_notes`.
- The executor trains fp32 (parameters, gradients, compute) without recompute or dropout;
  real 8B training would run bf16 compute with fp32 master weights.
"""

from __future__ import annotations

import contextlib
import gc
import time
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from hzpsim.executor import model as tmodel
from hzpsim.executor.spec import MEMORY_ENTRIES, Layout, RunSpec, _layout_of
from hzpsim.model import Model

METHODS = ("fake", "cpu", "cuda")
MEASURED_STEP = 1
"""The measured step: step 0 is the warm-up (Adam's moments exist only after a first step)."""

CATEGORIES = ("params", "grads", "optimizer", "activations", "temp", "comm_buffers", "other")
_CATEGORY_OF = {
    "Parameter": "params", "Sharded Param": "params", "Unsharded Param": "params", "Buffer": "params",
    "Gradient": "grads", "Sharded Grad": "grads", "Unsharded Grad": "grads",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations", "Inputs": "activations",
    "Temp": "temp",
    "All Gather": "comm_buffers", "Reduce Scatter": "comm_buffers",
    "Other": "other",
}


def llama3_8b(seq_len: int = 2048) -> Model:
    """Llama-3-8B's shape: 32 layers, hidden 4096, 32 heads, 8 KV heads, SwiGLU 14336, vocab
    128256, RMSNorm, RoPE, untied embeddings, no biases (fp32 in the executor)."""
    return Model(num_layers=32, hidden_size=4096, num_heads=32, ffn_hidden_size=14336, vocab_size=128256,
                 seq_len=seq_len, name="llama3-8b", num_kv_heads=8, norm="rmsnorm", mlp="swiglu",
                 position_embedding="rope", dropout=False, linear_bias=False)


def small(seq_len: int = 256, layers: int = 4, hidden: int = 256, vocab: int = 8192) -> Model:
    """A reduced Llama-style shape (GQA 8 heads / 2 KV heads) that runs with real tensors here."""
    return Model(num_layers=layers, hidden_size=hidden, num_heads=8, ffn_hidden_size=hidden * 7 // 2,
                 vocab_size=vocab, seq_len=seq_len, name="llama-small", num_kv_heads=2, norm="rmsnorm",
                 mlp="swiglu", position_embedding="rope", dropout=False, linear_bias=False)


MEMORY_STRATEGIES: dict[str, tuple[str, Layout]] = {
    name: _layout_of(entry["name"], SimpleNamespace(**entry)) for name, entry in MEMORY_ENTRIES.items()}
"""The strategies ``validate memory`` measures by default, for 8 ranks: ``spec.MEMORY_ENTRIES``
as the executor runs them."""


def spec_for(name: str, model: Model, world_size: int = 8, micro_batches: int = 4,
             micro_batch_size: int = 1) -> RunSpec:
    """A run spec of one of :data:`MEMORY_STRATEGIES` with ``micro_batches`` micro-batches per
    data-parallel replica and step."""
    strategy, layout = MEMORY_STRATEGIES[name]
    probe = RunSpec(model, strategy, world_size, global_batch_size=1, micro_batch_size=micro_batch_size,
                    layout=layout, num_steps=2, warmup_steps=0, measure_memory=False, label=name)
    gbs = micro_batches * micro_batch_size * probe.dp_size
    spec = RunSpec(model, strategy, world_size, global_batch_size=gbs, micro_batch_size=micro_batch_size,
                   layout=layout, num_steps=2, warmup_steps=0, measure_memory=False, label=name)
    spec.validate()
    return spec


# ---------------------------------------------------------------------------- environment


def _fake_process_group(world: int) -> None:
    """A fake process group of ``world`` ranks, this process rank 0 (replacing an earlier fake
    one of another size; a real one is an error)."""
    from torch.testing._internal.distributed.fake_pg import (
        FakeStore,  # registers the "fake" backend
    )

    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError("memtrack: a real process group is initialised in this process")
        if dist.get_world_size() == world:
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


@contextlib.contextmanager
def _meshes_outside_fake_mode():
    """``init_device_mesh`` runs ``tolist()`` on its rank tensor (``DeviceMesh.__init__``),
    which a fake tensor cannot answer: build meshes with fake mode suspended (a mesh holds
    only rank numbers)."""
    import torch.distributed.device_mesh as device_mesh
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    original = device_mesh.init_device_mesh

    def init_device_mesh(*args: Any, **kwargs: Any):
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    device_mesh.init_device_mesh = init_device_mesh
    try:
        yield
    finally:
        device_mesh.init_device_mesh = original


def _skip_pipeline_vote(schedule: Any) -> None:
    """The schedule's first step votes over P2P whether every stage's shapes are static
    (``schedules.py``, ``_PipelineSchedule._warmup_p2p``: a send/recv chain through all stages,
    then ``result.item()``); on a fake process group the next stage never answers. Every stage
    of this rank was given its shapes (``NDTrainer(static_pipeline_shapes=True)``), and the
    other ranks would have been too: set the vote's outcome, ``InferenceMode.STATIC``.
    Older PyTorch (2.11, seen on a lent GPU machine) has neither the vote nor ``InferenceMode``:
    its stages take the shapes they were given, and nothing needs skipping."""
    try:
        from torch.distributed.pipelining._utils import InferenceMode
    except ImportError:
        return

    def warmup_p2p(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = warmup_p2p


def _make_trainer(spec: RunSpec, device: torch.device):
    if spec.strategy == "asynchzp":
        from hzpsim.executor.asynchzp import AsyncHZPTrainer

        return AsyncHZPTrainer(spec, device, inline=True)
    if spec.strategy == "nd" and spec.layout.pp > 1:
        from hzpsim.executor.nd import NDTrainer

        trainer = NDTrainer(spec, device, static_pipeline_shapes=True)
        _skip_pipeline_vote(trainer.schedule)
        return trainer
    from hzpsim.executor.trainers import make_trainer

    return make_trainer(spec, device)


# ---------------------------------------------------------------------------- tracking


def _micro_batch_mem_tracker():
    """``MemTracker`` that allows a root module to run its forward several times per step
    (micro-batches: AsyncHZP calls each unit as a root, ND without pipelining its stage):
    ``MemTracker._pre_fw_hook`` raises for a root called again (it assumes a new iteration);
    this does what it does for a submodule called again (case 3 there)."""
    from copy import deepcopy

    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _ModState

    class MicroBatchMemTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs) -> None:  # type: ignore[no-untyped-def]
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                stats = self.memory_tracking[module]
                stats.input_mem = self._track_inputs_or_outputs(inputs)
                snap = self.get_tracker_snapshot()
                stats.local_peak = {dev: values[_TOTAL_KEY] for dev, values in snap.items()}
                stats.snapshots.setdefault(_ModState.PEAK_FW, []).append(snap)
                stats.snapshots.setdefault(_ModState.PRE_FW, []).append(deepcopy(snap))
                return
            super()._pre_fw_hook(module, inputs)

    return MicroBatchMemTracker()


def _tracker(spec: RunSpec, trainer: Any):
    from torch.distributed._tools.mem_tracker import _MemRefType

    if spec.strategy in ("zero", "hsdp"):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker(trainer.net, trainer.opt)
    tracker = _micro_batch_mem_tracker()
    if spec.strategy == "nd":
        for unit in trainer.units:  # every parameter, also of units this step may not call first
            tracker._track_module_params_and_buffers(unit, install_grad_hooks=True)
        tracker.track_external(trainer.opt)
    elif spec.strategy == "asynchzp":
        for unit in trainer.units:
            tracker._update_and_maybe_create_winfos(unit.working, _MemRefType.PARAM)
            tracker._update_and_maybe_create_winfos(unit.grad, _MemRefType.GRAD)
            tracker._update_and_maybe_create_winfos(unit.master, _MemRefType.OPT)
        tracker.track_external(trainer.opt)
        for buf in trainer.gather_slots:  # gathered parameters (the ring of D + 1 buffers)
            tracker._update_and_maybe_create_winfos(buf, _MemRefType.PARAM)
        for buf in trainer.reduce_slots:  # unsharded gradient buffers
            tracker._update_and_maybe_create_winfos(buf, _MemRefType.GRAD)
    else:
        tracker.track_external(trainer.net, trainer.opt)
    return tracker


def _by_category(snapshot: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    raw = {str(getattr(k, "value", k)): int(v) for k, v in snapshot.items()}
    out = dict.fromkeys(CATEGORIES, 0)
    for key, value in raw.items():
        if key != "Total":
            out[_CATEGORY_OF.get(key, "other")] += value
    return out, raw


def _sum_devices(snap: dict[Any, dict[Any, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for device, values in snap.items():
        if torch.device(device).type == "meta":
            continue
        for key, value in values.items():
            name = str(getattr(key, "value", key))
            total[name] = total.get(name, 0) + int(value)
    return total


def _by_module(tracker: Any) -> dict[str, dict[str, int]]:
    """Per module (the root, its units and their direct children): the tracker's highest total
    during its forward and during its backward (``_ModMemStats.local_peak`` snapshots), bytes."""
    out: dict[str, dict[str, int]] = {}
    for stats in tracker.memory_tracking.values():
        fqn = stats.mod_fqn
        if fqn.count(".") > 3:
            continue
        row = {}
        for state, snaps in stats.snapshots.items():
            name = str(getattr(state, "value", state))
            if "Peak" not in name or not snaps:
                continue
            row[name.lower().replace(" ", "_")] = max(_sum_devices(s).get("Total", 0) for s in snaps)
        out[fqn] = row
    return dict(sorted(out.items()))


def _record_phase_peaks(tracker: Any) -> dict[str, int]:
    """Highest tracked total while in a forward, a backward (``ModTracker.is_bw``) and inside
    ``Optimizer.step`` (``MemTracker._in_opt``), filled in as the tracker updates its peak."""
    phases = {"forward": 0, "backward": 0, "optimizer_step": 0}
    original = tracker._update_peak_stats

    def update(peak_state: Any) -> None:
        original(peak_state)
        total = _sum_devices(tracker._curr_mem_snap).get("Total", 0)
        phase = "optimizer_step" if tracker._in_opt else "backward" if tracker._mod_tracker.is_bw else "forward"
        phases[phase] = max(phases[phase], total)

    tracker._update_peak_stats = update
    return phases


# ---------------------------------------------------------------------------- measuring


def _nd_notes(spec: RunSpec) -> str:
    lay = spec.layout
    if lay.pp == 1:
        return "nd: TP+SP (DTensor) and DP on the fake process group, all of rank 0's work measured."
    return (f"nd: rank 0 is pipeline stage 0 of {lay.pp} (and tp rank 0, dp rank 0); its "
            f"{'interleaved ' if lay.vpp > 1 else ''}1F1B schedule runs on the fake process group with "
            f"{spec.num_micro_batches} micro-batches: warm-up forwards keep up to {lay.pp} micro-batches' "
            "activations in flight, as in a real run. Pipeline sends are no-ops and receives leave their "
            "preallocated buffers untouched (the received gradients are zeros/garbage, which changes no "
            "shape or byte); the stage's shapes are given to PipelineStage up front because the "
            "shape-inference handshake (send/recv_object_list) cannot run on a fake group. Not covered: "
            "other stages (the last stage holds the head and logits; rank 0 holds the embedding).")


def measure(spec: RunSpec, method: str) -> dict[str, Any]:
    """Peak tracked memory of rank 0 during optimizer step :data:`MEASURED_STEP` (after one
    warm-up step) of ``spec`` on a fake process group of ``spec.world_size`` ranks.

    Returns ``peak_allocated_bytes``, ``by_category`` (bytes of each category at the moment of
    the peak; :data:`CATEGORIES`), ``by_tracker_category`` (the tracker's own names),
    ``by_module`` (peak during each module's forward / backward), ``phase_peaks`` (highest
    total in forward, backward and the optimizer step), ``resident_bytes`` (tracked
    bytes when the measured step starts), ``cuda_allocator`` (method ``cuda``: the caching
    allocator's resident, peak allocated and peak reserved bytes of the measured step; empty
    otherwise), ``method``, ``measured_step``, ``seconds`` and
    ``notes``."""
    if method not in METHODS:
        raise ValueError(f"method: {method!r} is not one of {', '.join(METHODS)}")
    if spec.strategy == "reference":
        raise ValueError("memtrack: measures the distributed strategies (reference has no rank 0 of N)")
    spec.validate()
    # an earlier measurement's trainer lives on in reference cycles (modules <-> FSDP2's hooks)
    # until the cycle collector runs; on CUDA its tensors would count in this run's allocator
    # figures (seen on an H100: docs/gpu-measurements.md)
    gc.collect()
    start = time.perf_counter()
    _fake_process_group(spec.world_size)
    device = torch.device("cuda", torch.cuda.current_device()) if method == "cuda" else torch.device("cpu")
    tmodel._ROPE_CACHE.clear()  # a cached table must belong to this run's tensor mode
    if method == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode: Any = FakeTensorMode(allow_non_fake_inputs=True)
    else:
        mode = contextlib.nullcontext()
    torch.manual_seed(spec.seed)
    try:
        with _meshes_outside_fake_mode(), mode:
            trainer = _make_trainer(spec, device)
            built = time.perf_counter()
            trainer.step(0)
            finish = getattr(trainer, "finish", None)
            if finish is not None:
                finish()
            trainer.zero_grad()
            warm = time.perf_counter()
            tracker = _tracker(spec, trainer)
            phases = _record_phase_peaks(tracker)
            allocator: dict[str, int] = {}
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                allocator["resident_allocated_bytes"] = int(torch.cuda.memory_allocated(device))
            with tracker:
                resident = _sum_devices(tracker.get_tracker_snapshot("current")).get("Total", 0)
                trainer.step(MEASURED_STEP)
                if finish is not None:
                    finish()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                allocator["max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
                allocator["max_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
            peak_snapshot = _sum_devices(tracker.get_tracker_snapshot("peak"))
            by_module = _by_module(tracker)
            states = dict(getattr(trainer, "states", {}))
            close = getattr(trainer, "close", None)
            if close is not None:
                close()
    finally:
        tmodel._ROPE_CACHE.clear()
    end = time.perf_counter()
    categories, raw = _by_category(peak_snapshot)
    notes = [f"step {MEASURED_STEP} measured after one warm-up step (Adam moments exist); rank 0 of "
             f"{spec.world_size} on a fake process group; fp32 parameters, gradients and compute, no recompute "
             "(bf16 would be the realistic case for real training)."]
    if method == "fake":
        notes.append("FakeTensorMode: storages have sizes but no data.")
    if spec.strategy == "asynchzp":
        notes.append("asynchzp: the ag/rs/dp communication pools ran inline on the training thread (the "
                     "tracker sees its own thread only): their allocations are in program order, a lower "
                     "bound on their overlap in a threaded run.")
    if spec.strategy == "nd":
        notes.append(_nd_notes(spec))
    notes.append("Collectives on the fake process group allocate nothing themselves; backend staging "
                 "buffers (gloo, NCCL) are outside PyTorch's allocator and not counted.")
    return {
        "peak_allocated_bytes": int(peak_snapshot.get("Total", 0)),
        "by_category": categories,
        "by_tracker_category": raw,
        "by_module": by_module,
        "phase_peaks": phases,
        "resident_bytes": int(resident),
        "model_state_bytes": states,
        "cuda_allocator": allocator,
        "method": method,
        "strategy": spec.strategy,
        "label": spec.label,
        "world_size": spec.world_size,
        "measured_step": MEASURED_STEP,
        "seconds": {"build": built - start, "warmup_step": warm - built, "measured_step": end - warm,
                    "total": end - start},
        "notes": " ".join(notes),
    }


def crosscheck(spec: RunSpec) -> float:
    """|fake - cpu| / cpu of :func:`measure`'s peak for ``spec`` (run it at a shape real
    tensors fit)."""
    fake = measure(spec, "fake")["peak_allocated_bytes"]
    cpu = measure(spec, "cpu")["peak_allocated_bytes"]
    return abs(fake - cpu) / cpu


def demo() -> None:
    for name in MEMORY_STRATEGIES:
        spec = spec_for(name, small(), micro_batches=2)
        print(name, f"{crosscheck(spec):.2e}")
