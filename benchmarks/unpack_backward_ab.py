"""``gather_valid``'s two CPU forms in one process: dualkv with the plain ``index_select`` + ``where`` vs the
``gather`` form (issue 35, defect 6), steps interleaved so other jobs' load hits both alike.

    .venv/bin/python benchmarks/unpack_backward_ab.py [--threads 2] [--runs 15]

The model, batch and step of ``model_cpu.py --ragged`` (loss outside: the ``[B, S, V]`` logits unpacked).
The rewritten graph calls ``packed_ops.unpack_tokens``, which looks ``gather_valid`` up at trace time; the
packed graph is traced at some call after the first, so the form is picked by which model is being stepped.
Prints each form's median step, Inductor's on the duplicated batch, the paired ratio, and the self times of
the backward's gather ops from one profiled step.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import model_cpu as mc  # noqa: E402
from dualkv_compile.layout import packed_ops  # noqa: E402
from dualkv_compile.layout.pack import gather_valid_indexed  # noqa: E402  (the form before the change, kept on CUDA)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model, cfg = mc.build_model()
    N, P, R = 8, 512, 64
    lens = [R // 2 + (i * (R - R // 2)) // (N - 1) for i in range(N)]
    ids, mask = mc.group_batch(P, lens, cfg.vocab_size)
    w = torch.randn(cfg.vocab_size, generator=torch.Generator().manual_seed(1))

    current = ["gather"]
    forms = {"plain": gather_valid_indexed, "gather": packed_ops.gather_valid}
    packed_ops.gather_valid = lambda *a, **k: forms.get(current[0], forms["gather"])(*a, **k)
    models = {"plain": model, "gather": copy.deepcopy(model), "inductor": copy.deepcopy(model)}
    fns = {n: torch.compile(models[n], backend="dualkv") for n in ("plain", "gather")}
    fns["inductor"] = torch.compile(models["inductor"])
    for n in fns:
        current[0] = n
        for _ in range(2):
            models[n].zero_grad(set_to_none=True)
            mc.step(fns[n], models[n], ids, mask, w)
    diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(models["plain"].parameters(), models["gather"].parameters()))
    print(f"max |grad diff| plain vs gather: {diff:.3e}")

    ts = {n: [] for n in fns}
    for _ in range(args.runs):
        for n in fns:
            current[0] = n
            ts[n].append(mc.timed(mc.step, fns[n], models[n], ids, mask, w))
    print(f"torch {torch.__version__}, threads {args.threads}, {args.runs} interleaved runs")
    for n in fns:
        print(f"{n}: median {statistics.median(ts[n]):.1f} ms, min {min(ts[n]):.1f}")
    print(f"paired ratio plain/gather, median: {statistics.median(a / b for a, b in zip(ts['plain'], ts['gather'])):.3f}")
    for n in ("plain", "gather"):
        current[0] = n
        models[n].zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            mc.step(fns[n], models[n], ids, mask, w)
        ops = {e.key[:40]: round(e.self_cpu_time_total / 1e3, 1) for e in prof.key_averages()
               if "CompiledFxGraph" in e.key or "scatter" in e.key or "index_put" in e.key}
        print(f"{n}, one profiled step, self ms: {ops}")


if __name__ == "__main__":
    main()
