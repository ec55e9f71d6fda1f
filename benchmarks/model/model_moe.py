"""Whole-model GRPO step on an MoE (a Qwen3-30B-A3B shape, fewer layers): dualkv against Inductor on the duplicated batch.

The model: Hugging Face ``Qwen3MoeForCausalLM`` from a config (random weights, bf16): hidden 2048, 32 query
heads, 4 kv heads, head dim 128, 128 experts, top-8, expert width 768, vocab 151936, ``--layers`` layers
(default 4), the router's load-balancing loss on (``output_router_logits``). The loss: the clipped GRPO
objective, token-mean over response tokens, plus ``router_aux_loss_coef`` times the model's ``aux_loss``.
The batch is veRL's remove-padding layout (``model_remove_padding.make_batch``: the shuffled sequences of
``--groups`` prompts x ``--rollouts`` responses in one row, position ids restarting, no mask). With padding,
the aux loss's sums over tokens are weighted by multiplicity on the packed stream, the mask zeroing padding's
terms. ``@policy_loss`` (dualkv) against ``torch.compile`` (Inductor) of the same function on the same batch,
side by side in one process; median of CUDA-event timings after warm-up, peak memory, and the ideal speedup
from a FLOP model that counts the active experts (top-k of them per token, plus the router).

Accuracy, on a smaller batch (the float32 logits of the large one would not fit twice): the per-token
log-probs of the response tokens (max and mean abs error) and the aux loss, in bf16 through dualkv, through
the plain model under Inductor and in eager mode, each against the plain model in float32. dualkv's bf16
error should be no worse than the plain model's.

Writes ``model_moe.{json,md}`` to ``--out``.

    python benchmarks/model/model_moe.py [--layers 4] [--groups 2] [--rollouts 8] [--prompt 1024] [--response 512]
    python benchmarks/model/model_moe.py --device cpu --model tiny --groups 2 --rollouts 3 --prompt 24 --response 8
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import dualkv_compile  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.model.model_gpu import log, time_step  # noqa: E402
from benchmarks.model.model_remove_padding import clipped_token_mean, make_batch, next_token_logp  # noqa: E402

MODELS = {
    "30b-a3b": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                    num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144, vocab_size=151936),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128, vocab_size=512),
}


def moe_config(name: str, layers: int, **overrides):
    """The ``Qwen3MoeConfig`` of ``MODELS[name]`` with ``layers`` layers, every layer sparse, top-k weights normalised
    (as Qwen3-30B-A3B), SDPA, no cache; ``overrides`` replace any field (``peers.py`` builds its MoE rows from it)."""
    from transformers import Qwen3MoeConfig

    fields = dict(MODELS[name], num_hidden_layers=layers, max_position_embeddings=32768, use_cache=False,
                  attn_implementation="sdpa", router_aux_loss_coef=0.001, decoder_sparse_step=1, norm_topk_prob=True)
    return Qwen3MoeConfig(**{**fields, **overrides})


def _forward(model, batch):
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], output_router_logits=True)


def moe_grpo_loss(model, batch):
    """veRL's remove-padding step (``model_remove_padding``'s objective) plus the router's aux loss."""
    out = _forward(model, batch)
    logp = next_token_logp(out.logits, batch["input_ids"])
    return clipped_token_mean(logp, batch) + model.config.router_aux_loss_coef * out.aux_loss


def logp_and_aux(model, batch):
    """Per-token log-probs of the next tokens (zero off the responses) and the aux loss."""
    out = _forward(model, batch)
    return next_token_logp(out.logits, batch["input_ids"]) * batch["response_mask"][:, 1:], out.aux_loss.float()


def flops(cfg: dict, layers: int, stats) -> tuple[float, float]:
    """fwd+bwd FLOPs of the duplicated and the packed step: matmuls 3x forward (active experts only), attention 3.5x."""
    h, hd, hq, hkv = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    experts = cfg["num_experts_per_tok"] * 3 * h * cfg["moe_intermediate_size"] + h * cfg["num_experts"]
    per_token = layers * (h * hq * hd + 2 * h * hkv * hd + hq * hd * h + experts) + h * cfg["vocab_size"]

    def total(tokens, pairs):
        return 3 * 2 * per_token * tokens + 3.5 * 4 * pairs * hd * hq * layers

    return total(stats.tokens_before, stats.attention_pairs_before), total(stats.tokens_after, stats.attention_pairs_after)


