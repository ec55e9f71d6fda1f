"""How ``examples/fsdp_grpo.py`` measures and reports a step: parity, timing, profiles, the summary.

``first_step`` runs the parity step (out of memory: said, freed), ``out_of_memory_summary`` reports
which side ran out, ``local_grads`` and ``rel`` compare the gradients (FSDP2: this rank's shard),
``Timer`` times steps (CUDA events on GPU), ``profile_steps`` writes torch.profiler tables, ``mfu`` gives
each side's model FLOPs utilisation, and ``markdown`` renders rank 0's ``fsdp_grpo.md`` from the summary.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def first_step(fn, model, batch, device, say, name):
    """The parity step's loss (backward done), or None if it ran out of GPU memory (said, memory freed)."""
    try:
        loss = fn(model, batch)
        loss.backward()
        return loss
    except torch.OutOfMemoryError as e:
        say(f"{name}: out of memory ({str(e).splitlines()[0][:160]})")
        model.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None


def out_of_memory_summary(args, rank, world, dk_loss, plain_loss, device) -> int:
    """One side ran out of memory: say which, with each rank's peak; the other side's step time if it ran."""
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    mine = {"rank": rank, "dualkv_oom": dk_loss is None, "baseline_oom": plain_loss is None, "peak_mib": peak}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        line = ", ".join(f"rank {r['rank']}: dualkv {'OOM' if r['dualkv_oom'] else 'ran'}, {args.baseline} "
                         f"{'OOM' if r['baseline_oom'] else 'ran'} (peak {r['peak_mib'] or 0:.0f} MiB)" for r in everyone)
        verdict = "OK (baseline out of memory)" if not any(r["dualkv_oom"] for r in everyone) else "DUALKV OUT OF MEMORY"
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "fsdp_grpo_oom.json"), "w") as f:
                json.dump({"date": datetime.date.today().isoformat(), "torch": torch.__version__, "args": vars(args), "ranks": everyone}, f, indent=2)
        print(f"{args.mode} x{world}{f' sp {args.sp}' if args.sp > 1 else ''}: {line} - fsdp_grpo: {verdict}", flush=True)
    return 0 if not any(r["dualkv_oom"] for r in everyone) else 1


def local_grads(model):
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "to_local"):
            g = g.to_local()  # FSDP2: this rank's shard of the reduced gradient
        out[name] = None if g is None else g.detach().float()
    return out


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class Timer:
    def __init__(self, device):
        self.device = device

    def __call__(self, fn, iters):
        times = []
        for _ in range(iters):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times) if times else None


def profile_steps(args, rank, steps) -> None:
    """3 steps of each variant under torch.profiler; rank 0 writes two tables per variant to ``--out``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    for name, run in steps:
        with profile(activities=activities) as prof:
            for _ in range(3):
                run()
            if args.device == "cuda":
                torch.cuda.synchronize()
        if rank == 0 and args.out:
            os.makedirs(args.out, exist_ok=True)
            events = prof.key_averages()
            with open(os.path.join(args.out, f"profile_{name}.txt"), "w") as f:
                f.write(f"{name}: 3 steps, by self CPU time\n")
                f.write(events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90))
                if args.device == "cuda":
                    f.write(f"\n{name}: 3 steps, by device time\n")
                    f.write(events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90))


def mfu(summary: dict, peak_tflops: float) -> dict:
    """Mean over ranks of each side's MFU, on the logical (duplicated batch) and executed (packed) FLOPs.

    Each rank carries ``flops``: its batch's model FLOPs before and after packing (``benchmarks.model.model_gpu.flops``:
    6 per linear parameter per token, 14 x head_dim x heads per attention pair per layer; checkpointing's recompute
    not counted). A group of ``sp`` ranks shares one batch, so each rank is credited 1/sp of it. The remove-padding
    baseline executes the logical FLOPs; dualkv executes the packed ones."""
    sp = summary.get("sp", 1)
    out = {"peak_tflops_per_gpu": peak_tflops}
    rows = [r for r in summary["ranks"] if r["plain"]["ms"] and r["dualkv"]["ms"]]
    if not rows:
        return out
    for key, side, flops in (("plain_logical", "plain", "logical"), ("dualkv_logical", "dualkv", "logical"),
                             ("dualkv_executed", "dualkv", "executed")):
        out[key] = statistics.mean(r["flops"][flops] / sp / (r[side]["ms"] * 1e-3) / (peak_tflops * 1e12) for r in rows)
    return out


def markdown(s: dict) -> str:
    shape = ", ".join(f"{k}={v}" for k, v in s["shape"].items())
    lines = [
        f"# fsdp_grpo: {s['mode']}{' (fully_shard per layer)' if s['per_layer'] else ''}{', bf16 MixedPrecisionPolicy' if s['bf16'] else ''}{', activation checkpointing' if s.get('checkpoint') else ''}, {s['world_size']} ranks"
        + (f", sequence parallel {s['sp']}" if s.get("sp", 1) > 1 else "") + f"; baseline: {s.get('baseline', 'plain')}",
        "",
        f"{s['date']}; torch {s['torch']}; device {s['gpu'] or s['device']}; inner compiler {s['inner']}; {shape}.",
        f"Parity (relative, tolerance {s['tolerance']:.0e}): {'holds' if s['parity'] else 'FAILS'}; packed on every rank: {s['packed_on_every_rank']}.",
        "",
        "| rank | rows | groups | tokens before -> after (per rank) | rho | loss rel err | max grad rel err | plain ms | dualkv ms | speedup | plain peak MiB | dualkv peak MiB |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in s["ranks"]:
        st, p, d = r["stats"], r["plain"], r["dualkv"]
        sp = p["ms"] / d["ms"] if p["ms"] and d["ms"] else None
        lines.append(
            f"| {r['rank']} | {st['rows']} | {st['groups']} | {st['tokens_before']} -> {st['tokens_after']}"
            f"{' (' + str(r['local_tokens']) + ')' if r.get('local_tokens') else ''} | {st['rho']:.2f}x | "
            f"{r['loss_rel_err']:.1e} | {r['grad_max_rel_err']:.1e} | {f(p['ms'], '.2f')} | {f(d['ms'], '.2f')} | {f(sp, '.2f')} | "
            f"{f(p['peak_mib'], '.0f')} | {f(d['peak_mib'], '.0f')} |"
        )
    u = s.get("mfu") or {}
    if "plain_logical" in u:
        lines += ["", f"MFU (model FLOPs over {u['peak_tflops_per_gpu']:.0f} TFLOP/s a GPU, mean over ranks): baseline "
                  f"{u['plain_logical']:.1%}; dualkv {u['dualkv_logical']:.1%} on the logical (duplicated) FLOPs, "
                  f"{u['dualkv_executed']:.1%} on the FLOPs it executes."]
    lines.append("")
    return "\n".join(lines)
