"""GRPO on a tiny random-weight Qwen3, with the policy loss compiled by dualkv.

A complete (toy) GRPO loop on CPU:
  1. sample a few synthetic prompts;
  2. roll out N responses per prompt with the model's own ``generate``
     (left-padded prompts, responses right-padded after their EOS);
  3. score them with a toy reward (the share of response tokens below
     vocab/4) and normalise rewards within each group into advantages;
  4. take a clipped policy-gradient step whose loss is decorated with
     ``@dualkv_compile.policy_loss``: each prompt runs through the model once,
     not N times, and the next-token log-probs are gathered on the packed stream.

Per step it prints the loss, the mean reward, the tokens the packing saved and
the step time; at the end it checks the decorated loss and its gradients
against the same loss run undecorated on the duplicated batch.

    python examples/grpo_tiny.py [--steps 4] [--prompts 2] [--rollouts 8] [--inductor]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import dualkv_compile

EOS, PAD = 1, 0


def tiny_policy(vocab: int, seed: int = 0) -> Qwen3ForCausalLM:
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, eos_token_id=EOS, pad_token_id=PAD,
        bos_token_id=EOS, use_cache=True, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)


def sample_prompts(n: int, vocab: int, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randint(2, vocab, (int(torch.randint(48, 96, (1,), generator=gen)),), generator=gen) for _ in range(n)]


@torch.no_grad()
def rollout(model, prompts: list[torch.Tensor], n: int, max_new: int) -> dict:
    """N sampled responses per prompt, as the padded batch veRL/TRL build: [left pad | prompt | response | right pad]."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), PAD)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :], mask[i, P - len(p) :] = p, 1
    out = model.generate(
        input_ids=ids.repeat_interleave(n, 0), attention_mask=mask.repeat_interleave(n, 0), do_sample=True,
        max_new_tokens=max_new, pad_token_id=PAD, eos_token_id=EOS, top_k=0,
    )
    response = out[:, P:]
    after_eos = (response == EOS).long().cumsum(1) - (response == EOS).long() > 0
    response_mask = (~after_eos).long()
    response = torch.where(after_eos, PAD, response)
    return {
        "input_ids": torch.cat([ids.repeat_interleave(n, 0), response], 1),
        "attention_mask": torch.cat([mask.repeat_interleave(n, 0), response_mask], 1),
        "response_mask": torch.cat([torch.zeros_like(mask).repeat_interleave(n, 0), response_mask], 1),
    }


def toy_reward(batch: dict, vocab: int) -> torch.Tensor:
    m = batch["response_mask"].bool()
    small = (batch["input_ids"] < vocab // 4) & m
    return small.sum(1) / m.sum(1).clamp(min=1)


def next_token_logprobs(model, batch, temperature=1.0):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return logp.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)


def grpo_loss(model, batch, clip=0.2):
    logp = next_token_logprobs(model, batch)
    ratio = torch.exp(logp - batch["old_logp"])
    adv = batch["advantages"][:, None]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    mask = batch["response_mask"][:, 1:].float()
    return (per_token * mask).sum() / mask.sum()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--inductor", action="store_true", help="compile with Inductor (slow to compile on CPU)")
    args = ap.parse_args(argv)

    torch.set_num_threads(max(1, torch.get_num_threads()))
    inner = "inductor" if args.inductor else "aot_eager"
    policy = tiny_policy(args.vocab)
    logprobs = dualkv_compile.policy_loss(next_token_logprobs, inner=inner)
    loss_fn = dualkv_compile.policy_loss(grpo_loss, inner=inner)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    saved = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        policy.eval()
        batch = rollout(policy, sample_prompts(args.prompts, args.vocab, gen), args.rollouts, args.max_new)
        rewards = toy_reward(batch, args.vocab).view(args.prompts, args.rollouts)
        batch["advantages"] = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
        policy.train()
        with torch.no_grad():
            batch["old_logp"] = logprobs(policy, batch)
        t1 = time.perf_counter()
        loss = loss_fn(policy, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = dualkv_compile.detect(batch["input_ids"], batch["attention_mask"]).stats()
        saved.append(stats)
        print(
            f"step {step}/{args.steps}  loss {loss.item():+.4f}  reward {rewards.mean().item():.3f}  "
            f"tokens {stats.tokens_before} -> {stats.tokens_after} (rho {stats.rho:.2f}x)  "
            f"rollout {t1 - t0:.1f}s  update {time.perf_counter() - t1:.1f}s",
            flush=True,
        )

    # The last batch once more: decorated loss against the same loss undecorated on the duplicated batch.
    reference = copy.deepcopy(policy)
    ours = loss_fn(policy, batch)
    ours.backward()
    ref = grpo_loss(reference, batch)
    ref.backward()
    grad_diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(policy.parameters(), reference.parameters()))
    before = sum(s.tokens_before for s in saved)
    after = sum(s.tokens_after for s in saved)
    print(f"tokens over {args.steps} steps: {before} -> {after} (rho {before / after:.2f}x)")
    print(f"equivalence: |loss diff| {abs(ours.item() - ref.item()):.2e}, max |grad diff| {grad_diff:.2e}")
    ok = abs(ours.item() - ref.item()) <= 1e-4 * max(1.0, abs(ref.item())) and grad_diff <= 1e-4
    print("grpo_tiny: OK" if ok else "grpo_tiny: MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
