"""Host time of the tensor-view ops a list-form collective makes per rank of its group, on this
machine's CPU (the host side of an op does not depend on the device it describes).

    python benchmarks/bench_host_ops.py

DeepSpeed v0.3.16-v0.5.4 build the list of a list-form all-gather with one Python ``narrow`` per rank
(``partition_parameters.py::Init._allgather_param``); ProcessGroupNCCL then indexes each chunk of
its flattened buffer from C++ (``outputFlattened[i][j]``, a ``select``) and launches one
``copy_`` per chunk (``ProcessGroupNCCL::allgather``; ``reduce_scatter`` copies the chunks in).
This prints the first two as measured here: ``narrow`` from Python, and ``select`` from Python
(``v[j]``), an upper bound of the same op called from C++. ``strategies/_implementations.py``
adds them to the eager launch prior (``KERNEL_LAUNCH_S``) for ``LIST_FORM_PER_RANK_S``
(``docs/hardware-constants.md`` §7). Each figure is the least of 5 runs of 200,000 calls.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable

import torch


def per_call_us(fn: Callable[[], object], calls: int = 200_000, runs: int = 5) -> float:
    for _ in range(1000):
        fn()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> int:
    torch.set_num_threads(1)
    chunk = 1024
    flat = torch.empty(8 * chunk)
    rows = flat.view(8, chunk)
    small = torch.empty(chunk)
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.processor() or platform.machine()}")
    print(f"narrow (Python view op)       {per_call_us(lambda: flat.narrow(0, 3 * chunk, chunk)):5.2f} us")
    print(f"select (v[j] from Python)     {per_call_us(lambda: rows[3]):5.2f} us")
    print(f"add_ (eager op, CPU, 1 KiB)   {per_call_us(lambda: small.add_(1.0)):5.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
