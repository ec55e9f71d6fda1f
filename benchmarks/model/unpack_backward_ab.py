"""``gather_valid``'s CPU forms in one process, steps interleaved so other jobs' load hits all alike (issue 35, defect 6).

    .venv/bin/python benchmarks/model/unpack_backward_ab.py [--threads 2] [--runs 15] [--forms before,after]

Forms (``--forms``, any of them, in the order given; Inductor on the duplicated batch always runs too):
``plain``   ``index_select`` + ``where`` (``gather_valid_indexed``, the CUDA form)
``before``  the pre-change CPU form, copied below: ``gather`` of a float64 (float32 for bf16/fp16) copy with a
            zero row, cast back; its backward a ``scatter_add`` of a wide copy of the whole ``[N, F]`` gradient
``after``   the current CPU form (``dualkv::gather_rows``: the backward widens one column chunk at a time)

The model, batch and step of ``model_cpu.py --ragged`` (loss outside: the ``[B, S, V]`` logits unpacked).
The rewritten graph calls ``packed_ops.unpack_tokens``, which looks ``gather_valid`` up at trace time; the
packed graph is traced at some call after the first, so the form is picked by which model is being stepped.
Prints each form's median step, Inductor's on the duplicated batch, the paired ratios (each form / the last),
and the self and total times of the compiled graphs and the gather / scatter ops from one profiled step.
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
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from benchmarks import harness  # noqa: E402
from benchmarks.model import model_cpu as mc  # noqa: E402
from dualkv_compile.layout import packed_ops  # noqa: E402
from dualkv_compile.layout.pack import gather_valid_indexed  # noqa: E402  (the form before the change, kept on CUDA)


_WIDER = {torch.float32: torch.float64, torch.bfloat16: torch.float32, torch.float16: torch.float32}


def gather_valid_before(x, index, keep, dim=0):
    """The CPU form of ``gather_valid`` before issue 35 defect 6 (as of 37f79b3), kept here for the A/B."""
    y = x.movedim(dim, 0)
    rows, rest = y.shape[0], y.shape[1:]
    flat = y.flatten(1) if y.dim() > 1 else y.unsqueeze(1)
    if flat.dtype in _WIDER:
        flat = flat.to(_WIDER[flat.dtype])
    flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
    idx = index.masked_fill(~keep, rows)
    out = flat.gather(0, idx.unsqueeze(1).expand(idx.shape[0], flat.shape[1])).to(x.dtype)
    return out.reshape(idx.shape[0], *rest).movedim(0, dim)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--forms", default="before,after", help="comma-separated, of plain, before, after")
    args = ap.parse_args()
    names = args.forms.split(",")
    assert len(names) >= 2 and set(names) <= {"plain", "before", "after"}, names
    torch.set_num_threads(args.threads)

    model, cfg = mc.build_model()
    ids, mask = mc.group_batch(512, mc.response_lengths(8, 64, ragged=True), cfg.vocab_size)  # model_cpu.py --ragged
    w = mc.loss_projection(cfg.vocab_size)

    current = ["after"]
    forms = {"plain": gather_valid_indexed, "before": gather_valid_before, "after": packed_ops.gather_valid}
    packed_ops.gather_valid = lambda *a, **k: forms.get(current[0], forms["after"])(*a, **k)
    models = {n: copy.deepcopy(model) for n in names + ["inductor"]}
    fns = {n: torch.compile(models[n], backend="dualkv") for n in names}
    fns["inductor"] = torch.compile(models["inductor"])
    for n in fns:
        current[0] = n
        for _ in range(2):
            models[n].zero_grad(set_to_none=True)
            mc.step(fns[n], models[n], ids, mask, w)
    for n in names[1:]:
        diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(models[names[0]].parameters(), models[n].parameters()))
        print(f"max |grad diff| {names[0]} vs {n}: {diff:.3e}")

    ts = {n: [] for n in fns}
    for _ in range(args.runs):
        for n in fns:
            current[0] = n
            ts[n].append(mc.timed(mc.step, fns[n], models[n], ids, mask, w))
    print("\n".join(harness.markdown_stamp(harness.stamp("unpack_backward_ab", device="cpu", script=__file__))))
    print(f"torch {torch.__version__}, threads {args.threads}, {args.runs} interleaved runs")
    for n in fns:
        print(f"{n}: median {statistics.median(ts[n]):.1f} ms, min {min(ts[n]):.1f}")
    for n in names[:-1]:
        ratio = statistics.median(a / b for a, b in zip(ts[n], ts[names[-1]]))
        print(f"paired ratio {n}/{names[-1]}, median: {ratio:.3f}")
    for n in names:
        current[0] = n
        models[n].zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            mc.step(fns[n], models[n], ids, mask, w)
        ops = {e.key[:40]: (round(e.self_cpu_time_total / 1e3, 1), round(e.cpu_time_total / 1e3, 1))
               for e in prof.key_averages()
               if any(k in e.key for k in ("CompiledFxGraph", "scatter", "index_put", "gather_rows"))}
        print(f"{n}, one profiled step, (self ms, total ms): {ops}")


if __name__ == "__main__":
    main()
