"""How ``benchmarks/ops/attention.py`` times a call: median ms with CUDA events (queued behind a GPU sleep, and from an
idle GPU) or wall time on CPU, and the small helpers around it (log, sync, free, a null context).

Imported by ``attention.py`` (which re-exports these names for ``op_overhead.py`` and the tuning scripts),
``attention_methods.py`` and ``attention_report.py``.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from typing import Callable

import torch


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- timing


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


QUEUE_MS = 2.0  # the GPU sleep each timed call is queued behind (see time_ms)


def gpu_sleep(ms: float) -> None:
    """Queue about ``ms`` of GPU sleep on the current stream, so the host's next launches find the GPU busy."""
    torch.cuda._sleep(int(ms * 1.5e6))  # clock cycles, at about 1.5 GHz: the length need not be exact


def time_ms(fn: Callable, device, budget_ms: float, min_reps: int, max_reps: int) -> tuple[float, float]:
    """``(queued, from_idle)``: median ms of ``fn`` after one warm-up call; reps fitted to the budget.

    On CUDA each rep times ``fn`` twice, with events around it: ``queued`` behind a ``QUEUE_MS`` GPU
    sleep, so the host's work before the first kernel (Python dispatch, checks, launches) runs while
    the GPU is busy, as in a training step whose host runs ahead; ``from_idle`` from an idle GPU, so
    that host work counts (``benchmarks/ops/op_overhead.py`` splits it out). On CPU both are wall time.
    """
    fn()
    _sync(device)
    queued, idle = [], []
    while True:
        if device.type == "cuda":
            for times, ahead in ((queued, True), (idle, False)):
                if ahead:
                    gpu_sleep(QUEUE_MS)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            queued.append((time.perf_counter() - t0) * 1e3)
            idle.append(queued[-1])
        n = len(queued)
        if n >= max_reps or (n >= min_reps and sum(queued) >= budget_ms):
            return statistics.median(queued), statistics.median(idle)
