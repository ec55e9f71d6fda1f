"""dualkv_compile in one screen: train a tiny Qwen3 on a GRPO-style batch, packed vs duplicated.

    python examples/demo.py [--steps 6] [--inductor]

A tiny Qwen3 built from its config (random weights), a GRPO-style batch of
2 prompts x 4 sampled responses: prompts left padded to one length,
responses of ragged lengths right padded. Two copies of the model train side
by side with AdamW on the same batch and the same policy-gradient loss:

    dualkv     torch.compile(model, backend="dualkv")   the shared prompt is computed once
    plain      torch.compile(model)                     every row computes its own prompt copy

The summary shows what packing saved (tokens, attention pairs), the time per
step of each after warm-up, and how far the two are apart (loss and
gradients at step 1: equal up to float rounding).

By default both sides use the "aot_eager" compiler (AOTAutograd, no
Inductor), because an Inductor compile on a 2-core CPU takes minutes;
``--inductor`` uses Inductor on both sides.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dualkv_compile  # noqa: E402
from examples.progress import ProgressBar  # noqa: E402


def tiny_qwen3(vocab=2048):
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, use_cache=False, tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg).train()


def grpo_batch(prompt_lens, response_lens, vocab, seed=0):
    """Rows [left pad | prompt | response | right pad]; each prompt repeated for its group's responses.

    Returns input_ids, attention_mask, response_mask (1 on response tokens) and per-row advantages.
    """
    g = torch.Generator().manual_seed(seed)
    Pmax, Rmax = max(prompt_lens), max(max(r) for r in response_lens)
    rows = sum(len(r) for r in response_lens)
    ids = torch.zeros(rows, Pmax + Rmax, dtype=torch.long)
    mask = torch.zeros_like(ids)
    resp = torch.zeros_like(ids)
    adv = torch.zeros(rows)
    b = 0
    for P, rs in zip(prompt_lens, response_lens):
        prompt = torch.randint(1, vocab, (P,), generator=g)
        rewards = torch.rand(len(rs), generator=g)
        a = (rewards - rewards.mean()) / (rewards.std() + 1e-6)  # group-normalised advantage
        for i, r in enumerate(rs):
            ids[b, Pmax - P : Pmax] = prompt
            ids[b, Pmax : Pmax + r] = torch.randint(1, vocab, (r,), generator=g)
            mask[b, Pmax - P : Pmax + r] = 1
            resp[b, Pmax : Pmax + r] = 1
            adv[b] = a[i]
            b += 1
    return ids, mask, resp, adv


def policy_loss(logits, ids, resp, adv):
    """GRPO-style: -(advantage x log-prob of each response token), mean over response tokens."""
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = resp[:, 1:].float()
    return -(logp * adv[:, None] * m).sum() / m.sum()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: steadier timings)")
    ap.add_argument("--inductor", action="store_true", help="compile with Inductor on both sides (slow on CPU)")
    args = ap.parse_args()
    logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
    logging.getLogger("dualkv_compile").setLevel(logging.WARNING)
    # One intra-op thread: on a small shared CPU, OpenMP barriers make multi-thread timings swing 10x.
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    inner = "inductor" if args.inductor else "aot_eager"
    vocab = 2048
    ids, mask, resp, adv = grpo_batch([192, 160], [[48, 20, 33, 9], [40, 27, 14, 36]], vocab)
    layout = dualkv_compile.detect(ids, mask)
    stats = layout.stats()

    base = tiny_qwen3(vocab)
    sides = {}
    for name in ("dualkv", "plain"):
        model = copy.deepcopy(base)
        if name == "dualkv":
            fn = torch.compile(model, backend="dualkv", options={"inner": inner})
        else:
            fn = torch.compile(model, backend=inner)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sides[name] = dict(model=model, fn=fn, opt=opt, times=[], cpu=[], losses=[], grads=None)
    start_reports = len(dualkv_compile.reports())

    bar = ProgressBar(args.steps * len(sides))
    k = 0
    for step in range(1, args.steps + 1):
        for name, s in sides.items():
            bar.show(k, f"step {step}/{args.steps} {name}" + (" (compiling)" if step == 1 else ""))
            t0, c0 = time.perf_counter(), time.process_time()
            s["opt"].zero_grad(set_to_none=True)
            logits = s["fn"](input_ids=ids, attention_mask=mask).logits
            loss = policy_loss(logits, ids, resp, adv)
            loss.backward()
            if step == 1:
                s["grads"] = [p.grad.detach().clone() for p in s["model"].parameters()]
            s["opt"].step()
            s["times"].append(time.perf_counter() - t0)
            s["cpu"].append(time.process_time() - c0)
            s["losses"].append(loss.item())
            k += 1
            bar.show(k, f"step {step}/{args.steps} {name}: loss {loss.item():+.5f}, {s['times'][-1] * 1e3:.0f} ms")
    bar.close()

    reps = dualkv_compile.reports()[start_reports:]
    d, p = sides["dualkv"], sides["plain"]
    later = {name: s["times"][1:] or s["times"] for name, s in sides.items()}
    ms = {name: statistics.median(t) * 1e3 for name, t in later.items()}
    best = {name: min(t) * 1e3 for name, t in later.items()}
    cpu = {name: statistics.median(s["cpu"][1:] or s["cpu"]) * 1e3 for name, s in sides.items()}
    grad_diff = max((a - b).abs().max().item() for a, b in zip(d["grads"], p["grads"]))
    grad_scale = max(b.abs().max().item() for b in p["grads"])
    rewritten = [r for r in reps if r.rewritten]
    print()
    print(f"dualkv_compile demo: tiny Qwen3 (2 layers, hidden 128, vocab {vocab}, random weights), CPU, "
          f"{args.threads} thread(s), compiler {inner!r} on both sides" + ("" if args.inductor else " (Inductor compiles take minutes on a small CPU; --inductor to use it)"))
    print(f"batch: 2 prompts x 4 responses, input_ids {list(ids.shape)}, prompts {[192, 160]} left padded, responses ragged, right padded")
    print()
    print(f"  tokens            {stats.tokens_before:6d} -> {stats.tokens_after:6d}   (rho {stats.rho:.2f}x; {stats.padded_tokens} with padding)")
    print(f"  attention pairs   {stats.attention_pairs_before:6d} -> {stats.attention_pairs_after:6d}   ({stats.attention_ratio:.2f}x fewer)")
    print(f"  graphs            {len(reps)} seen, {len(rewritten)} rewritten, {sum(r.packed_calls for r in rewritten)} packed calls")
    print()
    print(f"  time per step, steps 2..{args.steps}, forward + backward + AdamW")
    print("                      wall median   wall best   CPU time median (steadier on a busy machine)")
    for name, label in (("dualkv", "dualkv"), ("plain", "plain compile")):
        print(f"    {label:16} {ms[name]:9.1f} ms {best[name]:9.1f} ms {cpu[name]:9.1f} ms")
    print(f"    {'speedup':16} {ms['plain'] / ms['dualkv']:9.2f}x   {best['plain'] / best['dualkv']:9.2f}x   {cpu['plain'] / cpu['dualkv']:9.2f}x")
    print(f"  first step incl. compile: dualkv {d['times'][0]:.1f} s, plain {p['times'][0]:.1f} s")
    print()
    print("  step 1, dualkv vs plain:")
    print(f"    |loss diff|       {abs(d['losses'][0] - p['losses'][0]):.2e}   (loss {p['losses'][0]:+.6f})")
    print(f"    max |grad diff|   {grad_diff:.2e}   (largest gradient entry {grad_scale:.2e})")
    print(f"  step {args.steps} losses: dualkv {d['losses'][-1]:+.6f}, plain {p['losses'][-1]:+.6f}")
    print()
    for r in reps:
        print("  " + str(r).replace("\n", "\n  "))
    print(f"\ntotal wall time {time.perf_counter() - t_start:.1f} s")
    ok = abs(d["losses"][0] - p["losses"][0]) <= 1e-5 * max(1.0, abs(p["losses"][0])) and grad_diff <= 1e-5 * max(1.0, grad_scale)
    ok = ok and bool(rewritten)
    print("demo: OK (dualkv ran packed and matches plain compile)" if ok else "demo: MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
