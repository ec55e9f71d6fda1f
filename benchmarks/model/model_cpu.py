"""A whole model on CPU, side by side: dualkv vs Inductor on the duplicated batch vs eager.

    .venv/bin/python benchmarks/model/model_cpu.py [--loss outside|policy] [--runs 7] [--ragged] [--profile] [--out ...]

A Qwen3-shaped model built from its config with random weights (4 layers,
hidden 256, 4 heads, 2 KV heads, head_dim 64, MLP 768, vocab 4096), one GRPO
group of N=8 responses to a P=512 prompt, R=64 tokens each (``--ragged``:
response lengths spread over [R/2, R], right padded). One step is forward +
backward of ``loss = mean over valid positions of logits @ w`` (w a fixed
random vector), the loss computed outside the compiled model, as a user would.
``--loss policy`` instead compiles the model with a GRPO-style token loss
(mean negative log-prob of the response tokens): dualkv through
``@policy_loss``, Inductor through ``torch.compile`` of the same function.
There the logits stay packed; with the loss outside, dualkv returns them as
``[B, S, V]`` and the loss reads all of them, memory-bound work that packing
does not shrink.

    (a) dualkv    torch.compile(model, backend="dualkv")   (inner Inductor)
    (b) inductor  torch.compile(model) on the duplicated batch
    (c) eager     the model as it is

All three warm up first (compiles), then run interleaved; the median of
``--runs`` steps is reported. The FLOP model (useful work only):
linear layers 2 * linear_params_per_token * tokens * 3 (fwd + bwd, lm_head
included), attention pairs * 4 * head_dim * heads * 3.5 per layer (fwd + bwd);
ideal speedup = FLOPs(duplicated) / FLOPs(packed), tokens and pairs from
``layout.stats()``. ``--profile`` adds a breakdown of the dualkv step.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import dualkv_compile  # noqa: E402
from benchmarks import harness  # noqa: E402



def progress(msg: str) -> None:
    print(f"[model_cpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_model(layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, inter=768, vocab=4096, seed=0):
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=4096, use_cache=False, tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(cfg).train(), cfg


def response_lengths(N, R, ragged):
    """``--ragged``: N lengths spread evenly over [R // 2, R]; else N x R."""
    return [R // 2 + (i * (R - R // 2)) // max(N - 1, 1) for i in range(N)] if ragged else [R] * N


def loss_projection(vocab):
    """The outside loss's fixed projection of the logits (``--loss outside``)."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(1))


def group_batch(P, resp_lens, vocab, seed=0):
    """One group: rows [prompt | response_i | right pad]; returns input_ids, attention_mask."""
    g = torch.Generator().manual_seed(seed)
    S = P + max(resp_lens)
    ids = torch.zeros(len(resp_lens), S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    prompt = torch.randint(1, vocab, (P,), generator=g)
    for b, r in enumerate(resp_lens):
        ids[b, :P] = prompt
        ids[b, P : P + r] = torch.randint(1, vocab, (r,), generator=g)
        mask[b, : P + r] = 1
    return ids, mask


def flops(cfg, tokens, pairs):
    h, D = cfg.hidden_size, cfg.head_dim
    per_layer = h * cfg.num_attention_heads * D * 2 + h * cfg.num_key_value_heads * D * 2 + 3 * h * cfg.intermediate_size
    linear = per_layer * cfg.num_hidden_layers + h * cfg.vocab_size  # lm_head included, embedding is a lookup
    lin = 2 * linear * tokens * 3
    att = pairs * 4 * D * cfg.num_attention_heads * 3.5 * cfg.num_hidden_layers
    return lin + att, lin, att


def step(fn, model, ids, mask, w):
    """``--loss outside``: ``fn`` is the (compiled) model; the loss runs eagerly on its ``[B, S, V]`` logits."""
    out = fn(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    loss = (out[valid] @ w).mean()
    loss.backward()
    return loss.detach()


def token_loss(model, input_ids, attention_mask, response_mask):
    """``--loss policy``: a GRPO-style token loss (mean negative log-prob of the response tokens), model included.

    The argument names are the ones dualkv reads the token inputs by (as in veRL and TRL batches).
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    m = response_mask[:, 1:].float()
    return -(logp * m).sum() / m.sum()


def policy_step(fn, model, ids, mask, resp):
    """``--loss policy``: ``fn`` is ``token_loss``, compiled (or not) as a whole."""
    loss = fn(model, ids, mask, resp)
    loss.backward()
    return loss.detach()


def grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


CLOCK = time.perf_counter
STEP_DOC = {
    "outside": "mean(logits[valid] @ w), the loss outside the compiled model (its [B, S, V] logits unpacked)",
    "policy": "a GRPO-style token loss (mean negative log-prob of the response tokens) compiled with the model "
    "(dualkv: @policy_loss; inductor: torch.compile of the same function)",
}
TITLE = {"outside": "", "policy": ", model and loss compiled together"}


def timed(step_fn, fn, model, ids, mask, w):
    model.zero_grad(set_to_none=True)
    t0 = CLOCK()
    step_fn(fn, model, ids, mask, w)
    return (CLOCK() - t0) * 1e3


def profile_dualkv(step_fn, fn, model, ids, mask, w, cfg, layout):
    """Where the dualkv step's time goes: torch.profiler top ops, and the pieces timed alone."""
    lines = []
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step_fn(fn, model, ids, mask, w)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60)
    lines.append("torch.profiler, dualkv step, top ops by self CPU time:\n\n```\n" + table + "\n```")

    def best(f, n=5):
        ts = []
        for _ in range(n):
            t0 = CLOCK()
            f()
            ts.append((CLOCK() - t0) * 1e3)
        return statistics.median(ts)

    t_detect = best(lambda: dualkv_compile.detect(ids, mask))
    T, H, Hkv, D = layout.num_tokens, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, T, D, generator=g, requires_grad=True)
    k = torch.randn(1, Hkv, T, D, generator=g, requires_grad=True)
    v = torch.randn(1, Hkv, T, D, generator=g, requires_grad=True)

    def ref_fb():
        out = dualkv_compile.shared_prompt_attention(q, k, v, layout, backend="reference")
        out.sum().backward()

    t_ref = best(ref_fb)
    t_mask = best(lambda: layout.dense_mask())
    B, S = ids.shape
    qd = torch.randn(B, H, S, D, generator=g, requires_grad=True)
    kd = torch.randn(B, H, S, D, generator=g, requires_grad=True)
    vd = torch.randn(B, H, S, D, generator=g, requires_grad=True)
    am = mask.bool()[:, None, None, :] & torch.ones(S, S, dtype=torch.bool).tril()[None, None]

    def sdpa_fb():
        torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=am).sum().backward()

    t_sdpa = best(sdpa_fb)
    dm = layout.dense_mask()
    rep = H // Hkv

    def sdpa_packed_fb():  # the same exact attention through SDPA with the dense [T,T] mask
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=dm
        )
        o.sum().backward()

    t_sdpa_packed = best(sdpa_packed_fb)
    L = cfg.num_hidden_layers
    lines.append(
        "Pieces, timed alone (median of 5):\n\n"
        f"| piece | ms | x{L} layers |\n|---|---:|---:|\n"
        f"| layout detect (once per step) | {t_detect:.2f} | - |\n"
        f"| dense [T,T] mask build (T={T}) | {t_mask:.2f} | {t_mask * L * 2:.1f} (fwd+bwd) |\n"
        f"| reference attention fwd+bwd, packed T={T} | {t_ref:.1f} | {t_ref * L:.1f} |\n"
        f"| SDPA fwd+bwd, packed T={T} with the dense layout mask (alternative CPU path) | {t_sdpa_packed:.1f} | {t_sdpa_packed * L:.1f} |\n"
        f"| SDPA fwd+bwd, duplicated [{B},{H},{S},{D}] with mask (what inductor/eager run) | {t_sdpa:.1f} | {t_sdpa * L:.1f} |\n"
    )
    return "\n\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--N", type=int, default=8)
    ap.add_argument("--P", type=int, default=512)
    ap.add_argument("--R", type=int, default=64)
    ap.add_argument("--ragged", action="store_true", help="response lengths spread over [R/2, R]")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: process CPU time (robust on a shared machine; use with --threads 1)")
    ap.add_argument("--loss", choices=["outside", "policy"], default="outside",
                    help="outside: compile the model, loss eagerly on its logits; policy: model + token loss compiled "
                    "together (dualkv through @policy_loss, the logits stay packed)")
    ap.add_argument("--out", default=None, help="the report's path, its record beside it (.json); default: "
                    "benchmarks/results/model_cpu/cpu-<date>/model_cpu.md (--loss outside), model_cpu_policy_loss.md "
                    "(--loss policy)")
    args = ap.parse_args()
    stamp = harness.stamp("model_cpu", device="cpu", script=__file__)
    if args.out is None:
        args.out = os.path.join(harness.result_dir(stamp), "model_cpu.md" if args.loss == "outside" else "model_cpu_policy_loss.md")
    logging.getLogger("dualkv_compile").setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter

    model, cfg = build_model()
    lens = response_lengths(args.N, args.R, args.ragged)
    ids, mask = group_batch(args.P, lens, cfg.vocab_size)
    layout = dualkv_compile.detect(ids, mask)
    st = layout.stats()
    progress(f"batch {list(ids.shape)}: {st}")
    w = loss_projection(cfg.vocab_size)

    models = {"dualkv": model, "inductor": copy.deepcopy(model), "eager": copy.deepcopy(model)}
    if args.loss == "outside":
        step_fn = step
        fns = {
            "dualkv": torch.compile(models["dualkv"], backend="dualkv"),
            "inductor": torch.compile(models["inductor"]),
            "eager": models["eager"],
        }
    else:
        # The response positions are the loss's fourth argument in place of w.
        step_fn, w = policy_step, mask * (torch.arange(mask.shape[1]) >= args.P)
        fns = {"dualkv": dualkv_compile.policy_loss(token_loss), "inductor": torch.compile(token_loss), "eager": token_loss}
    start_reports = len(dualkv_compile.reports())

    # Warm-up (compiles); the first step's loss and gradients are compared.
    first = {}
    compile_s = {}
    for name in fns:
        t0 = time.perf_counter()
        for i in range(args.warmup):
            models[name].zero_grad(set_to_none=True)
            loss = step_fn(fns[name], models[name], ids, mask, w)
            if i == 0:
                first[name] = (loss, grads(models[name]))
                compile_s[name] = time.perf_counter() - t0
            progress(f"warm-up {name} {i + 1}/{args.warmup} ({time.perf_counter() - t0:.1f} s)")
    reps = dualkv_compile.reports()[start_reports:]
    rewritten = [r for r in reps if r.rewritten]
    if not rewritten or not any(r.packed_calls for r in rewritten):
        progress("WARNING: dualkv did not run packed: " + "; ".join(str(r) for r in reps))

    times = {n: [] for n in fns}
    for i in range(args.runs):
        for name in fns:
            times[name].append(timed(step_fn, fns[name], models[name], ids, mask, w))
        progress(f"run {i + 1}/{args.runs}: " + ", ".join(f"{n} {times[n][-1]:.0f} ms" for n in fns))
    med = {n: statistics.median(t) for n, t in times.items()}
    best_ms = {n: min(t) for n, t in times.items()}

    f_dup, lin_dup, att_dup = flops(cfg, st.tokens_before, st.attention_pairs_before)
    f_pk, lin_pk, att_pk = flops(cfg, st.tokens_after, st.attention_pairs_after)
    ideal = f_dup / f_pk
    speedup = med["inductor"] / med["dualkv"]
    loss_diff = (first["dualkv"][0] - first["inductor"][0]).abs().item()
    grad_diff = max((a - b).abs().max().item() for a, b in zip(first["dualkv"][1], first["inductor"][1]))
    grad_rel = max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(first["dualkv"][1], first["inductor"][1]))

    info = (
        "\n".join(harness.markdown_stamp(stamp)) + "\n"
        f"- machine: processor {platform.processor() or '?'!r}, {platform.machine()}, {os.cpu_count()} cores, "
        f"torch threads {torch.get_num_threads()}\n"
        f"- model: Qwen3 config, random weights, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"heads {cfg.num_attention_heads}/{cfg.num_key_value_heads} kv, head_dim {cfg.head_dim}, "
        f"MLP {cfg.intermediate_size}, vocab {cfg.vocab_size}, fp32\n"
        f"- batch: N={args.N}, P={args.P}, R={args.R}{' ragged ' + str(lens) if args.ragged else ''}; {st}\n"
        f"- step: forward + backward of {STEP_DOC[args.loss]}; median of {args.runs} interleaved runs after "
        f"{args.warmup} warm-up steps; clock: {'process CPU time' if args.clock == 'cpu' else 'wall'}"
    )
    table = (
        "| variant | ms / step (median) | min | first step (compile) s |\n|---|---:|---:|---:|\n"
        + "".join(f"| {n} | {med[n]:.1f} | {best_ms[n]:.1f} | {compile_s[n]:.1f} |\n" for n in fns)
    )
    summary = (
        f"- speedup dualkv over inductor-duplicated: **{speedup:.2f}x**; dualkv over eager: {med['eager'] / med['dualkv']:.2f}x\n"
        f"- FLOP model: duplicated {f_dup / 1e9:.1f} GFLOP (linear {lin_dup / 1e9:.1f}, attention {att_dup / 1e9:.1f}), "
        f"packed {f_pk / 1e9:.1f} GFLOP (linear {lin_pk / 1e9:.1f}, attention {att_pk / 1e9:.1f})\n"
        f"- ideal speedup {ideal:.2f}x; achieved {speedup / ideal:.2f} of ideal (target >= 0.7); "
        f"with min times: {best_ms['inductor'] / best_ms['dualkv']:.2f}x, {best_ms['inductor'] / best_ms['dualkv'] / ideal:.2f} of ideal\n"
        f"- achieved GFLOP/s (useful): dualkv {f_pk / med['dualkv'] / 1e6:.1f}, inductor {f_dup / med['inductor'] / 1e6:.1f}, "
        f"eager {f_dup / med['eager'] / 1e6:.1f}\n"
        f"- dualkv vs inductor-duplicated, first step: |loss diff| {loss_diff:.3e} (loss {first['inductor'][0].item():.6f}), "
        f"max |grad diff| {grad_diff:.3e}, max norm-wise relative grad diff {grad_rel:.3e}\n"
        f"- dualkv graphs: " + "; ".join(str(r).replace("\n", " /") for r in reps)
    )
    text = f"# Whole model on CPU: dualkv vs Inductor (duplicated batch) vs eager{TITLE[args.loss]}\n\n" + info + "\n\n" + table + "\n" + summary + "\n"
    if args.profile:
        progress("profiling the dualkv step")
        text += "\n## Where the dualkv step's time goes\n\n" + profile_dualkv(step_fn, fns["dualkv"], models["dualkv"], ids, mask, w, cfg, layout) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        rows = [dict(variant=n, ms_median=med[n], ms_min=best_ms[n], first_step_s=compile_s[n]) for n in fns]
        harness.write_json(os.path.splitext(args.out)[0] + ".json", harness.record(
            stamp, meta=dict(loss=args.loss, N=args.N, P=args.P, R=args.R, ragged=args.ragged, runs=args.runs,
                             warmup=args.warmup, clock=args.clock, threads=torch.get_num_threads()),
            rows=rows, results=dict(speedup=speedup, ideal=ideal, loss_diff=loss_diff, grad_diff=grad_diff,
                                    grad_rel=grad_rel, flops_duplicated=f_dup, flops_packed=f_pk)))
        progress(f"wrote {args.out}")


if __name__ == "__main__":
    main()
