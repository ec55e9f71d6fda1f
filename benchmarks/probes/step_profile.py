"""Where one training step's time goes, from torch.profiler: device kernels by kind, host dispatch, launches.

``profile_step(fn, model, batch, device)`` runs ``fn(model, batch).backward()`` a few times under the profiler
(the caller has compiled and warmed ``fn`` already) and returns a Markdown section: the wall time per step, the
device's busy time per step (the sum of kernel durations: what is left of the wall time is the GPU waiting on the
host, or kernels overlapping), kernel launches per step, the busy time split by kernel kind (matrix products,
attention, Inductor/Triton fused kernels, communication, copies and other), and the top kernels and the top host
ops. The kinds are read from kernel names, a heuristic that names its rules in ``KINDS``. On a CPU there are no
device kernels: only the host ops' table.
"""

from __future__ import annotations

import os
import re
import time
import traceback
import warnings

import torch

from benchmarks.probes.step_gaps import gap_table, short_path

# (kind, regex over a kernel's name), first match wins.
KINDS = [
    ("communication", r"nccl|all_?to_?all|allgather|reduce_?scatter|allreduce"),
    ("attention", r"attn|attention|flash|fmha|gluon|_fwd_kernel|_bwd_kernel|_dkdv|_dq"),
    ("matrix products", r"gemm|nvjet|sm90_xmma|cutlass|matmul|mm_|_mm|wgmma|cublas"),
    ("Inductor / Triton fused", r"^triton_|triton"),
    ("copies and fills", r"memcpy|memset|copy|fill|cat|index|scatter|gather|elementwise|vectorized"),
]


def kind_of(name: str) -> str:
    """The kind of a kernel, by ``KINDS``' first matching rule ('other' if none)."""
    low = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, low)), "other")


def _device_events(prof):
    from torch.autograd import DeviceType

    return [e for e in prof.events() if e.device_type == DeviceType.CUDA]


def _steps(fn, model, batch, steps: int) -> None:
    """``steps`` training steps, ``fn(model, batch).backward()`` each, the gradients dropped after each."""
    for _ in range(steps):
        fn(model, batch).backward()
        model.zero_grad(set_to_none=True)


def profile_step(fn, model, batch, device: str, steps: int = 3, title: str = "step") -> str:
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        _steps(fn, model, batch, steps)
        sync()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    lines = [f"### Profile: {title}", "", f"- wall time per step under the profiler: {wall_ms:.1f} ms ({steps} steps)"]
    if cuda:
        kernels = _device_events(prof)
        by_name = {}  # kernel name -> (launches, ms) per step
        for e in kernels:
            n, ms = by_name.get(e.name, (0, 0.0))
            by_name[e.name] = (n + 1, ms + e.time_range.elapsed_us() / 1e3 / steps)
        busy = {}  # kind -> ms per step, each distinct name classified once
        for name, (_, ms) in by_name.items():
            busy[kind_of(name)] = busy.get(kind_of(name), 0.0) + ms
        total = sum(busy.values())
        lines += [f"- device busy per step (sum of kernel durations): {total:.1f} ms, {total / wall_ms:.0%} of the wall "
                  f"time; kernel launches per step: {len(kernels) / steps:.0f}", "",
                  "| kernel kind | ms per step | share of busy |", "|---|---:|---:|"]
        lines += [f"| {k} | {v:.2f} | {v / total:.0%} |" for k, v in sorted(busy.items(), key=lambda kv: -kv[1])]
        lines += ["", "| top kernels | launches per step | ms per step | kind |", "|---|---:|---:|---|"]
        for name, (n, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]:
            lines.append(f"| `{name[:90]}` | {n / steps:.0f} | {ms:.2f} | {kind_of(name)} |")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    lines += ["", "Host ops by self CPU time (all steps):", "", "```", table, "```", ""]
    if cuda:
        lines += ["Where the GPU waits on the host (3 more steps, profiled with Python frames; `step_gaps.py`):", "",
                  idle_profile(fn, model, batch, steps)]
    return "\n".join(lines)


def idle_profile(fn, model, batch, steps: int = 3) -> str:
    """``step_gaps.gap_table`` of ``steps`` steps profiled with Python stacks (a CUDA device; warmed by the caller)."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        _steps(fn, model, batch, steps)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return gap_table(trace, steps)


SYNC_WARNING = "synchronizing CUDA operation"  # the text of torch.cuda.set_sync_debug_mode("warn")'s warning


def _site(frames) -> str:
    """Where a sync comes from: the innermost frame of dualkv_compile (if any) and the innermost frame overall."""
    inner = frames[-1]
    ours = next((f for f in reversed(frames) if "dualkv_compile/" in f.filename), None)
    text = f"`{short_path(inner.filename)}:{inner.lineno}` {inner.name}"
    if ours is not None and ours is not inner:
        text = f"`{short_path(ours.filename)}:{ours.lineno}` {ours.name} -> " + text
    return text


class SyncSites:
    """Counts host-device synchronisations by call site while active (``torch.cuda.set_sync_debug_mode("warn")``).

    Each synchronising CUDA call (a device-to-host copy, ``.item()``, ``nonzero``, a copy from pageable memory)
    raises a warning in the calling Python thread; the warnings filter shows every one, and the stack at that point
    names the site. Warnings of other kinds pass through untouched. On a machine without CUDA nothing syncs and
    the counts stay empty.
    """

    def __init__(self):
        self.counts: dict[str, int] = {}

    def __enter__(self):
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING not in str(message):
                return shown(message, category, filename, lineno, file, line)
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith(("warnings.py", __file__))]
            site = _site(frames or traceback.extract_stack())
            self.counts[site] = self.counts.get(site, 0) + 1

        warnings.showwarning = show
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
        self._catch.__exit__(*exc)
        return False

    def markdown(self, title: str, steps: int = 1) -> str:
        total = sum(self.counts.values())
        lines = [f"### Host syncs: {title}", "", f"- synchronising CUDA calls per step: {total / steps:.0f}", "",
                 "| per step | site (dualkv_compile's innermost frame -> the innermost frame) |", "|---:|---|"]
        lines += [f"| {n / steps:g} | {site} |" for site, n in sorted(self.counts.items(), key=lambda kv: -kv[1])]
        return "\n".join(lines) + "\n"


def sync_sites(fn, model, batch, title: str = "step", steps: int = 1) -> str:
    """Markdown: the host-device syncs of ``steps`` calls of ``fn(model, batch).backward()`` by call site (warmed up
    by the caller, so compilation's own syncs are not counted)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with SyncSites() as sites:
        _steps(fn, model, batch, steps)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return sites.markdown(title, steps)
