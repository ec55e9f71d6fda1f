"""benchmarks/probes/step_gaps.py: the device's idle gaps in a profiler trace, each charged to the host site that launched
the work ending it. Synthetic traces with known gaps (no GPU needed)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # benchmarks/ is a package of the repository

from benchmarks.probes.step_gaps import gap_table, idle_gaps  # noqa: E402


def _kernel(ts, dur, corr, cat="kernel"):
    return {"cat": cat, "name": f"k{corr}", "ts": ts, "dur": dur, "tid": 7, "args": {"correlation": corr}}


def _launch(ts, corr, tid=1):
    return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "tid": tid,
            "args": {"correlation": corr}}


def _py(ts, dur, name, tid=1):
    return {"cat": "python_function", "name": name, "ts": ts, "dur": dur, "tid": tid}


def _trace():
    # Host: an outer benchmark frame, dualkv's runner.py frame with a nested torch frame inside, then a frame of
    # another library. Device: kernel 1 at 100-110, kernel 2 at 140-150 (30 us idle, launched inside runner.py's
    # nested torch frame), a copy at 150-160 (no gap), kernel 4 at 163-170 (3 us: a small gap), kernel 5 at 300-310
    # (130 us idle, launched in the other library's frame, outside dualkv), kernel 6 (no launch in the trace) at
    # 400-405 (90 us idle), and kernel 7 on a second stream inside kernel 6's time (overlap: no gap, busy unchanged).
    return {"traceEvents": [
        _py(0, 1000, "benchmarks/peers/peers.py(10): step"),
        _py(20, 200, "/x/dualkv_compile/runtime/runner.py(180): _padding_read"),
        _py(30, 150, "/x/site-packages/torch/_tensor.py(5): to"),
        _py(250, 100, "/x/site-packages/transformers/moe.py(9): route"),
        _launch(25, 1), _launch(130, 2), _launch(135, 3), _launch(140, 4), _launch(260, 5), _launch(262, 7),
        _kernel(100, 10, 1), _kernel(140, 10, 2), _kernel(150, 10, 3, cat="gpu_memcpy"), _kernel(163, 7, 4),
        _kernel(300, 10, 5), _kernel(400, 5, 6), _kernel(401, 2, 7),
    ]}


def test_idle_gaps_charges_each_gap_to_the_innermost_dualkv_frame_else_the_innermost_frame():
    gaps, small, busy, span = idle_gaps(_trace(), min_us=5)
    assert gaps == [(30, "dualkv_compile/runtime/runner.py(180): _padding_read"), (130, "transformers/moe.py(9): route"),
                    (90, "(launch not found)")]
    assert small == 3
    assert busy == 10 + 10 + 10 + 7 + 10 + 5
    assert span == 405 - 100
    assert busy + small + sum(g for g, _ in gaps) == span  # nothing dropped


def test_gap_table_sums_per_site_per_step():
    text = gap_table(_trace(), steps=2, min_us=5)
    lines = text.splitlines()
    assert "idle 0.13 ms per step in 2 gaps" in lines[0]  # (30 + 130 + 90 + 3) / 2 us; 3 gaps over 2 steps
    rows = [line for line in lines if line.startswith("| 0.")]
    assert rows[0].startswith("| 0.065 | 0.5 | 130 | `transformers/moe.py(9): route`")
    assert rows[1].startswith("| 0.045 | 0.5 | 90 | `(launch not found)`")
    assert rows[2].startswith("| 0.015 | 0.5 | 30 | `dualkv_compile/runtime/runner.py(180): _padding_read`")
    assert rows[3].startswith("| 0.002 | | | (gaps under 5 us)")
