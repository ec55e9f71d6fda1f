"""Whole-model GRPO loss step on GPU: @policy_loss (dualkv) against Inductor on the duplicated batch.

Qwen3-shaped models from configs (random weights, bf16): 0.6B and 1.7B at full
depth, 8B with fewer layers (``--layers-8b``, default 4). For each model and
batch shape, forward + backward of the same GRPO loss (token-mean of the
clipped objective): ``dualkv_compile.policy_loss(loss)`` against
``torch.compile(loss)`` (Inductor, SDPA, duplicated batch), side by side in one
process, median of CUDA-event timings after warm-up. Reports step time,
speedup, the ideal speedup from a FLOP model (linear layers and lm_head 3x
forward, attention 3.5x forward), peak memory, and tokens per second counting
logical tokens (the duplicated batch's valid tokens, the same for both).

The baseline runs the duplicated batch in micro-batches of at most
``--baseline-max-tokens`` tokens (gradient accumulation, the loss of each
micro-batch weighted by its share of response tokens: the same loss and
gradients as one call), as veRL and TRL bound their per-GPU token count; with
one micro-batch it is the plain full-batch step. dualkv runs the whole batch
in one call. ``--variants`` adds ``flex``: dualkv with the FlexAttention
kernel instead of the Triton one.

Writes ``model_gpu.json`` and ``model_gpu.md`` to ``--out`` after every case,
so a run cut short keeps what it measured. A case that runs out of memory is
reported as OOM, any other failure by its exception type.

    python benchmarks/model/model_gpu.py [--models 0.6b,1.7b,8b] [--shapes 16,4096,1024 ...] [--budget-s 420]
    python benchmarks/model/model_gpu.py --device cpu --models tiny --shapes 4,64,16   # smoke run of the script
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import dualkv_compile  # noqa: E402
from benchmarks import harness  # noqa: E402

MODELS = {
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=6144),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128),
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288),
}
VOCAB = 151936
TINY_VOCAB = 512
SHAPES = [(16, 4096, 1024), (8, 8192, 2048), (32, 2048, 512), (8, 1024, 4096), "groups"]


def log(msg):
    print(f"[model_gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def grpo_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    logp = logp.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - batch["old_logp"])
    adv = batch["advantages"][:, None]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    mask = batch["response_mask"][:, 1:].float()
    return (per_token * mask).sum() / mask.sum()


def make_batch(shape, device, seed=0, vocab=VOCAB):
    """Groups of [left-padded prompt | right-padded response] rows; ``groups``: 4 groups, R ~ U(128, 2048)."""
    g = torch.Generator().manual_seed(seed)
    if shape == "groups":
        groups = [(4096, [int(x) for x in torch.randint(128, 2049, (8,), generator=g)]) for _ in range(4)]
    else:
        N, P, R = shape
        groups = [(P, [R] * N)]
    P_max = max(P for P, _ in groups)
    R_max = max(max(rs) for _, rs in groups)
    rows = sum(len(rs) for _, rs in groups)
    ids = torch.zeros(rows, P_max + R_max, dtype=torch.long)
    mask = torch.zeros_like(ids)
    resp = torch.zeros_like(ids)
    b = 0
    for P, rs in groups:
        prompt = torch.randint(2, vocab, (P,), generator=g)
        for r in rs:
            ids[b, P_max - P : P_max] = prompt
            ids[b, P_max : P_max + r] = torch.randint(2, vocab, (r,), generator=g)
            mask[b, P_max - P : P_max + r] = 1
            resp[b, P_max : P_max + r] = 1
            b += 1
    S = ids.shape[1]
    batch = {
        "input_ids": ids, "attention_mask": mask, "response_mask": resp,
        "old_logp": torch.full((rows, S - 1), -11.9), "advantages": torch.randn(rows, generator=g),
    }
    return {k: v.to(device) for k, v in batch.items()}


def flops(cfg, stats, vocab=VOCAB) -> tuple[float, float]:
    """fwd+bwd FLOPs of the duplicated and the packed step: linear layers (and lm_head) 3x forward, attention 3.5x."""
    h, L, hd = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]
    hq, hkv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    per_token = L * (h * hq * hd + 2 * h * hkv * hd + hq * hd * h + 3 * h * inter) + h * vocab

    def total(tokens, pairs):
        return 3 * 2 * per_token * tokens + 3.5 * 4 * pairs * hd * hq * L

    return total(stats.tokens_before, stats.attention_pairs_before), total(stats.tokens_after, stats.attention_pairs_after)


def micro_batches(batch, max_tokens):
    """Split rows into the fewest equal micro-batches of at most ``max_tokens`` tokens (rows x S) each."""
    rows, S = batch["input_ids"].shape
    n = next(n for n in range(1, rows + 1) if rows % n == 0 and (rows // n) * S <= max_tokens or n == rows)
    total = batch["response_mask"][:, 1:].sum()
    parts = []
    for i in range(n):
        part = {k: v[i * rows // n : (i + 1) * rows // n] for k, v in batch.items()}
        parts.append((part, part["response_mask"][:, 1:].sum() / total))
    return parts


def time_step(fn, model, batch, reps, device, max_tokens=None):
    """Median ms of forward + backward (micro-batched when ``max_tokens`` is set), peak GB, micro-batch count."""
    parts = micro_batches(batch, max_tokens) if max_tokens else [(batch, 1.0)]

    def step():
        for part, weight in parts:
            (fn(model, part) * weight).backward()
        model.zero_grad(set_to_none=True)

    cuda = device == "cuda"
    for _ in range(2):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    return statistics.median(times), peak, len(parts)


def write(rows, meta, out, stamp):
    """``model_gpu.{json,md,png}`` under ``out``: the harness's record of ``stamp``, the table and the plot."""
    harness.write_json(os.path.join(out, "model_gpu.json"), harness.record(stamp, meta=meta, rows=rows))
    lines = [
        "# GRPO loss step (forward + backward), whole model: dualkv @policy_loss vs Inductor on the duplicated batch",
        "",
        f"- {meta['device']}; torch {meta['torch']}; triton {meta['triton']}; transformers {meta['transformers']}; {meta['date']}",
        f"- command: `{stamp['command']}`",
        f"- {meta['dtype']} Qwen3-shaped models, random weights, SDPA; median of {meta['reps']} timed steps after 2 warm-up steps; tokens/s count the duplicated batch's valid tokens (logical tokens) for both",
        "- ideal: FLOPs duplicated / FLOPs packed (linear layers and lm_head 3x forward, attention 3.5x forward)",
        f"- baseline: `torch.compile` (Inductor) of the same loss on the duplicated batch, in micro-batches of at most {meta['baseline_max_tokens']} tokens (mb = their count; 1 = the whole batch in one call); dualkv: `@policy_loss`, the whole batch in one call, attention_backend 'auto' (Triton; on sm_90 from 2026-11-25 the Gluon kernels: the forward and dQ, and from run 2026-11-25j dK/dV too); triton: the same with the Triton kernels only; flex: the same with FlexAttention",
        "- memory goal: 1 - dualkv GB / full-batch baseline GB >= 0.8 x (1 - 1/rho); the column is that saving over its goal (>= 1 meets it). "
        "Where the full-batch baseline ran out of memory, its peak is at least the device's memory, and the column is a lower bound (marked >=). "
        "est.: against the full batch's peak estimated from the micro-batched run, weights and gradients once plus mb x the rest (`estimated_full_gb`; 91.0 GB estimated where 89.5 GB was measured)",
        "",
        "| model | batch | rho | baseline ms (mb) | dualkv ms | flex ms | speedup | ideal | of ideal | baseline GB (mb) | baseline GB (full batch) | dualkv GB | memory saved / (0.8 x token share) | dualkv logical tok/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base, dk = r.get("baseline_ms"), r.get("dualkv_ms")
        sp = f"{base / dk:.2f}x" if isinstance(base, float) and isinstance(dk, float) else "-"
        of = f"{base / dk / r['ideal']:.2f}" if sp != "-" else "-"
        fmt = lambda x: f"{x:.1f}" if isinstance(x, float) else "-" if x is None else str(x)  # noqa: E731
        tps = f"{r['tokens_before'] / (dk / 1e3):.0f}" if isinstance(dk, float) else "-"
        mem = memory_goal(r, meta)
        full = fmt(r.get("baseline_full_gb", r.get("baseline_full_ms", "-")))
        est = estimated_full_gb(r, meta)
        if est and "baseline_full_gb" not in r:
            full = f"est. {est:.1f}" if full == "-" else f"{full} (est. {est:.1f})"
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['rho']:.2f} | {fmt(base)} ({r.get('baseline_mb', '-')}) | {fmt(dk)} | {fmt(r.get('flex_ms', '-'))} | {sp} | {r['ideal']:.2f}x | {of} | "
            f"{fmt(r.get('baseline_gb', '-'))} | {full} | {fmt(r.get('dualkv_gb', '-'))} | {mem} | {tps} |"
        )
    failures = [(r, k) for r in rows for k in r if k.endswith("_error")]
    if failures:
        lines += ["", "Failures:", ""]
        lines += [f"- {r['model']} {r['batch']} {k[: -len('_error')]}: `{r[k][:300]}`" for r, k in failures]
    with open(os.path.join(out, "model_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(rows, meta, out)


def parameter_count(cfg: dict, vocab: int = VOCAB) -> int:
    """Parameters of the Qwen3-shaped model ``cfg`` builds (untied embedding and lm_head, q/k RMSNorms)."""
    h, L, hd = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]
    hq, hkv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    per_layer = h * hq * hd + 2 * h * hkv * hd + hq * hd * h + 3 * h * inter + 2 * hd + 2 * h
    return 2 * vocab * h + L * per_layer + h


def _model_config(label: str) -> Optional[dict]:
    """The config behind a row's model label ("qwen3-1.7b", "qwen3-8b (4 layers)")."""
    name = label.split()[0].removeprefix("qwen3-")
    if name not in MODELS:
        return None
    cfg = dict(MODELS[name])
    if "layers)" in label:
        cfg["num_hidden_layers"] = int(label.split("(")[1].split()[0])
    return cfg


def estimated_full_gb(r: dict, meta: dict) -> Optional[float]:
    """The full-batch baseline's peak estimated from its micro-batched run, or None.

    Weights and gradients (bf16: 4 bytes a parameter) are held once; everything
    else the step keeps is per row, and the micro-batches split the rows
    evenly, so the full batch holds ``mb`` times the rest:
    ``static + mb * (peak_mb - static)``. Checked against the one row measured
    both ways (0.6B (8, 1024, 4096): 91.0 GB estimated, 89.5 GB measured)."""
    label = r.get("model", "")
    cfg, mb, gb = _model_config(label) if label else None, r.get("baseline_mb"), r.get("baseline_gb")
    if cfg is None or not isinstance(mb, int) or mb < 2 or not isinstance(gb, float):
        return None
    vocab = TINY_VOCAB if label.startswith("qwen3-tiny") else VOCAB
    param_bytes = 2 if meta.get("dtype") in ("torch.bfloat16", "torch.float16") else 4
    static = parameter_count(cfg, vocab) * 2 * param_bytes / 2**30
    return static + mb * (gb - static)


def memory_goal(r: dict, meta: dict) -> str:
    """Memory saved against the full-batch baseline over the goal's 0.8 x (1 - 1/rho).

    Measured where the full batch ran; '>=' (a bound: its peak is at least the
    device's memory) where it ran out of memory; 'est.' against
    ``estimated_full_gb`` where it was not run, and beside the bound."""
    dgb = r.get("dualkv_gb")
    if not isinstance(dgb, float) or r["rho"] <= 1:
        return "-"
    goal = lambda full: (1 - dgb / full) / (0.8 * (1 - 1 / r["rho"]))  # noqa: E731
    full = r.get("baseline_full_gb")
    if r.get("baseline_mb") == 1 and isinstance(r.get("baseline_gb"), float):
        full = r["baseline_gb"]
    if isinstance(full, float):
        return f"{goal(full):.2f}"
    est = estimated_full_gb(r, meta)
    est_text = f"est. {goal(est):.2f}" if est else ""
    if r.get("baseline_full_ms") == "OOM" and meta.get("device_gb"):
        return f">= {goal(meta['device_gb']):.2f}" + (f" ({est_text})" if est_text else "")
    return est_text or "-"


def merge(paths: list[str]) -> tuple[list[dict], dict]:
    """Rows of several runs' model_gpu.json, one per (model, batch), later runs' columns over earlier ones.

    A baseline measured in one call (mb = 1) where another run measured it in
    micro-batches is kept apart, as the full-batch columns
    (``baseline_full_ms``/``_gb``), so the table shows both."""
    rows: dict = {}
    meta: dict = {}
    dates: list = []
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        meta = {**run["meta"], **meta}  # the earliest run's values where runs differ
        for r in run["rows"]:
            key = (r["model"], r["batch"])
            into = rows.setdefault(key, {})
            r = dict(r)
            full_batch = r.pop("full_batch", False)
            if full_batch or r.get("baseline_mb") == 1 and into.get("baseline_mb", 1) > 1:
                for k in ("ms", "gb"):
                    if f"baseline_{k}" in r:
                        r[f"baseline_full_{k}"] = r.pop(f"baseline_{k}")
                r.pop("baseline_mb", None)
            elif into.get("baseline_mb") == 1 and r.get("baseline_mb", 1) > 1:
                for k in ("ms", "gb"):
                    into[f"baseline_full_{k}"] = into.pop(f"baseline_{k}")
            for v in ("baseline", "dualkv", "flex", "triton"):
                if f"{v}_ms" in r and f"{v}_error" not in r:
                    into.pop(f"{v}_error", None)  # measured now
            into.update(r)
        dates.append(run["meta"].get("date", "?"))
    meta["date"] = ", ".join(sorted(set(dates)))
    return sorted(rows.values(), key=_row_order), meta


def _row_order(r: dict) -> tuple:
    """Models in MODELS' order, then batches in SHAPES' order; unknown ones last, as they came."""
    model = r["model"].split()[0].removeprefix("qwen3-")
    shapes = [str(s) for s in SHAPES]
    return (list(MODELS).index(model) if model in MODELS else len(MODELS),
            shapes.index(r["batch"]) if r["batch"] in shapes else len(shapes))


def plot(rows, meta, out):
    """model_gpu.png: measured speedup next to the ideal one, per row that has both timings (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no model_gpu.png")
        return
    done = [r for r in rows if isinstance(r.get("baseline_ms"), float) and isinstance(r.get("dualkv_ms"), float)]
    if not done:
        return
    labels = [f"{r['model']}\n{r['batch']}\nrho {r['rho']:.2f}" for r in done]
    x = range(len(done))
    fig, ax = plt.subplots(figsize=(max(5, 2.2 * len(done)), 4))
    ax.bar([i - 0.2 for i in x], [r["baseline_ms"] / r["dualkv_ms"] for r in done], 0.4, label="measured speedup")
    ax.bar([i + 0.2 for i in x], [r["ideal"] for r in done], 0.4, label="ideal (FLOP model)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("step time, baseline / dualkv")
    ax.set_title(f"GRPO loss step, {meta['device']}, {meta['dtype'].replace('torch.', '')}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "model_gpu.png"), dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="0.6b,1.7b,8b", help=f"comma-separated, of {sorted(MODELS)}")
    ap.add_argument("--layers-8b", type=int, default=4)
    ap.add_argument("--shapes", action="append", help="N,P,R or 'groups' (repeatable; default: all)")
    ap.add_argument("--variants", default="dualkv,baseline",
                    help="comma-separated, of dualkv, flex, triton (dualkv with the Triton kernels only), baseline")
    ap.add_argument("--baseline-max-tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the script (float32)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="default: benchmarks/results/model_gpu/<device>-<date>/ (benchmarks/harness.py)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="only merge these runs' model_gpu.json (later over earlier) into --out's json/md/png")
    ap.add_argument("--stack-dump-s", type=float, default=0, help="dump every thread's stack to stderr every this many seconds (diagnose a stuck compile)")
    args = ap.parse_args(argv)
    if args.merge:
        rows, meta = merge(args.merge)
        stamp = harness.stamp("model_gpu", device=meta.get("device", "cpu"), script=__file__, argv=argv)
        write(rows, meta, args.out or harness.result_dir(stamp), stamp)
        return 0
    stamp = harness.stamp("model_gpu", device=args.device, script=__file__, argv=argv)
    args.out = args.out or harness.result_dir(stamp)
    if args.stack_dump_s:
        import faulthandler

        faulthandler.dump_traceback_later(args.stack_dump_s, repeat=True)
    for name in args.models.split(","):
        if name not in MODELS:
            ap.error(f"--models: unknown model {name!r}; expected some of {sorted(MODELS)}")
    variants = args.variants.split(",")
    for v in variants:
        if v not in ("dualkv", "flex", "triton", "baseline"):
            ap.error(f"--variants: unknown variant {v!r}; expected some of dualkv, flex, triton, baseline")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    t0 = time.time()
    shapes = [s if s == "groups" else tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    meta = dict(
        device=stamp["device"], torch=stamp["versions"]["torch"], triton=stamp["versions"]["triton"],
        transformers=stamp["versions"]["transformers"], date=stamp["date"],
        device_gb=torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
        layers_8b=args.layers_8b, reps=args.reps, baseline_max_tokens=args.baseline_max_tokens, dtype=str(dtype),
    )
    rows = []
    for name in args.models.split(","):
        cfg = dict(MODELS[name])
        vocab = TINY_VOCAB if name == "tiny" else VOCAB
        if name == "8b":
            cfg["num_hidden_layers"] = args.layers_8b
        label = f"qwen3-{name}" + (f" ({cfg['num_hidden_layers']} layers)" if name == "8b" else "")
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, max_position_embeddings=32768, use_cache=False, attn_implementation="sdpa", **cfg))
        model = model.to(args.device, dtype).train()
        fns = {
            # dynamic=False: one static graph per shape. torch 2.11's Inductor fails on the
            # dynamic-shape recompile of this graph (tiling_utils assertion).
            "baseline": torch.compile(grpo_loss, dynamic=False),
            "dualkv": dualkv_compile.policy_loss(grpo_loss),
            "flex": dualkv_compile.policy_loss(grpo_loss, attention_backend="flex"),
            "triton": dualkv_compile.policy_loss(grpo_loss, attention_backend="triton"),
        }
        for shape in shapes:
            if time.time() - t0 > args.budget_s:
                log(f"budget of {args.budget_s:.0f}s spent; stopping")
                write(rows, meta, args.out, stamp)
                return 0
            batch = make_batch(shape, args.device, vocab=vocab)
            stats = dualkv_compile.detect(batch["input_ids"], batch["attention_mask"]).stats()
            dup, packed = flops(cfg, stats, vocab)
            row = dict(model=label, batch=str(shape), rho=stats.rho, ideal=dup / packed, tokens_before=stats.tokens_before, tokens_after=stats.tokens_after)
            log(f"{label} {shape}: rho {stats.rho:.2f}, ideal {dup / packed:.2f}x")
            for vname in variants:
                try:
                    start = len(dualkv_compile.reports())
                    max_tokens = args.baseline_max_tokens if vname == "baseline" else None
                    ms, gb, n_mb = time_step(fns[vname], model, batch, args.reps, args.device, max_tokens)
                    row[f"{vname}_ms"], row[f"{vname}_gb"] = ms, gb
                    if vname == "baseline":
                        row["baseline_mb"] = n_mb
                    else:
                        new = dualkv_compile.reports()[start:] or dualkv_compile.reports()[-1:]
                        row[f"{vname}_packed"] = any(r.rewritten and r.packed_calls for r in new)
                        if not row[f"{vname}_packed"]:
                            log(f"{label} {shape}: {vname} did NOT run packed: {[str(r) for r in new]}")
                    log(f"{label} {shape} {vname}: {ms:.1f} ms, peak {gb:.1f} GB" + (f", {n_mb} micro-batches" if vname == "baseline" else ""))
                except torch.OutOfMemoryError:
                    row[f"{vname}_ms"] = "OOM"
                    log(f"{label} {shape} {vname}: OOM")
                except Exception as e:  # a benchmark row records the failure and goes on
                    row[f"{vname}_ms"] = type(e).__name__
                    row[f"{vname}_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
                    log(f"{label} {shape} {vname}: FAILED {type(e).__name__}: {str(e)[:500]}")
                finally:
                    model.zero_grad(set_to_none=True)
                    if cuda:
                        torch.cuda.empty_cache()
            rows.append(row)
            write(rows, meta, args.out, stamp)
        # The next model's peaks must not include this one: free it (and what its steps compiled) first.
        del model, fns
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    write(rows, meta, args.out, stamp)
    log(f"done in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
