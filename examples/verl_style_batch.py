"""A GRPO batch laid out the way veRL and TRL lay it out, through ``@policy_loss``.

    python examples/verl_style_batch.py [--prompts 2] [--rollouts 4] [--device cuda]

veRL's rollout hands the actor a batch of this shape (TRL's GRPOTrainer builds
the same one, but without position_ids):

    prompts         [B, max_prompt_length]     left padded
    responses       [B, max_response_length]   right padded after EOS
    input_ids       cat([prompts, responses], dim=1)
    attention_mask  cat([prompt_mask, response_mask], dim=1)
    position_ids    clamp(cumsum(attention_mask, -1) - 1, min=0)   (veRL's compute_position_id_with_mask)
    response_mask   [B, max_response_length]   1 on response tokens

with the N rows of a group repeated from one prompt (repeat_interleave). The
actor's loss slices the response columns out of the logits
(``logits[:, -R - 1 : -1]``), takes the log-probs of ``responses``, and
aggregates veRL's clipped objective (dual-clip off) with ``response_mask``
("token-mean"). This script writes that loss as veRL writes it, decorates it
with ``@dualkv_compile.policy_loss`` and checks the loss and every parameter
gradient against the same function run undecorated (uncompiled, duplicated
batch). It prints the batch's layout (groups, prompt and response lengths,
tokens and attention pairs before and after packing), the differences and
what the backend did, then ``verl_style_batch: OK``.

A tiny random-weight Qwen3 (built from its config, no download); responses
are random tokens with ragged lengths, since only the layout matters here.

The model runs packed (each prompt once), and veRL's position_ids are taken
as they are. In this loss form the rewrite unpacks the logits to [B, S, V]
before the slice: exact, but without the memory saving that the form
``logits[:, :-1]`` gathered with ``input_ids[:, 1:]`` gets (see grpo_tiny.py).
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

PAD, EOS = 0, 1


def tiny_qwen3(vocab: int, layers: int, seed: int = 0):
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(config).train()


def verl_style_batch(num_prompts: int, rollouts: int, max_prompt_length: int, max_response_length: int, vocab: int,
                     seed: int = 0) -> dict:
    """The actor batch veRL builds after a GRPO rollout (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    # Tokenised prompts, left padded to max_prompt_length (the tokenizer's padding_side="left").
    prompts = torch.full((num_prompts, max_prompt_length), PAD)
    prompt_mask = torch.zeros(num_prompts, max_prompt_length, dtype=torch.long)
    for i in range(num_prompts):
        n = int(torch.randint(max_prompt_length // 2, max_prompt_length + 1, (1,), generator=g))
        prompts[i, -n:] = torch.randint(2, vocab, (n,), generator=g)
        prompt_mask[i, -n:] = 1
    # Each prompt repeated for its group's rollouts (veRL: batch.repeat(n, interleave=True)).
    prompts, prompt_mask = prompts.repeat_interleave(rollouts, 0), prompt_mask.repeat_interleave(rollouts, 0)
    B = prompts.shape[0]
    # Sampled responses: EOS at a random place, PAD after it (right padding to max_response_length).
    responses = torch.randint(2, vocab, (B, max_response_length), generator=g)
    lengths = torch.randint(max_response_length // 4, max_response_length + 1, (B,), generator=g)
    col = torch.arange(max_response_length)
    responses[col[None] == (lengths[:, None] - 1)] = EOS
    response_mask = (col[None] < lengths[:, None]).long()  # veRL's get_response_mask: up to and including EOS
    responses = responses.masked_fill(response_mask == 0, PAD)

    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=-1) - 1, min=0)  # compute_position_id_with_mask
    # GRPO: a scalar reward per response, normalised within its group, broadcast over the response tokens.
    scores = torch.rand(num_prompts, rollouts, generator=g)
    advantages = ((scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6)).flatten()
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "advantages": advantages[:, None] * response_mask,
        "old_log_probs": -torch.rand(B, max_response_length, generator=g) * response_mask - 5.0,
    }


def actor_loss(model, batch, clip_ratio=0.2, temperature=1.0):
    """veRL's actor update for one micro-batch: response log-probs, clipped PPO/GRPO objective, token-mean."""
    response_length = batch["responses"].shape[1]
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits
    logits = logits[:, -response_length - 1 : -1, :] / temperature
    log_prob = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(log_prob - batch["old_log_probs"])
    pg_losses = -batch["advantages"] * ratio
    pg_losses_clipped = -batch["advantages"] * torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
    pg_losses = torch.maximum(pg_losses, pg_losses_clipped)
    mask = batch["response_mask"].float()
    return (pg_losses * mask).sum() / mask.sum()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--max-prompt-length", type=int, default=64)
    ap.add_argument("--max-response-length", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--inner", choices=["aot_eager", "inductor"], default=None,
                    help="compiler behind dualkv (default: aot_eager on CPU, inductor on CUDA)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    inner = args.inner or ("inductor" if device.type == "cuda" else "aot_eager")
    tol = 1e-5 if device.type == "cpu" else 1e-4  # CUDA kernels reduce in other orders
    t_start = time.perf_counter()

    batch = verl_style_batch(args.prompts, args.rollouts, args.max_prompt_length, args.max_response_length, args.vocab)
    batch = {k: v.to(device) for k, v in batch.items()}
    model = tiny_qwen3(args.vocab, args.layers).to(device)
    reference = copy.deepcopy(model)
    loss_fn = dualkv_compile.policy_loss(actor_loss, inner=inner)

    first_report = len(dualkv_compile.reports())
    loss = loss_fn(model, batch)
    loss.backward()
    ref_loss = actor_loss(reference, batch)
    ref_loss.backward()
    loss_diff = abs(loss.item() - ref_loss.item())
    grad_errs = {name: rel_err(p.grad, q.grad) for (name, p), q in zip(model.named_parameters(), reference.parameters())}
    worst = max(grad_errs, key=grad_errs.get)
    grad_max = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    reports = dualkv_compile.reports()[first_report:]
    packed = sum(r.packed_calls for r in reports if r.rewritten)

    layout = dualkv_compile.detect(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    stats = layout.stats()
    prompt_lens = batch["attention_mask"][:, : args.max_prompt_length].sum(1).tolist()
    response_lens = batch["response_mask"].sum(1).tolist()
    B, S = batch["input_ids"].shape
    print(f"verl_style_batch: tiny Qwen3 ({args.layers} layers, hidden 64, vocab {args.vocab}, random weights), "
          f"{device.type}, dualkv compiler {inner!r}")
    print(f"  batch             input_ids [{B}, {S}] = prompts [{B}, {args.max_prompt_length}] (left padded) + "
          f"responses [{B}, {args.max_response_length}] (right padded)")
    print(f"  prompt lengths    {prompt_lens[:: args.rollouts]} (each repeated for {args.rollouts} rollouts)")
    print(f"  response lengths  {response_lens}")
    row = min(range(B), key=lambda b: prompt_lens[b])  # the most left padding
    start, P = args.max_prompt_length - prompt_lens[row], args.max_prompt_length
    pos = batch["position_ids"][row].tolist()
    print(f"  position_ids      clamp(cumsum(attention_mask) - 1, min=0); row {row}: left pad | prompt "
          f"{pos[max(0, start - 2) : start + 3]}, prompt | response {pos[P - 2 : P + 3]}")
    print(f"  layout            {layout!r}: {stats.num_groups} trees of depth {stats.depth}; shared nodes "
          f"{[n.length for n in layout.nodes if n.count > 1]} tokens")
    print(f"  tokens            {stats.padded_tokens} with padding, {stats.tokens_before} valid -> {stats.tokens_after} "
          f"packed (rho {stats.rho:.2f}x)")
    print(f"  attention pairs   {stats.attention_pairs_before} -> {stats.attention_pairs_after} "
          f"({stats.attention_ratio:.2f}x fewer)")
    print(f"  loss              {loss.item():+.6f} (undecorated {ref_loss.item():+.6f}), |diff| {loss_diff:.1e}")
    print(f"  gradients         worst relative error {grad_errs[worst]:.1e} ({worst}), max |diff| {grad_max:.1e}")
    for r in reports:
        print("  " + str(r).replace("\n", "\n  "))
    print(f"  total wall time   {time.perf_counter() - t_start:.1f} s")
    ok = loss_diff <= tol * max(1.0, abs(ref_loss.item())) and grad_errs[worst] <= tol and packed > 0
    print("verl_style_batch: OK" if ok else f"verl_style_batch: MISMATCH (tolerance {tol:.0e}, packed calls {packed})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
