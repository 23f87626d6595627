"""Every collective call, counted where every caller passes, before the backend.

Method (docs/executor.md, "What is measured"):

- **Where.** Every collective reaches a ProcessGroup backend through one of two families of
  dispatcher operators: ``c10d::*`` (``torch.distributed`` functions, FSDP2, pipelining's
  send/recv, our AsyncHZP threads) and ``_c10d_functional::*`` (DTensor and the functional
  collectives, which bypass the Python ``dist.*`` functions). We register a counting kernel at
  the Autograd dispatch key (CPU and CUDA) of each of them; it records the call (kind, group
  size, bytes, time, thread) and forwards to the real kernel. It sees callers in any thread and
  callers from C++.
- **Check.** PyTorch's flight recorder (``TORCH_FR_BUFFER_SIZE``) records one entry per call the
  gloo / NCCL backend receives. Its entries are named after what the backend runs (gloo runs a
  reduce-scatter as an all-reduce), so they are not used for the kinds, but their number must
  equal the number of hooked collective calls: :func:`summarize` reports both, and the executor
  reports ``counting_complete`` (gloo does not record point-to-point calls there).
- **Calls, not wire bytes.** Bytes follow hzpsim's (and NCCL-tests') convention: the full buffer
  of an all-gather (output) or reduce-scatter (input), the per-rank buffer of an all-reduce or
  all-to-all, the message of a send. A coalesced call counts once.

The same kernels add the optional artificial per-call host delay (``RunSpec.comm_delay_s``) to
every ``c10d`` collective call (the calls ``torch.distributed``, FSDP2 and the AsyncHZP executor
make). Run the self-check::

    python -m hzpsim.executor.counting
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")

FR_BUFFER_ENTRIES = 1_000_000


def enable_flight_recorder() -> None:
    """Must run before ``init_process_group`` in each process."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FR_BUFFER_ENTRIES))


@dataclass(frozen=True)
class CallRecord:
    """One collective call on this rank."""

    kind: str  # one of KINDS, or the backend's own name for anything else (broadcast, barrier ...)
    group_size: int  # ranks of the process group
    size_bytes: int  # NCCL-tests convention (see module docstring)
    time_ns: int  # when the call was made (time.time_ns clock)
    thread: str  # the calling thread's name
    step: int  # the optimizer step it belongs to (set_step / tag_thread)


def _nbytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


