"""Where the GPU waits on the host in a profiled step: its idle gaps, each charged to the host code that launched
the work ending it.

``idle_gaps(trace)`` reads a torch.profiler Chrome trace (``prof.export_chrome_trace``; the profile taken with
``with_stack=True`` so Python frames are in it) and returns, for every stretch in which no kernel, copy or fill ran
on any stream (longer than ``min_us``), the gap and the site that launched the activity after it. The site is the
innermost ``dualkv_compile`` Python frame enclosing the launching runtime call (else the innermost Python frame,
else the innermost op), so a gap reads as "the device sat idle this long, waiting for this line". ``gap_table``
sums them per site as Markdown.

Assumes the trace's usual fields: device activity has ``cat`` "kernel", "gpu_memcpy" or "gpu_memset" with
``args.correlation``; the runtime calls that launched it have ``cat`` "cuda_runtime" or "cuda_driver" and the same
correlation; host ops are "cpu_op", Python frames "python_function" (both with ``ts``/``dur`` in microseconds, on
the launching thread's ``tid``). A gap whose launch cannot be matched is charged to "(launch not found)".
Guarantees: the gaps' sum is the device's idle time between its first and last activity, nothing dropped except
gaps under ``min_us`` (counted apart, in the table's last row).
"""

from __future__ import annotations

import bisect

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def _enclosing(spans, ts):
    """The innermost span of ``spans`` (sorted by start, each (start, end, name)) containing ``ts``; None if none."""
    best = None
    at = bisect.bisect_right(spans, (ts, float("inf"), ""))
    for start, end, name in reversed(spans[max(0, at - 4096):at]):  # nested spans start at or before ts
        if end >= ts and (best is None or start >= best[0]):
            best = (start, end, name)
            break  # the latest-starting span containing ts is the innermost one
    return best


def short_path(path: str) -> str:
    """A file (or a trace's "path(line): func" frame) as a reader finds it: from the package or the repository
    folder on, not the machine's prefix (``site-packages/`` itself dropped)."""
    for root in ("site-packages/", "dualkv_compile/", "benchmarks/", "tests/"):
        at = path.rfind(root)
        if at >= 0:
            return path[at + (len(root) if root == "site-packages/" else 0):]
    return path.rsplit("/", 1)[-1]


def idle_gaps(trace: dict, min_us: float = 5.0):
    """``(gaps, small_us, busy_us, span_us)``: ``gaps`` a list of (idle microseconds, site) for each idle stretch of
    at least ``min_us``; ``small_us`` the idle time in shorter stretches; ``busy_us`` the union of device activity;
    ``span_us`` first activity start to last activity end."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS and "dur" in e), key=lambda e: e["ts"])
    launches = {e.get("args", {}).get("correlation"): e for e in events if e.get("cat") in LAUNCH_CATS}
    ours, frames, ops = {}, {}, {}
    for e in events:
        if "dur" not in e:
            continue
        span = (e["ts"], e["ts"] + e["dur"], e.get("name", ""))
        if e.get("cat") == "python_function":
            frames.setdefault(e.get("tid"), []).append(span)
            if "dualkv_compile/" in span[2]:
                ours.setdefault(e.get("tid"), []).append(span)
        elif e.get("cat") == "cpu_op":
            ops.setdefault(e.get("tid"), []).append(span)
    for table in (ours, frames, ops):
        for spans in table.values():
            spans.sort()
    gaps, small, busy, end = [], 0.0, 0.0, None
    for e in device:
        start, stop = e["ts"], e["ts"] + e["dur"]
        if end is not None and start > end:
            idle = start - end
            if idle < min_us:
                small += idle
            else:
                gaps.append((idle, _site(launches.get(e.get("args", {}).get("correlation")), ours, frames, ops)))
        busy += max(0.0, stop - max(start, end if end is not None else start))
        end = stop if end is None else max(end, stop)
    span = (end - device[0]["ts"]) if device else 0.0
    return gaps, small, busy, span


def _site(launch, ours, frames, ops) -> str:
    if launch is None:
        return "(launch not found)"
    for table, fmt in ((ours, short_path), (frames, short_path), (ops, str)):
        hit = _enclosing(table.get(launch.get("tid"), []), launch["ts"])
        if hit is not None:
            return fmt(hit[2])
    return f"({launch.get('name', 'launch')} outside any op)"


def gap_table(trace: dict, steps: int = 1, min_us: float = 5.0, top: int = 20) -> str:
    """Markdown: the device's idle time per step, by the host site whose launch ended each gap."""
    gaps, small, busy, span = idle_gaps(trace, min_us)
    by_site: dict[str, list] = {}
    for idle, site in gaps:
        n, total, worst = by_site.get(site, (0, 0.0, 0.0))
        by_site[site] = (n + 1, total + idle, max(worst, idle))
    idle_total = sum(g for g, _ in gaps) + small
    lines = [f"- device active {busy / steps / 1e3:.2f} ms per step of a {span / steps / 1e3:.2f} ms span; idle "
             f"{idle_total / steps / 1e3:.2f} ms per step in {len(gaps) / steps:.0f} gaps of {min_us:g} us or more",
             "", "| idle ms per step | gaps per step | longest (us) | site whose launch ended the gap |",
             "|---:|---:|---:|---|"]
    for site, (n, total, worst) in sorted(by_site.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"| {total / steps / 1e3:.3f} | {n / steps:g} | {worst:.0f} | `{site[:110]}` |")
    lines.append(f"| {small / steps / 1e3:.3f} | | | (gaps under {min_us:g} us) |")
    return "\n".join(lines) + "\n"
