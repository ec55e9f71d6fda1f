"""GRPO on a tiny random-weight Qwen3, with the policy loss compiled by dualkv.

A complete (toy) GRPO loop on CPU:
  1. sample a few synthetic prompts;
  2. roll out N responses per prompt with the model's own ``generate``, into
     the batch veRL builds: prompts left padded to ``--max-prompt``, responses
     right padded to ``--max-new`` (after their EOS), so every step has the
     same [B, S] shape;
  3. score them with a toy reward (the share of response tokens below
     vocab/4) and normalise rewards within each group into advantages;
  4. compute the old log-probs and take a clipped policy-gradient step, both
     through ``@dualkv_compile.policy_loss``: each prompt runs through the model
     once, not N times, and the next-token log-probs are gathered on the
     packed stream.

A progress bar (stderr) follows the steps; per step it prints the loss, the
mean reward, the tokens the packing saved and the step time. The loss is ~0
by construction (on-policy, ratio 1, group-normalised advantages); its
gradient is not. At the end, on the last batch, it times the decorated loss
step (forward + backward) against the same loss run undecorated on the
duplicated batch, checks that the two agree (loss and every gradient), and
prints a summary.

    python examples/grpo_tiny.py [--steps 4] [--prompts 2] [--rollouts 8] [--inductor]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dualkv_compile  # noqa: E402
from examples.progress import ProgressBar  # noqa: E402

EOS, PAD = 1, 0


def tiny_policy(vocab: int, layers: int, seed: int = 0) -> Qwen3ForCausalLM:
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, eos_token_id=EOS, pad_token_id=PAD,
        bos_token_id=EOS, use_cache=True, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)


def sample_prompts(n: int, vocab: int, max_len: int, gen: torch.Generator) -> list[torch.Tensor]:
    lengths = torch.randint(max_len // 2, max_len + 1, (n,), generator=gen)
    return [torch.randint(2, vocab, (int(n_tokens),), generator=gen) for n_tokens in lengths]


@torch.no_grad()
def rollout(model, prompts: list[torch.Tensor], n: int, max_prompt: int, max_new: int) -> dict:
    """N sampled responses per prompt, as veRL builds the batch: [left pad | prompt | response | right pad].

    Prompts are left padded to ``max_prompt``, responses right padded to ``max_new``.
    """
    ids = torch.full((len(prompts), max_prompt), PAD)
    mask = torch.zeros(len(prompts), max_prompt, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, max_prompt - len(p) :], mask[i, max_prompt - len(p) :] = p, 1
    prompt_ids, prompt_mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
    out = model.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True,
        max_new_tokens=max_new, pad_token_id=PAD, eos_token_id=EOS, top_k=0,
    )
    response = torch.nn.functional.pad(out[:, max_prompt:], (0, max_new - (out.shape[1] - max_prompt)), value=PAD)
    is_eos = (response == EOS).long()
    after_eos = is_eos.cumsum(1) - is_eos > 0
    response_mask = (~after_eos).long()
    response = torch.where(after_eos, PAD, response)
    return {
        "input_ids": torch.cat([prompt_ids, response], 1),
        "attention_mask": torch.cat([prompt_mask, response_mask], 1),
        "response_mask": torch.cat([torch.zeros_like(prompt_mask), response_mask], 1),
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


def loss_step(loss_fn, model, batch):
    """Forward + backward of one loss; returns (loss, gradients, seconds). Leaves no gradients behind."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss = loss_fn(model, batch)
    loss.backward()
    seconds = time.perf_counter() - t0
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.item(), grads, seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=96, help="prompts are 1/2 to 1x this long, left padded to it")
    ap.add_argument("--max-new", type=int, default=24, help="response tokens sampled, right padded to it")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--timing-reps", type=int, default=5, help="loss steps timed per side on the last batch")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: steadier timings)")
    ap.add_argument("--inductor", action="store_true", help="compile with Inductor (slow to compile on CPU)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    inner = "inductor" if args.inductor else "aot_eager"
    policy = tiny_policy(args.vocab, args.layers)
    # dynamic=True: the layout (prompt and response lengths) changes every step; one compile serves them all.
    logprobs = dualkv_compile.policy_loss(next_token_logprobs, inner=inner, dynamic=True)
    loss_fn = dualkv_compile.policy_loss(grpo_loss, inner=inner, dynamic=True)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    saved = []
    bar = ProgressBar(args.steps)
    for step in range(1, args.steps + 1):
        compiling = " (compiling)" if step == 1 else ""
        t0 = time.perf_counter()
        bar.show(step - 1, f"step {step}/{args.steps}: rollout")
        policy.eval()
        prompts = sample_prompts(args.prompts, args.vocab, args.max_prompt, gen)
        batch = rollout(policy, prompts, args.rollouts, args.max_prompt, args.max_new)
        rewards = toy_reward(batch, args.vocab).view(args.prompts, args.rollouts)
        batch["advantages"] = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
        t1 = time.perf_counter()
        bar.show(step - 1, f"step {step}/{args.steps}: old log-probs{compiling}")
        policy.train()
        with torch.no_grad():
            batch["old_logp"] = logprobs(policy, batch)
        t2 = time.perf_counter()
        bar.show(step - 1, f"step {step}/{args.steps}: update{compiling}")
        loss = loss_fn(policy, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = dualkv_compile.detect(batch["input_ids"], batch["attention_mask"]).stats()
        saved.append(stats)
        bar.show(step, f"step {step}/{args.steps} done")
        bar.log(
            f"step {step}/{args.steps}  loss {loss.item():+.1e}  reward {rewards.mean().item():.3f}  "
            f"tokens {stats.tokens_before} -> {stats.tokens_after} (rho {stats.rho:.2f}x)  "
            f"rollout {t1 - t0:.1f}s  old log-probs {t2 - t1:.1f}s  update {time.perf_counter() - t2:.1f}s"
        )

    # The last batch once more: decorated loss against the same loss undecorated on the duplicated batch.
    bar.show(args.steps, "timing the loss step: dualkv vs duplicated")
    reference = copy.deepcopy(policy)
    times = {"dualkv": [], "duplicated": []}
    for rep in range(max(1, args.timing_reps)):
        ours, our_grads, seconds = loss_step(loss_fn, policy, batch)
        times["dualkv"].append(seconds)
        ref, ref_grads, seconds = loss_step(grpo_loss, reference, batch)
        times["duplicated"].append(seconds)
        if rep == 0:
            loss_diff = abs(ours - ref)
            grad_diff = max((a - b).abs().max().item() for a, b in zip(our_grads, ref_grads))
            grad_scale = max(b.abs().max().item() for b in ref_grads)
    bar.close()
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    last = saved[-1]
    before = sum(s.tokens_before for s in saved)
    after = sum(s.tokens_after for s in saved)
    reports = [r for r in dualkv_compile.reports() if r.rewritten]
    ok = loss_diff <= 1e-4 * max(1.0, abs(ref)) and grad_diff <= 1e-4 and sum(r.packed_calls for r in reports) > 0

    B, S = batch["input_ids"].shape
    print()
    print(f"grpo_tiny: tiny Qwen3 ({args.layers} layers, hidden 128, vocab {args.vocab}, random weights), CPU, "
          f"{args.threads} thread(s), dualkv compiler {inner!r}")
    print(f"  batch per step    {args.prompts} prompts x {args.rollouts} responses, input_ids [{B}, {S}] "
          f"(prompts left padded to {args.max_prompt}, responses right padded to {args.max_new})")
    print(f"  tokens            {before} -> {after} over {args.steps} steps (rho {before / after:.2f}x); "
          f"last batch {last.tokens_before} -> {last.tokens_after} (rho {last.rho:.2f}x, {last.padded_tokens} with padding)")
    print(f"  attention pairs   last batch {last.attention_pairs_before} -> {last.attention_pairs_after} "
          f"({last.attention_ratio:.2f}x fewer)")
    print(f"  loss step, forward + backward on the last batch, median of {len(times['dualkv'])}:")
    print(f"    dualkv (@policy_loss)              {ms['dualkv']:8.1f} ms")
    print(f"    duplicated (undecorated, eager)    {ms['duplicated']:8.1f} ms")
    print(f"    speedup                            {ms['duplicated'] / ms['dualkv']:8.2f}x")
    print(f"  equivalence       |loss diff| {loss_diff:.2e}, max |grad diff| {grad_diff:.2e} "
          f"(largest gradient entry {grad_scale:.2e})")
    print(f"  graphs            {len(reports)} rewritten, {sum(r.packed_calls for r in reports)} packed calls, "
          f"packed graphs compiled {sum(r.packed_compiles for r in reports)}x")
    print(f"  total wall time   {time.perf_counter() - t_start:.1f} s")
    print("grpo_tiny: OK" if ok else "grpo_tiny: MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