# (operator, kind, bytes(args), group size(args) or None)
_C10D = {
    "_allgather_base_": ("all_gather", lambda a: _nbytes(a[0]), lambda a: a[0].numel() // max(a[1].numel(), 1)),
    "allgather_": ("all_gather", lambda a: _nbytes(a[0]), lambda a: len(a[0][0])),
    "allgather_into_tensor_coalesced_": ("all_gather", lambda a: _nbytes(a[0]),
                                         lambda a: a[0][0].numel() // max(a[1][0].numel(), 1)),
    "_reduce_scatter_base_": ("reduce_scatter", lambda a: _nbytes(a[1]), lambda a: a[1].numel() // max(a[0].numel(), 1)),
    "reduce_scatter_": ("reduce_scatter", lambda a: _nbytes(a[1]), lambda a: len(a[1][0])),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a: _nbytes(a[1]),
                                         lambda a: a[1][0].numel() // max(a[0][0].numel(), 1)),
    "allreduce_": ("all_reduce", lambda a: _nbytes(a[0]), None),
    "allreduce_coalesced_": ("all_reduce", lambda a: _nbytes(a[0]), None),
    "alltoall_": ("all_to_all", lambda a: _nbytes(a[1]), lambda a: len(a[1])),
    "alltoall_base_": ("all_to_all", lambda a: _nbytes(a[1]), None),
    "send": ("send_recv", lambda a: _nbytes(a[0]), lambda a: 2),
    "recv_": ("recv", lambda a: _nbytes(a[0]), lambda a: 2),
    "broadcast_": ("broadcast", lambda a: _nbytes(a[0]), None),
    "barrier": ("barrier", lambda a: 0, None),
    "scatter_": ("scatter", lambda a: _nbytes(a[0]), None),
    "gather_": ("gather", lambda a: _nbytes(a[1]), None),
    "reduce_": ("reduce", lambda a: _nbytes(a[0]), None),
}
_FUNCTIONAL = {
    "all_gather_into_tensor": ("all_gather", lambda a: _nbytes(a[0]) * a[1], lambda a: a[1]),
    "all_gather_into_tensor_out": ("all_gather", lambda a: _nbytes(a[0]) * a[1], lambda a: a[1]),
    "all_gather_into_tensor_coalesced": ("all_gather", lambda a: _nbytes(a[0]) * a[1], lambda a: a[1]),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: _nbytes(a[0]), lambda a: a[2]),
    "reduce_scatter_tensor_out": ("reduce_scatter", lambda a: _nbytes(a[0]), lambda a: a[2]),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a: _nbytes(a[0]), lambda a: a[2]),
    "all_reduce": ("all_reduce", lambda a: _nbytes(a[0]), None),
    "all_reduce_": ("all_reduce", lambda a: _nbytes(a[0]), None),
    "all_reduce_coalesced": ("all_reduce", lambda a: _nbytes(a[0]), None),
    "all_reduce_coalesced_": ("all_reduce", lambda a: _nbytes(a[0]), None),
    "all_to_all_single": ("all_to_all", lambda a: _nbytes(a[0]), None),
    "broadcast": ("broadcast", lambda a: _nbytes(a[0]), None),
    "broadcast_": ("broadcast", lambda a: _nbytes(a[0]), None),
    "isend": ("send_recv", lambda a: _nbytes(a[0]), lambda a: 2),
    "irecv": ("recv", lambda a: _nbytes(a[0]), lambda a: 2),
}


_STEP = {"global": 0}
_THREAD = threading.local()


def set_step(step: int) -> None:
    """The optimizer step the main loop is in: calls from untagged threads belong to it."""
    _STEP["global"] = step


def tag_thread(step: int | None) -> None:
    """Attribute this thread's next calls to ``step`` (a background thread working for a step
    the main loop may have left); None = follow the main loop."""
    _THREAD.step = step


def current_step() -> int:
    tagged = getattr(_THREAD, "step", None)
    return _STEP["global"] if tagged is None else tagged


class _Hook:
    """The counting (and delaying) kernels, installed once per process."""

    def __init__(self) -> None:
        self.calls: list[CallRecord] = []
        self.delay_s = 0.0
        self._lock = threading.Lock()
        self._libs = [torch.library.Library("c10d", "IMPL"), torch.library.Library("_c10d_functional", "IMPL")]
        for lib, namespace, table in ((self._libs[0], torch.ops.c10d, _C10D),
                                      (self._libs[1], torch.ops._c10d_functional, _FUNCTIONAL)):
            for name, (kind, size_of, group_of) in table.items():
                if not hasattr(namespace, name):
                    continue
                op = getattr(namespace, name).default
                delayed = namespace is torch.ops.c10d and kind not in ("recv", "barrier")
                for key in ("AutogradCPU", "AutogradCUDA"):
                    lib.impl(name, self._kernel(op, kind, size_of, group_of, delayed), key)

    def _kernel(self, op, kind: str, size_of, group_of, delayed: bool):
        def kernel(*args, **kwargs):
            if delayed and self.delay_s:
                time.sleep(self.delay_s)
            try:
                size = int(size_of(args))
                group = int(group_of(args)) if group_of is not None else 0
            except Exception:  # an unexpected argument layout must not break training
                size, group = -1, 0
            record = CallRecord(kind, group, size, time.time_ns(), threading.current_thread().name, current_step())
            with self._lock:
                self.calls.append(record)
            with torch._C._AutoDispatchBelowAutograd():
                return op(*args, **kwargs)

        return kernel


_HOOK: _Hook | None = None


def install(delay_s: float = 0.0) -> _Hook:
    """Install the counting / delay kernels (idempotent) and set the per-call delay."""
    global _HOOK
    if _HOOK is None:
        _HOOK = _Hook()
    _HOOK.delay_s = delay_s
    return _HOOK


def backend_call_times() -> list[int]:
    """time_ns of every non-point-to-point call the backend's flight recorder holds."""
    raw = torch._C._distributed_c10d._dump_fr_trace_json(True, True)  # type: ignore[attr-defined]
    entries = json.loads(raw).get("entries", []) if raw else []
    return sorted(int(e["time_created_ns"]) for e in entries if not e.get("is_p2p"))


def collected() -> list[CallRecord]:
    """Every hooked call this process made so far, in time order."""
    assert _HOOK is not None, "counting.install() was not called"
    with _HOOK._lock:
        return sorted(_HOOK.calls, key=lambda r: r.time_ns)


def summarize(records: list[CallRecord], step: int, start_ns: int = 0, end_ns: int = 0,
              backend_times: list[int] | None = None) -> dict[str, dict[str, int]]:
    """Counts and bytes per kind (all five KINDS present) of the calls of optimizer step ``step``;
    ``check`` compares the hooked collective calls made in [start_ns, end_ns) with the backend's
    flight-recorder entries of that window (equal when nothing bypassed the hooks)."""
    counts = dict.fromkeys(KINDS, 0)
    sizes = dict.fromkeys(KINDS, 0)
    other: dict[str, int] = {}
    for r in records:
        if r.step != step:
            continue
        if r.kind in counts:
            counts[r.kind] += 1
            sizes[r.kind] += r.size_bytes
        else:
            other[r.kind] = other.get(r.kind, 0) + 1
    hooked = sum(1 for r in records if start_ns <= r.time_ns < end_ns and r.kind not in ("send_recv", "recv"))
    check = {"hooked_calls": hooked}
    if backend_times is not None:
        check["backend_calls"] = sum(1 for t in backend_times if start_ns <= t < end_ns)
    return {"counts": counts, "bytes": sizes, "other_counts": other, "check": check}


def _selfcheck(rank: int, world: int, port: int) -> None:
    enable_flight_recorder()
    install()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    start = time.time_ns()
    out = torch.empty(8 * world)
    dist.all_gather_into_tensor(out, torch.ones(8))
    if rank == 0:
        dist.send(torch.ones(3), 1)
    elif rank == 1:
        dist.recv(torch.empty(3), 0)
    end = time.time_ns() + 1
    summary = summarize(collected(), 0, start, end, backend_call_times())
    print(rank, summary)
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(_selfcheck, args=(2, 29601), nprocs=2)
