"""Per-op self CPU time of one side's step at a given thread count, and a 1-vs-2-thread table (issue 35, defect 6).

    .venv/bin/python benchmarks/probes/cpu_thread_profile.py --side dualkv --threads 1 --steps 5 --json /tmp/d1.json
    .venv/bin/python benchmarks/probes/cpu_thread_profile.py --side dualkv --threads 2 --steps 5 --json /tmp/d2.json
    .venv/bin/python benchmarks/probes/cpu_thread_profile.py --compare /tmp/d1.json /tmp/d2.json [--top 15]

The model, batch and step of ``model_cpu.py --ragged`` (loss outside, ``[B, S, V]`` logits unpacked; ``--loss
given``: the model alone, its backward from that loss's gradient, precomputed);
``--side`` dualkv (``backend="dualkv"``) or inductor (``torch.compile`` on the duplicated batch). Inductor's
C++ kernels are profiled one by one (``cpp.enable_kernel_profile``), so the compiled graphs' own time is
split into their kernels. Each thread count runs in its own process (Inductor fixes the thread count of its
kernels at compile time). ``--compare`` prints, for the top ops by self time at the second file's thread
count, the self ms per step at both counts, the speedup and the excess over perfect scaling; and the step's
wall time at both. A run records how many cores other processes kept busy while it profiled (Linux
``/proc/stat``): on a shared machine, a 2-thread number taken beside another job is worth nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from benchmarks import harness  # noqa: E402


def _name(key: str) -> str:
    """Group Inductor's numbered kernels and graphs: ``cpp_fused_add_12`` -> ``cpp_fused_add_*``."""
    key = re.sub(r"_\d+$", "_*", key)
    return re.sub(r"CompiledFxGraph \S+", "CompiledFxGraph (self)", key)


def _busy_jiffies() -> int:
    """All CPUs' busy time since boot, in clock ticks (Linux /proc/stat); 0 elsewhere."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:8]]
        return sum(v) - v[3]  # all but idle
    except OSError:
        return 0


def run(args) -> None:
    import torch._inductor.config as ic

    from benchmarks.model import model_cpu as mc

    ic.cpp.enable_kernel_profile = True
    torch.set_num_threads(args.threads)
    model, cfg = mc.build_model()
    ids, mask = mc.group_batch(512, mc.response_lengths(8, 64, ragged=True), cfg.vocab_size)  # model_cpu.py --ragged
    w = mc.loss_projection(cfg.vocab_size)
    fn = torch.compile(model, backend="dualkv") if args.side == "dualkv" else torch.compile(model)
    step = mc.step
    if args.loss == "given":  # the model alone: backward from the gradient the outside loss hands it, precomputed
        g = mask.bool()[:, :, None] * w / mask.sum()

        def step(fn, model, ids, mask, w):
            fn(input_ids=ids, attention_mask=mask).logits.backward(g)
    for _ in range(3):
        mc.timed(step, fn, model, ids, mask, w)
    wall = [mc.timed(step, fn, model, ids, mask, w) for _ in range(args.steps)]
    from torch.profiler import ProfilerActivity, profile

    busy0, own0, t0 = _busy_jiffies(), os.times(), time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            mc.timed(step, fn, model, ids, mask, w)
    own1, span = os.times(), time.perf_counter() - t0
    own = own1.user + own1.system - own0.user - own0.system
    others = max(0.0, (_busy_jiffies() - busy0) / os.sysconf("SC_CLK_TCK") - own) / span  # other processes' cores
    ops: dict[str, list[float]] = {}
    for e in prof.key_averages():
        o = ops.setdefault(_name(e.key), [0.0, 0.0, 0])
        o[0] += e.self_cpu_time_total / 1e3 / args.steps
        o[1] += e.cpu_time_total / 1e3 / args.steps
        o[2] += e.count / args.steps
    total = sum(o[0] for o in ops.values())
    out = {"side": args.side, "loss": args.loss, "threads": args.threads, "steps": args.steps,
           "torch": torch.__version__, "wall_ms": wall, "self_total_ms": total, "other_cores_busy": others,
           "profiled_step_ms": span * 1e3 / args.steps, "ops": ops}
    stamp = harness.stamp("cpu_thread_profile", device="cpu", script=__file__)
    meta = {k: out[k] for k in ("side", "loss", "threads", "steps", "torch")}
    harness.write_json(args.json, harness.record(stamp, meta=meta, results=out), indent=None)
    top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:20]
    print(f"{args.side} threads {args.threads}: wall median {statistics.median(wall):.1f} ms, profiled step "
          f"{span * 1e3 / args.steps:.1f} ms, its ops' self sum {total:.1f} ms; other processes kept {others:.2f} "
          "cores busy meanwhile")
    for k, (s, _, c) in top:
        print(f"  {s:8.2f} ms  x{c:6.1f}  {k}")


def compare(a_path: str, b_path: str, top: int = 15) -> str:
    """The markdown table of the top ``top`` ops by self time in ``b_path`` (more threads) against ``a_path``."""
    with open(a_path) as fa, open(b_path) as fb:
        a, b = harness.payload(json.load(fa)), harness.payload(json.load(fb))  # records (or older flat files)
    ta, tb = a["threads"], b["threads"]
    wa, wb = statistics.median(a["wall_ms"]), statistics.median(b["wall_ms"])
    busy = ", ".join(f"{x.get('other_cores_busy', float('nan')):.2f}" for x in (a, b))
    lines = [
        f"{b['side']}, loss {b.get('loss', 'outside')}: step wall median {wa:.1f} ms at {ta} thread(s), {wb:.1f} ms "
        f"at {tb}: {wa / wb:.2f}x; profiled self sum {a['self_total_ms']:.1f} -> {b['self_total_ms']:.1f} ms; "
        f"other processes' cores busy while profiling: {busy}",
        "",
        f"| op | calls / step | self ms, {ta} thr | self ms, {tb} thr | speedup | share of {tb}-thr self | "
        "ms over perfect scaling |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def row(name, calls, sa, sb):
        sp = f"{sa / sb:.2f}x" if sb > 0 else "-"
        return (f"| {name} | {calls} | {sa:.1f} | {sb:.1f} | {sp} | {100 * sb / b['self_total_ms']:.1f}% | "
                f"{sb - sa * ta / tb:+.1f} |")

    rows = sorted(b["ops"].items(), key=lambda kv: -kv[1][0])[:top]
    for k, (sb, _, c) in rows:
        lines.append(row(f"`{k[:70]}`", f"{c:.0f}", a["ops"].get(k, [0.0])[0], sb))
    rest_a = a["self_total_ms"] - sum(a["ops"].get(k, [0.0])[0] for k, _ in rows)
    rest_b = b["self_total_ms"] - sum(v[0] for _, v in rows)
    lines.append(row("all other ops", "", rest_a, rest_b))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=["dualkv", "inductor"], default="dualkv")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--loss", choices=["outside", "given"], default="outside",
                    help="outside: model_cpu.py's loss, eager on the [B, S, V] logits; given: the model alone, its "
                    "backward started from the gradient that loss hands it (no out[valid] and its index_put backward)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--compare", nargs=2, metavar=("FEWER_THREADS.json", "MORE_THREADS.json"))
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    if args.compare:
        print(compare(*args.compare, args.top))
    else:
        args.json = args.json or f"/tmp/cpu_thread_profile_{args.side}_t{args.threads}.json"
        t0 = time.perf_counter()
        run(args)
        print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
