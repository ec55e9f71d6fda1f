"""Peak memory of a GRPO loss step on CPU: @policy_loss against the same loss undecorated.

With a vocabulary large enough to dominate (32K), the undecorated loss builds
[B, S, V] logits and log-probs; the decorated one builds [T, V] on the packed
stream and unpacks only per-token scalars.

``--entropy`` adds an entropy bonus (``-(logp.exp() * logp).sum(-1)`` over the
same log-probs, as ``tests/helpers.with_entropy_and_kl`` writes it) and writes
``loss_memory_cpu_entropy.md`` instead.

CPU has no allocator statistics, so each variant runs in a fresh subprocess
and reports its peak resident set size (``ru_maxrss``): first after a warm-up
step on a smaller batch (imports, model, and for dualkv the compilation, with
dynamic shapes so the measured step reuses it), then after the measured step.
The step's own peak is the increase over the warm-up peak.

    python benchmarks/model/loss_memory_cpu.py [--vocab 32768] [--N 8] [--P 256] [--R 64] [--entropy]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from benchmarks import harness  # noqa: E402


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def grpo_loss_with_entropy(model, batch, clip=0.2, ent_coef=0.01):
    """``examples.grpo_tiny.grpo_loss`` plus an entropy bonus read from the same log-probs."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    token_logp = logp.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    ratio = torch.exp(token_logp - batch["old_logp"])
    adv = batch["advantages"][:, None]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv) - ent_coef * entropy
    mask = batch["response_mask"][:, 1:].float()
    return (per_token * mask).sum() / mask.sum()


def run_variant(args) -> dict:
    import dualkv_compile
    from examples.grpo_tiny import grpo_loss
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.set_num_threads(2)
    cfg = Qwen3Config(
        vocab_size=args.vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, use_cache=False, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    loss_fn = grpo_loss_with_entropy if args.entropy else grpo_loss
    if args.variant == "dualkv":
        loss_fn = dualkv_compile.policy_loss(loss_fn, inner="aot_eager", dynamic=True)

    def batch(N, P, R, seed):
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(2, args.vocab, (P,), generator=g)
        ids = torch.cat([prompt.expand(N, P), torch.randint(2, args.vocab, (N, R), generator=g)], 1)
        mask = torch.ones_like(ids)
        resp = torch.zeros_like(ids)
        resp[:, P:] = 1
        return {
            "input_ids": ids, "attention_mask": mask, "response_mask": resp,
            "old_logp": torch.full((N, P + R - 1), -10.0), "advantages": torch.randn(N, generator=g),
        }

    loss_fn(model, batch(args.N // 2, args.P // 4, args.R // 2, 1)).backward()  # warm-up (and compile)
    model.zero_grad(set_to_none=True)
    warm = _rss_mb()
    loss = loss_fn(model, batch(args.N, args.P, args.R, 2))
    loss.backward()
    out = {"variant": args.variant, "warmup_peak_mb": warm, "step_peak_mb": _rss_mb(), "loss": loss.item()}
    if args.variant == "dualkv":
        report = dualkv_compile.reports()[-1]
        out["fused"] = f"{report.fused_log_probs} fused, {getattr(report, 'fused_entropy', 0)} with entropy"
    return out


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--N", type=int, default=8)
    ap.add_argument("--P", type=int, default=256)
    ap.add_argument("--R", type=int, default=64)
    ap.add_argument("--entropy", action="store_true", help="add an entropy bonus to the loss")
    ap.add_argument("--variant", choices=["dualkv", "undecorated"])
    ap.add_argument("--out", default=None,
                    help="default: benchmarks/results/loss_memory_cpu/cpu-<date>/ (benchmarks/harness.py)")
    args = ap.parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return 0

    results = {}
    for variant in ("undecorated", "dualkv"):
        print(f"[loss_memory] running {variant} in a fresh process ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--variant", variant, "--vocab", str(args.vocab), "--N", str(args.N), "--P", str(args.P), "--R", str(args.R)]
        cmd += ["--entropy"] if args.entropy else []
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        results[variant] = json.loads(out)
    N, P, R, V = args.N, args.P, args.R, args.vocab
    dup, packed = N * (P + R), P + N * R
    stamp = harness.stamp("loss_memory_cpu", device="cpu", script=__file__, argv=argv)
    args.out = args.out or harness.result_dir(stamp)
    lines = [
        "# Peak memory of a GRPO loss step on CPU: @policy_loss vs undecorated" + (" (with an entropy bonus)" if args.entropy else ""),
        "",
        f"- commit {_commit()}",
        *harness.markdown_stamp(stamp),
        f"- tiny Qwen3 (2 layers, hidden 128), vocab {V}, fp32; one group N={N}, P={P}, R={R}: "
        f"{dup} tokens duplicated, {packed} packed (rho {dup / packed:.2f}x)",
        f"- one [tokens, V] fp32 tensor: {dup * V * 4 / 2**20:.0f} MB duplicated, {packed * V * 4 / 2**20:.0f} MB packed",
        "- peak RSS per fresh process; the step's peak is its increase over the warm-up peak",
        "",
        "| variant | warm-up peak MB | step peak MB | step increase MB | loss |",
        "|---|---:|---:|---:|---:|",
    ]
    if "fused" in results["dualkv"]:
        lines.insert(lines.index("") + 1, f"- dualkv's graph report: {results['dualkv']['fused']} (chunked lm_head -> log-probs)")
    for v, r in results.items():
        lines.append(f"| {v} | {r['warmup_peak_mb']:.0f} | {r['step_peak_mb']:.0f} | {r['step_peak_mb'] - r['warmup_peak_mb']:.0f} | {r['loss']:.6f} |")
    inc = {v: r["step_peak_mb"] - r["warmup_peak_mb"] for v, r in results.items()}
    lines += ["", f"- step memory ratio undecorated / dualkv: {inc['undecorated'] / max(inc['dualkv'], 1):.2f}x (token reduction {dup / packed:.2f}x)"]
    text = "\n".join(lines) + "\n"
    print(text)
    stem = "loss_memory_cpu_entropy" if args.entropy else "loss_memory_cpu"
    harness.write_json(os.path.join(args.out, stem + ".json"), harness.record(
        stamp, meta=dict(vocab=V, N=N, P=P, R=R, entropy=args.entropy, commit=_commit()), rows=list(results.values()),
        results=dict(step_memory_ratio=inc["undecorated"] / max(inc["dualkv"], 1), token_reduction=dup / packed)))
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
