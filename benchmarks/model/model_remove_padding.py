"""Whole-model GRPO step on a remove-padding batch (veRL's default layout): dualkv against the same model without it.

veRL's actor packs a micro-batch's valid tokens into one row: ``input_ids``
``[1, total]``, ``position_ids`` restarting at each sequence, no attention
mask; transformers derives the block-diagonal causal mask from the position
ids. The rows are shuffled (veRL balances them across ranks). The speedup is
against the strongest baseline a veRL user can run on that batch: the sequences
through torch's varlen flash attention (``varlen_attention.py``, standing in for
FlashAttention-2's varlen call), the log-probs from the lm_head in chunks, the
rest under Inductor. Beside it, labelled: the same row through dualkv with nothing
shared (its kernel and chunked log-probs), and Inductor with the model's SDPA
attention on the dense block-diagonal mask (``--skip-weak`` leaves that one out).
dualkv runs the same loss through ``@policy_loss``: it finds the prompts the
sequences share, in any order, and computes each once.

Reports step time (median of CUDA events after warm-up), speedup, the ideal
speedup from the FLOP model of ``model_gpu.py``, peak memory, and the loss of
both (they must agree). Writes ``model_remove_padding.{json,md}`` to ``--out``.

    python benchmarks/model/model_remove_padding.py --model 1.7b --groups 4 --rollouts 8 --prompt 1024 --response 512
    python benchmarks/model/model_remove_padding.py --device cpu --model tiny --groups 2 --rollouts 3 --prompt 24 --response 8
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import dualkv_compile  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.model.model_gpu import MODELS, TINY_VOCAB, VOCAB, flops, log, time_step  # noqa: E402
from benchmarks.ops import varlen_attention  # noqa: E402  (registers torch_varlen)

STRONGEST = f"remove padding, {varlen_attention.kernel_name()}, chunked log-probs (Inductor)"


def next_token_logp(logits, input_ids):
    """Log-prob of each next token within the row, in float32: ``[1, T - 1]``."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def clipped_token_mean(logp, batch):
    """The clipped GRPO objective, token-mean over response tokens (veRL's dual-clip off)."""
    ratio = torch.exp(logp - batch["old_logp"])
    adv = batch["advantages"][:, 1:]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    # The response mask is zero at every sequence's first token (a prompt token), so the pairs that
    # cross from one packed sequence into the next never count.
    mask = batch["response_mask"][:, 1:].float()
    return (per_token * mask).sum() / mask.sum()


def remove_padding_loss(model, batch):
    """The clipped GRPO objective on one packed row (next token within the row)."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    return clipped_token_mean(next_token_logp(logits, batch["input_ids"]), batch)


def chunked_next_token_logp(hidden, head, input_ids, chunk_tokens=4096):
    """``next_token_logp`` from the lm_head in chunks of ``chunk_tokens`` rows, each chunk's logits recomputed in the
    backward (``torch.utils.checkpoint``): no ``[T, V]`` tensor kept, as Liger's fused linear cross-entropy or
    veRL's fused kernels do. ``hidden`` ``[1, T, H]``; returns ``[1, T - 1]``."""
    h, labels = hidden[0, :-1], input_ids[0, 1:]

    def piece(h_chunk, labels_chunk):
        logp = torch.log_softmax(head(h_chunk).float(), dim=-1)
        return logp.gather(-1, labels_chunk.unsqueeze(-1)).squeeze(-1)

    parts = [torch.utils.checkpoint.checkpoint(piece, h[i : i + chunk_tokens], labels[i : i + chunk_tokens], use_reentrant=False)
             for i in range(0, h.shape[0], chunk_tokens)]
    return torch.cat(parts)[None]


def varlen_loss(model, batch):
    """The strongest baseline's step: the row's sequences through torch's varlen flash attention (``torch_varlen``,
    given FlashAttention's ``cu_seq_lens`` as veRL passes them), chunked log-probs, the same objective."""
    hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                         cu_seq_lens_q=batch["cu_seqlens"], cu_seq_lens_k=batch["cu_seqlens"],
                         max_length_q=batch["max_len"], max_length_k=batch["max_len"]).last_hidden_state
    return clipped_token_mean(chunked_next_token_logp(hidden, model.lm_head, batch["input_ids"]), batch)