def accuracy(model32, model16, batch) -> dict:
    """bf16 error against the float32 plain model (log-probs, aux loss) of dualkv, the plain model under Inductor
    (the same compiler as dualkv's inner one) and the plain model in eager mode."""
    with torch.no_grad():
        ref_lp, ref_aux = logp_and_aux(model32, batch)
        results = {"plain eager": logp_and_aux(model16, batch)}
        torch._dynamo.reset()
        results["plain Inductor"] = torch.compile(logp_and_aux)(model16, batch)
        torch._dynamo.reset()
        results["dualkv"] = dualkv_compile.policy_loss(logp_and_aux)(model16, batch)
    resp = batch["response_mask"][:, 1:].bool()

    def err(lp, aux):
        e = (lp.float() - ref_lp)[resp].abs()
        return dict(logp_max_abs=float(e.max()), logp_mean_abs=float(e.mean()), aux_rel=float(abs(aux - ref_aux) / abs(ref_aux)))

    return dict(errors={name: err(*r) for name, r in results.items()}, aux_fp32=float(ref_aux))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="30b-a3b", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--response", type=int, default=512, help="longest response; lengths are uniform in [R/2, R]")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--accuracy-seeds", type=int, default=1, help="accuracy batches (seeds 1..N); errors averaged")
    ap.add_argument("--skip-timing", action="store_true", help="the accuracy comparison only")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="default: benchmarks/results/model_moe/<device>-<date>/ (benchmarks/harness.py)")
    args = ap.parse_args(argv)
    args.stamp = harness.stamp("model_moe", device=args.device, script=__file__, argv=argv)
    args.out = args.out or harness.result_dir(args.stamp)

    from transformers import Qwen3MoeForCausalLM

    cfg = MODELS[args.model]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    config = moe_config(args.model, args.layers)
    torch.manual_seed(0)
    model32 = Qwen3MoeForCausalLM(config).to(args.device).train()
    model = copy.deepcopy(model32).to(dtype)
    vocab = cfg["vocab_size"]
    versions = args.stamp["versions"]
    meta = dict(date=args.stamp["date"], device=args.stamp["device"], torch=versions["torch"],
                transformers=versions["transformers"], model=args.model, layers=args.layers,
                experts_implementation=getattr(model.config, "_experts_implementation", None))
    if args.device == "cuda":
        meta["triton"] = versions["triton"]
    os.makedirs(args.out, exist_ok=True)

    if not args.skip_accuracy:
        runs = []
        for seed in range(1, args.accuracy_seeds + 1):
            small = make_batch(2, 4, max(args.prompt // 4, 8), max(args.response // 4, 4), args.device, vocab, seed=seed)
            log(f"accuracy, seed {seed}, on [{small['input_ids'].shape[0]}, {small['input_ids'].shape[1]}]")
            runs.append(accuracy(model32, model, small))
            log(f"accuracy: {runs[-1]}")
        # Routing flips in bf16 make one batch's errors noisy: the mean over the batches is reported.
        errors = {name: {k: sum(r["errors"][name][k] for r in runs) / len(runs) for k in e} for name, e in runs[0]["errors"].items()}
        meta["accuracy"] = dict(errors=errors, seeds=len(runs), per_seed=runs)
    del model32
    if args.device == "cuda":
        torch.cuda.empty_cache()

    if args.skip_timing:
        _write(args, meta, rows=[], B=None, S=None, stats=None)
        return 0
    batch = make_batch(args.groups, args.rollouts, args.prompt, args.response, args.device, vocab)
    stats = dualkv_compile.detect(batch["input_ids"], None, batch["position_ids"], same_columns=False).stats()
    B, S = batch["input_ids"].shape
    log(f"{args.model} x {args.layers} layers: batch [{B}, {S}], {stats}")
    f_dup, f_packed = flops(cfg, args.layers, stats)
    meta.update(batch=[B, S], tokens=stats.tokens_before, tokens_after=stats.tokens_after, rho=stats.rho,
                ideal=f_dup / f_packed)
    rows = []
    for name, fn in (("baseline (Inductor, duplicated batch)", torch.compile(moe_grpo_loss, dynamic=False)),
                     ("dualkv (@policy_loss)", dualkv_compile.policy_loss(moe_grpo_loss))):
        torch._dynamo.reset()
        start = len(dualkv_compile.reports())
        log(f"{name}: compile + warm-up + {args.reps} steps")
        try:
            with torch.no_grad():
                loss = float(fn(model, batch))
            ms, peak, _ = time_step(fn, model, batch, args.reps, args.device)
        except torch.OutOfMemoryError:
            rows.append(dict(variant=name, error="OOM"))
            log(f"{name}: OOM")
            continue
        reports = dualkv_compile.reports()[start:]
        packed = sum(r.packed_calls for r in reports if r.rewritten)
        refused = [r.reason for r in reports if not r.rewritten]
        rows.append(dict(variant=name, ms=ms, peak_gb=peak, loss=loss, packed_calls=packed, refused=refused,
                         tflops=f_dup / ms / 1e9))
        log(f"{name}: {ms:.1f} ms, peak {peak:.1f} GB, loss {loss:.6f}, packed calls {packed}, refused {refused}")
        harness.write_json(os.path.join(args.out, "model_moe.json"), harness.record(args.stamp, meta=meta, rows=rows))
    if all("ms" in r for r in rows):
        meta["speedup"] = rows[0]["ms"] / rows[1]["ms"]
    _write(args, meta, rows, B, S, stats)
    return 0


def _write(args, meta: dict, rows: list, B, S, stats) -> None:
    """``model_moe.{json,md}`` under ``--out``: the timing rows (if any) and the accuracy table (if measured)."""
    harness.write_json(os.path.join(args.out, "model_moe.json"), harness.record(args.stamp, meta=meta, rows=rows))
    lines = [
        f"# MoE GRPO step, Qwen3-{args.model} shape with {args.layers} layers ({meta['device']}, torch {meta['torch']}, "
        f"transformers {meta['transformers']}, triton {meta.get('triton', '-')}, {meta['date']})",
    ]
    if rows:
        lines += [
            "",
            f"Batch [{B}, {S}]: {args.groups} prompts of {args.prompt} tokens x {args.rollouts} responses of "
            f"{args.response // 2}..{args.response} tokens, shuffled, in one row (veRL's remove-padding layout); {stats}. Experts: {meta['experts_implementation']}.",
            "",
            "| variant | step ms | peak GB | loss | packed calls | useful TFLOP/s |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ] + [f"| {r['variant']} | {r['ms']:.1f} | {r['peak_gb']:.1f} | {r['loss']:.6f} | {r['packed_calls']} | {r['tflops']:.0f} |"
             if "ms" in r else f"| {r['variant']} | {r['error']} | | | | |" for r in rows]
    if "speedup" in meta:
        lines += ["", f"Speedup {meta['speedup']:.2f}x; FLOP ideal {meta['ideal']:.2f}x (active experts counted; "
                      f"speedup / ideal {meta['speedup'] / meta['ideal']:.2f})."]
    if "accuracy" in meta:
        a = meta["accuracy"]
        lines += ["", f"bf16 error against the plain model in float32 (response-token log-probs; aux loss, relative), "
                      f"mean over {a['seeds']} accuracy batch(es):",
                  "", "| bf16 run | log-prob max abs err | log-prob mean abs err | aux loss rel err |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {name} | {e['logp_max_abs']:.3e} | {e['logp_mean_abs']:.3e} | {e['aux_rel']:.3e} |" for name, e in a["errors"].items()]
        if a["seeds"] > 1:
            lines += ["", "Per batch (aux loss rel err): " + "; ".join(
                f"seed {i + 1}: " + ", ".join(f"{name} {e['aux_rel']:.2e}" for name, e in r["errors"].items())
                for i, r in enumerate(a["per_seed"]))]
    with open(os.path.join(args.out, "model_moe.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    log("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
