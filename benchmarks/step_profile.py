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

import re
import time

import torch

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


def profile_step(fn, model, batch, device: str, steps: int = 3, title: str = "step") -> str:
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn(model, batch).backward()
            model.zero_grad(set_to_none=True)
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
    return "\n".join(lines)
