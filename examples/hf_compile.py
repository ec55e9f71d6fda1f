"""Compile an unmodified Hugging Face model with backend="dualkv" and check it against the uncompiled model.

    python examples/hf_compile.py [--family qwen3|llama|qwen2] [--attn sdpa|eager] [--device cuda]

Builds a tiny random-weight causal LM of the chosen family from its config
(no download) and a GRPO-style batch: groups of rows that share a prompt,
prompts left padded to one length, responses of ragged lengths right padded.
Then:

    compiled = torch.compile(model, backend="dualkv")
    logits = compiled(input_ids=ids, attention_mask=mask).logits

and checks, against a copy of the model run uncompiled on the same batch:
the logits at every non-padding position, and every parameter gradient of a
loss that reads all of those logits (a random projection over the vocabulary,
so every logit contributes). Prints the token savings, the differences and
``dualkv_compile.explain()`` for the batch, then ``hf_compile: OK``.

On CPU the inner compiler defaults to "aot_eager" (an Inductor compile takes
minutes on a small CPU); on CUDA to "inductor". The check allows a relative
error of 1e-5 on CPU and 1e-4 on CUDA (float32 throughout; both measure about
1e-7 to 1e-6, on an H100 too).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dualkv_compile  # noqa: E402

FAMILIES = {"qwen3": "Qwen3", "llama": "Llama", "qwen2": "Qwen2"}


def tiny_causal_lm(family: str, attn: str, vocab: int, layers: int, seed: int = 0):
    """A small random-weight ``<Family>ForCausalLM`` built from its config, in training mode."""
    import transformers

    name = FAMILIES[family]
    config = getattr(transformers, f"{name}Config")(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, use_cache=False,
        attn_implementation=attn,
    )
    torch.manual_seed(seed)
    return getattr(transformers, f"{name}ForCausalLM")(config).train()


def grpo_batch(groups, vocab: int, seed: int = 0):
    """Rows [left pad | prompt | response | right pad] for ``groups`` of (prompt length, [response lengths])."""
    g = torch.Generator().manual_seed(seed)
    max_prompt = max(p for p, _ in groups)
    max_response = max(max(rs) for _, rs in groups)
    rows = sum(len(rs) for _, rs in groups)
    ids = torch.zeros(rows, max_prompt + max_response, dtype=torch.long)
    mask = torch.zeros_like(ids)
    b = 0
    for prompt_len, response_lens in groups:
        prompt = torch.randint(1, vocab, (prompt_len,), generator=g)
        for r in response_lens:
            ids[b, max_prompt - prompt_len : max_prompt] = prompt
            ids[b, max_prompt : max_prompt + r] = torch.randint(1, vocab, (r,), generator=g)
            mask[b, max_prompt - prompt_len : max_prompt + r] = 1
            b += 1
    return ids, mask


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=sorted(FAMILIES), default="qwen3")
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa", help="Hugging Face attn_implementation")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--inner", choices=["aot_eager", "inductor"], default=None,
                    help="compiler behind dualkv (default: aot_eager on CPU, inductor on CUDA)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--prompt-lens", default="48,32", help="one prompt per group, comma-separated lengths")
    ap.add_argument("--responses", type=int, default=4, help="responses per prompt (ragged lengths 8..24)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    inner = args.inner or ("inductor" if device.type == "cuda" else "aot_eager")
    tol = 1e-5 if device.type == "cpu" else 1e-4  # CUDA kernels reduce in other orders
    t_start = time.perf_counter()

    g = torch.Generator().manual_seed(1)
    groups = [(int(p), [int(r) for r in torch.randint(8, 25, (args.responses,), generator=g)])
              for p in args.prompt_lens.split(",")]
    ids, mask = (t.to(device) for t in grpo_batch(groups, args.vocab))
    valid = mask.bool()

    model = tiny_causal_lm(args.family, args.attn, args.vocab, args.layers).to(device)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dualkv", options={"inner": inner})

    logits = compiled(input_ids=ids, attention_mask=mask).logits
    ref_logits = reference(input_ids=ids, attention_mask=mask).logits
    logits_err = rel_err(logits[valid], ref_logits[valid])
    logits_max = (logits[valid] - ref_logits[valid]).abs().max().item()

    # A loss that reads every valid logit, so every parameter gets a gradient.
    projection = torch.randn(args.vocab, generator=torch.Generator().manual_seed(2)).to(device)
    (logits[valid] @ projection).sum().backward()
    (ref_logits[valid] @ projection).sum().backward()
    grad_errs = {name: rel_err(p.grad, q.grad)
                 for (name, p), q in zip(model.named_parameters(), reference.parameters())}
    worst = max(grad_errs, key=grad_errs.get)
    grad_max = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    packed = sum(r.packed_calls for r in dualkv_compile.reports() if r.rewritten)

    stats = dualkv_compile.detect(ids, mask).stats()
    print(f"hf_compile: tiny {FAMILIES[args.family]}ForCausalLM ({args.layers} layers, hidden 64, vocab {args.vocab}, "
          f"random weights), attn_implementation={args.attn!r}, {device.type}, dualkv compiler {inner!r}")
    print(f"  batch             {len(groups)} prompts {[p for p, _ in groups]} x {args.responses} responses, "
          f"input_ids {list(ids.shape)}, response lengths {[rs for _, rs in groups]}")
    print(f"  tokens            {stats.tokens_before} -> {stats.tokens_after} (rho {stats.rho:.2f}x), "
          f"attention pairs {stats.attention_pairs_before} -> {stats.attention_pairs_after} ({stats.attention_ratio:.2f}x)")
    print(f"  logits            relative error {logits_err:.1e}, max |diff| {logits_max:.1e} (non-padding positions)")
    print(f"  gradients         worst relative error {grad_errs[worst]:.1e} ({worst}), max |diff| {grad_max:.1e}, "
          f"{len(grad_errs)} parameters")
    print(f"  packed calls      {packed}")
    print()
    print("dualkv_compile.explain(model, input_ids=ids, attention_mask=mask):")
    dualkv_compile.explain(model, input_ids=ids, attention_mask=mask, options={"inner": inner})
    print(f"\ntotal wall time {time.perf_counter() - t_start:.1f} s")
    ok = logits_err <= tol and grad_errs[worst] <= tol and packed > 0
    print("hf_compile: OK" if ok else f"hf_compile: MISMATCH (tolerance {tol:.0e}, packed calls {packed})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