def make_batch(groups, rollouts, prompt, response, device, vocab, seed=0):
    """Shuffled sequences [prompt | response] of ``groups`` prompts x ``rollouts`` responses, packed into one row."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(groups):
        p = torch.randint(2, vocab, (prompt,), generator=g)
        adv = float(torch.randn((), generator=g))
        for _ in range(rollouts):
            r = int(torch.randint(response // 2, response + 1, (), generator=g))
            seqs.append((p, torch.randint(2, vocab, (r,), generator=g), adv))
    order = torch.randperm(len(seqs), generator=g).tolist()
    ids, pos, resp, advs = [], [], [], []
    for i in order:
        p, r, a = seqs[i]
        ids.append(torch.cat([p, r]))
        pos.append(torch.arange(len(p) + len(r)))
        resp.append(torch.cat([torch.zeros(len(p)), torch.ones(len(r))]))
        advs.append(torch.full((len(p) + len(r),), a))
    T = sum(len(x) for x in ids)
    lens = torch.tensor([len(x) for x in ids])
    batch = {
        "input_ids": torch.cat(ids)[None], "position_ids": torch.cat(pos)[None],
        "response_mask": torch.cat(resp)[None], "advantages": torch.cat(advs)[None],
        "old_logp": torch.full((1, T - 1), -11.9),
        "cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32),
    }
    return {**{k: v.to(device) for k, v in batch.items()}, "max_len": int(lens.max())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1.7b", choices=sorted(MODELS))
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--response", type=int, default=512, help="longest response; lengths are uniform in [R/2, R]")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--skip-weak", action="store_true", help="leave out the dense-mask SDPA baseline (its [T, T] mask is large)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="default: benchmarks/results/model_remove_padding/<device>-<date>/ (benchmarks/harness.py)")
    args = ap.parse_args(argv)
    stamp = harness.stamp("model_remove_padding", device=args.device, script=__file__, argv=argv)
    args.out = args.out or harness.result_dir(stamp)

    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = MODELS[args.model]
    vocab = TINY_VOCAB if args.model == "tiny" else VOCAB
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, max_position_embeddings=32768, use_cache=False, attn_implementation="sdpa", **cfg))
    model = model.to(device=args.device, dtype=dtype).train()
    batch = make_batch(args.groups, args.rollouts, args.prompt, args.response, args.device, vocab)
    T = batch["input_ids"].shape[1]
    stats = dualkv_compile.detect(batch["input_ids"], None, batch["position_ids"], same_columns=False).stats()
    log(f"{args.model}: one row of {T} tokens, {stats}")
    flops_dup, flops_packed = flops(cfg, stats, vocab)

    rows = []
    # The first is the strongest baseline, the one the speedup is against; the others are labelled as what they are.
    variants = {
        STRONGEST: ("torch_varlen", torch.compile(varlen_loss, dynamic=False)),
        "remove padding, dualkv's kernel and chunked log-probs, nothing shared": (
            "sdpa", dualkv_compile.policy_loss(remove_padding_loss, min_shared=10**9, min_rho=1.0)),
        "Inductor, SDPA with the block-diagonal mask (weaker)": ("sdpa", torch.compile(remove_padding_loss, dynamic=False)),
        "dualkv (@policy_loss)": ("sdpa", dualkv_compile.policy_loss(remove_padding_loss)),
    }
    if args.skip_weak:
        del variants["Inductor, SDPA with the block-diagonal mask (weaker)"]
    losses = {}
    for name, (attn, fn) in variants.items():
        model.config._attn_implementation = attn
        torch._dynamo.reset()
        start = len(dualkv_compile.reports())
        log(f"{name}: compile + warm-up + {args.reps} steps")
        with torch.no_grad():
            losses[name] = float(fn(model, batch))
        ms, peak, _ = time_step(fn, model, batch, args.reps, args.device)
        reports = dualkv_compile.reports()[start:]
        packed = sum(r.packed_calls for r in reports if r.rewritten)
        rows.append(dict(variant=name, ms=ms, peak_gb=peak, loss=losses[name], packed_calls=packed))
        log(f"{name}: {ms:.1f} ms, peak {peak:.1f} GB, loss {losses[name]:.6f}, packed calls {packed}")
    model.config._attn_implementation = "sdpa"
    base, dk = rows[0]["ms"], rows[-1]["ms"]
    meta = dict(
        date=stamp["date"], device=stamp["device"], torch=stamp["versions"]["torch"],
        transformers=stamp["versions"]["transformers"],
        triton=stamp["versions"]["triton"] if args.device == "cuda" else "-",
        model=args.model, tokens=T, sequences=stats.num_sequences, tokens_after=stats.tokens_after, rho=stats.rho,
        depth=stats.depth, speedup=base / dk, ideal=flops_dup / flops_packed,
    )
    os.makedirs(args.out, exist_ok=True)
    harness.write_json(os.path.join(args.out, "model_remove_padding.json"), harness.record(stamp, meta=meta, rows=rows))
    lines = [
        f"# Remove-padding GRPO step, Qwen3-{args.model} shape ({meta['device']}, torch {meta['torch']}, "
        f"transformers {meta['transformers']}, triton {meta['triton']}, {meta['date']})",
        "",
        f"One row of {T} tokens: {args.groups} prompts of {args.prompt} tokens x {args.rollouts} responses of "
        f"{args.response // 2}..{args.response} tokens, shuffled; {stats}.",
        "",
        "| variant | step ms | peak GB | loss | packed calls |",
        "| --- | ---: | ---: | ---: | ---: |",
    ] + [f"| {r['variant']} | {r['ms']:.1f} | {r['peak_gb']:.1f} | {r['loss']:.6f} | {r['packed_calls']} |" for r in rows] + [
        "",
        f"Speedup against the strongest baseline ({STRONGEST}) {meta['speedup']:.2f}x; FLOP ideal {meta['ideal']:.2f}x "
        f"(speedup / ideal {meta['speedup'] / meta['ideal']:.2f}). Against each: "
        + ", ".join(f"{r['variant']}: {r['ms'] / dk:.2f}x" for r in rows[:-1]) + ".",
    ]
    with open(os.path.join(args.out, "model_remove_padding.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    log("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
