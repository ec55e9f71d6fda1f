"""A GRPO batch laid out as veRL's rollout returns it, through ``@policy_loss`` in a loop of your own.

(veRL 0.9's trainer no longer calls a loss like this one: its FSDP engine runs the model and the log-probs itself.
For veRL 0.9 use the one config line of ``dualkv_compile.integrations.verl``; ``examples/verl_engine_step.py``
runs veRL's own engine with it. This script keeps the batch layout and the loss of veRL's earlier actor as a
``@policy_loss`` example.)

    python examples/verl_style_batch.py [--prompts 2] [--rollouts 4] [--device cuda]
    python examples/verl_style_batch.py --remove-padding [--rmpad-form roll] [--no-shuffle]

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

``--remove-padding``: veRL's default actor path (``use_remove_padding=True``,
dp_actor's ``_forward_micro_batch``). The rows are first reordered (veRL's
sequence-length balancing moves a group's rows apart; a seeded permutation
here; ``--no-shuffle`` keeps them in place, ``--shuffle`` reorders the padded
mode's rows too), then the valid tokens of the micro-batch are packed into
ONE row: ``unpad_input(input_ids, attention_mask)``
(flash-attn's, written here in torch: ``indices = nonzero(mask.flatten())``)
gives ``input_ids`` ``[1, total]`` and ``position_ids`` ``[1, total]``
restarting at 0 at each sequence, and the model runs with no attention mask
(transformers builds the block-diagonal causal mask from the restarts). The
labels are ``torch.roll(input_ids, shifts=-1, dims=1)`` (the next token in the
row), the per-token log-probs of ``[1, total, V]`` logits are padded back to
``[B, S]`` with ``pad_input`` (``index_put`` at ``indices``), the response
columns ``[:, -R - 1 : -1]`` sliced, and the same clipped objective aggregated
with ``response_mask``. The unpad (``nonzero``: a data-dependent shape) runs
before the decorated loss, where veRL's data path has it too (its newer engine
receives the micro-batch as nested tensors and passes
``input_ids.values().unsqueeze(0)``); ``--rmpad-form`` picks how the loss is
written, and what the backend does with it (all are exact):

    roll           (default) veRL's labels, logits / temperature: packs; the
                   logits are unpacked to [1, total, V] before the rolled
                   gather (as in the padded form above)
    roll-inplace   veRL's literal ``logits_rmpad = logits.squeeze(0)``,
                   ``logits_rmpad.div_(temperature)``: REFUSED (an in-place op
                   through a view of the logits), runs unchanged
    slice          ``logits[:, :-1]`` gathered with ``input_ids[:, 1:]``, then
                   padded back: runs unpacked (the pair that crosses from one
                   sequence into the next in the row is read by ``pad`` before
                   the response mask zeroes it, and packing does not compute it)
    slice-masked   the same, multiplied by the response mask in the row's layout
                   before padding back: packs, with the next-token log-probs
                   computed from the lm_head in chunks (no [total, V] logits)
    unpad-inside   dp_actor as written, the unpad inside the decorated loss:
                   ``nonzero`` breaks the graph (4 graphs); the model's graph
                   gets the unpadded ids under a name Dynamo gives the resumed
                   frame, not input_ids, and is REFUSED ("attention cannot run
                   on the packed stream: q is not a per-token value"); all run
                   unchanged

The script prints the row order, the packed row, the layout (sequences,
trees, depth, tokens with padding -> after remove padding -> packed, rho), the
differences and each graph's report. ``OK`` needs the loss and gradients exact
and the model's graph run packed; a form that does not pack ends with
``NOT PACKED``.
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
    return clipped_token_mean(log_prob, batch, clip_ratio)


def clipped_token_mean(log_prob, batch, clip_ratio):
    """veRL's clipped policy loss (dual-clip off) on ``[B, R]`` response log-probs, "token-mean" over response_mask."""
    ratio = torch.exp(log_prob - batch["old_log_probs"])
    pg_losses = -batch["advantages"] * ratio
    pg_losses_clipped = -batch["advantages"] * torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
    pg_losses = torch.maximum(pg_losses, pg_losses_clipped)
    mask = batch["response_mask"].float()
    return (pg_losses * mask).sum() / mask.sum()


# --- remove padding (veRL's use_remove_padding=True) ---------------------------------------------------------


def shuffle_rows(batch: dict, seed: int = 1) -> tuple[dict, torch.Tensor]:
    """The batch's rows in another order, as veRL's balancing reorders them (a seeded permutation here)."""
    B = batch["input_ids"].shape[0]
    order = torch.randperm(B, generator=torch.Generator().manual_seed(seed))
    return {k: v[order.to(v.device)] for k, v in batch.items()}, order


def unpad_input(hidden_states, attention_mask):
    """flash-attn's ``unpad_input`` in torch: the valid entries of ``[B, S, ...]`` as ``[total, ...]``, their flat
    indices in ``B * S`` and the sequences' cumulative lengths."""
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return hidden_states.flatten(0, 1)[indices], indices, cu_seqlens  # index_first_axis


def pad_input(hidden_states, indices, batch, seqlen):
    """flash-attn's ``pad_input`` in torch: ``[total, ...]`` back to ``[B, S, ...]``, zeros at padding."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    return out.index_put((indices,), hidden_states).view(batch, seqlen, *hidden_states.shape[1:])


def remove_padding(batch: dict) -> dict:
    """The micro-batch as dp_actor hands it to the model with use_remove_padding: ``input_ids`` and ``position_ids``
    ``[1, total]`` (the valid tokens of every row, position ids restarting at each sequence), no attention mask,
    ``indices`` to pad the per-token outputs back with; the response-side tensors stay ``[B, R]``."""
    input_ids_rmpad, indices, _ = unpad_input(batch["input_ids"].unsqueeze(-1), batch["attention_mask"])
    position_ids_rmpad, _, _ = unpad_input(batch["position_ids"].unsqueeze(-1), batch["attention_mask"])
    out = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "position_ids")}
    out["input_ids"] = input_ids_rmpad.transpose(0, 1)  # [1, total]
    out["position_ids"] = position_ids_rmpad.transpose(0, 1)
    out["indices"] = indices
    # For the "slice-masked" form only: response_mask in the row's layout (prompt columns 0).
    loss_mask = torch.cat([torch.zeros_like(batch["prompts"]), batch["response_mask"]], dim=1)
    out["response_mask_rmpad"] = loss_mask.flatten()[indices].unsqueeze(0).float()
    return out


def response_log_probs(log_probs_rmpad, batch):
    """dp_actor after the model: the ``[total]`` log-probs padded back to ``[B, S]``, the response columns kept."""
    batch_size, response_length = batch["responses"].shape
    seqlen = batch["prompts"].shape[1] + response_length
    full_log_probs = pad_input(log_probs_rmpad.unsqueeze(-1), batch["indices"], batch_size, seqlen).squeeze(-1)
    return full_log_probs[:, -response_length - 1 : -1]  # [B, R]: column c predicts the token at c + 1


def rmpad_actor_loss(model, batch, clip_ratio=0.2, temperature=1.0):
    """veRL's actor loss with remove padding: labels ``torch.roll(input_ids, -1)``, the next token in the row."""
    input_ids_rmpad = batch["input_ids"]  # [1, total]
    input_ids_rmpad_rolled = torch.roll(input_ids_rmpad, shifts=-1, dims=1).squeeze(0)  # [total]
    output = model(input_ids=input_ids_rmpad, attention_mask=None, position_ids=batch["position_ids"])
    logits_rmpad = output.logits.squeeze(0) / temperature  # [total, V]
    log_probs = torch.log_softmax(logits_rmpad.float(), dim=-1)
    log_probs = log_probs.gather(-1, input_ids_rmpad_rolled.unsqueeze(-1)).squeeze(-1)  # [total]
    return clipped_token_mean(response_log_probs(log_probs, batch), batch, clip_ratio)


def rmpad_actor_loss_inplace(model, batch, clip_ratio=0.2, temperature=1.0):
    """As ``rmpad_actor_loss``, with dp_actor's in-place temperature on the squeezed logits."""
    input_ids_rmpad = batch["input_ids"]
    input_ids_rmpad_rolled = torch.roll(input_ids_rmpad, shifts=-1, dims=1).squeeze(0)
    output = model(input_ids=input_ids_rmpad, attention_mask=None, position_ids=batch["position_ids"])
    logits_rmpad = output.logits.squeeze(0)
    logits_rmpad.div_(temperature)
    log_probs = torch.log_softmax(logits_rmpad.float(), dim=-1)
    log_probs = log_probs.gather(-1, input_ids_rmpad_rolled.unsqueeze(-1)).squeeze(-1)
    return clipped_token_mean(response_log_probs(log_probs, batch), batch, clip_ratio)


def rmpad_actor_loss_slice(model, batch, clip_ratio=0.2, temperature=1.0, mask_row=False):
    """The next token by slicing (``logits[:, :-1]``, ``input_ids[:, 1:]``); the last token gets a 0 (veRL's roll
    would pair it with the row's first token: masked either way). ``mask_row``: multiply by the response mask in the
    row's layout before padding back (the "slice-masked" form)."""
    input_ids = batch["input_ids"]  # [1, total]
    logits = model(input_ids=input_ids, attention_mask=None, position_ids=batch["position_ids"]).logits
    log_probs = torch.log_softmax((logits[:, :-1] / temperature).float(), dim=-1)
    log_probs = log_probs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [1, total - 1]
    if mask_row:
        log_probs = log_probs * batch["response_mask_rmpad"][:, 1:]
    log_probs = torch.nn.functional.pad(log_probs, (0, 1)).squeeze(0)  # [total]
    return clipped_token_mean(response_log_probs(log_probs, batch), batch, clip_ratio)


def rmpad_actor_loss_slice_masked(model, batch, clip_ratio=0.2, temperature=1.0):
    return rmpad_actor_loss_slice(model, batch, clip_ratio, temperature, mask_row=True)


def rmpad_actor_loss_unpad_inside(model, batch, clip_ratio=0.2, temperature=1.0):
    """dp_actor's ``_forward_micro_batch`` as written, on the padded micro-batch: unpad, model, roll, pad back."""
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    batch_size, seqlen = input_ids.shape
    response_length = batch["responses"].shape[1]
    input_ids_rmpad, indices, _ = unpad_input(input_ids.unsqueeze(-1), attention_mask)
    input_ids_rmpad = input_ids_rmpad.transpose(0, 1)  # [1, total]
    position_ids_rmpad = batch["position_ids"].unsqueeze(-1).flatten(0, 1)[indices].transpose(0, 1)
    input_ids_rmpad_rolled = torch.roll(input_ids_rmpad, shifts=-1, dims=1).squeeze(0)
    output = model(input_ids=input_ids_rmpad, attention_mask=None, position_ids=position_ids_rmpad)
    logits_rmpad = output.logits.squeeze(0) / temperature
    log_probs = torch.log_softmax(logits_rmpad.float(), dim=-1)
    log_probs = log_probs.gather(-1, input_ids_rmpad_rolled.unsqueeze(-1)).squeeze(-1)
    full_log_probs = pad_input(log_probs.unsqueeze(-1), indices, batch_size, seqlen).squeeze(-1)
    return clipped_token_mean(full_log_probs[:, -response_length - 1 : -1], batch, clip_ratio)


RMPAD_FORMS = {
    "roll": rmpad_actor_loss,
    "roll-inplace": rmpad_actor_loss_inplace,
    "slice": rmpad_actor_loss_slice,
    "slice-masked": rmpad_actor_loss_slice_masked,
    "unpad-inside": rmpad_actor_loss_unpad_inside,
}
RMPAD_LABELS = {
    "roll": "labels torch.roll(input_ids, -1, dims=1), logits / temperature",
    "roll-inplace": "labels torch.roll(input_ids, -1, dims=1), logits_rmpad.div_(temperature)",
    "slice": "logits[:, :-1] gathered with input_ids[:, 1:]",
    "slice-masked": "logits[:, :-1] gathered with input_ids[:, 1:], times the row's response mask",
    "unpad-inside": "unpad inside the loss, labels torch.roll(input_ids, -1, dims=1)",
}


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
    ap.add_argument("--remove-padding", action="store_true",
                    help="veRL's use_remove_padding=True: the micro-batch's valid tokens packed into one row")
    ap.add_argument("--rmpad-form", choices=sorted(RMPAD_FORMS), default="roll",
                    help="how the remove-padding loss is written (see above; default: roll, as veRL)")
    ap.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=None,
                    help="reorder the rows as veRL's balancing does (default: on with --remove-padding)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    inner = args.inner or ("inductor" if device.type == "cuda" else "aot_eager")
    tol = 1e-5 if device.type == "cpu" else 1e-4  # CUDA kernels reduce in other orders
    shuffle = args.remove_padding if args.shuffle is None else args.shuffle
    t_start = time.perf_counter()

    batch = verl_style_batch(args.prompts, args.rollouts, args.max_prompt_length, args.max_response_length, args.vocab)
    order = torch.arange(batch["input_ids"].shape[0])
    if shuffle:
        batch, order = shuffle_rows(batch)
    batch = {k: v.to(device) for k, v in batch.items()}
    rm = remove_padding(batch) if args.remove_padding else None  # the unpad, before the decorated loss
    if not args.remove_padding:
        fn, call_batch = actor_loss, batch
    elif args.rmpad_form == "unpad-inside":
        fn, call_batch = RMPAD_FORMS[args.rmpad_form], batch
    else:
        fn, call_batch = RMPAD_FORMS[args.rmpad_form], rm
    model = tiny_qwen3(args.vocab, args.layers).to(device)
    reference = copy.deepcopy(model)
    loss_fn = dualkv_compile.policy_loss(fn, inner=inner)

    first_report = len(dualkv_compile.reports())
    loss = loss_fn(model, call_batch)
    loss.backward()
    ref_loss = fn(reference, call_batch)
    ref_loss.backward()
    loss_diff = abs(loss.item() - ref_loss.item())
    grad_errs = {name: rel_err(p.grad, q.grad) for (name, p), q in zip(model.named_parameters(), reference.parameters())}
    worst = max(grad_errs, key=grad_errs.get)
    grad_max = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    reports = dualkv_compile.reports()[first_report:]
    packed = sum(r.packed_calls for r in reports if r.rewritten)
    calls = sum(r.calls for r in reports if r.rewritten)

    prompt_lens = batch["attention_mask"][:, : args.max_prompt_length].sum(1).tolist()
    response_lens = batch["response_mask"].sum(1).tolist()
    B, S = batch["input_ids"].shape
    mode = f"remove padding, loss form {args.rmpad_form!r}" if args.remove_padding else "padded"
    print(f"verl_style_batch: tiny Qwen3 ({args.layers} layers, hidden 64, vocab {args.vocab}, random weights), "
          f"{device.type}, dualkv compiler {inner!r}, {mode}")
    print(f"  batch             input_ids [{B}, {S}] = prompts [{B}, {args.max_prompt_length}] (left padded) + "
          f"responses [{B}, {args.max_response_length}] (right padded)")
    groups = (order // args.rollouts).tolist()
    print(f"  prompt lengths    {[prompt_lens[groups.index(g)] for g in range(args.prompts)]} "
          f"(each repeated for {args.rollouts} rollouts)")
    if shuffle:
        print(f"  rows shuffled     group of each row {groups} (veRL's balancing reorders rows; a seeded permutation)")
    print(f"  response lengths  {response_lens}")
    row = min(range(B), key=lambda b: prompt_lens[b])  # the most left padding
    start, P = args.max_prompt_length - prompt_lens[row], args.max_prompt_length
    pos = batch["position_ids"][row].tolist()
    print(f"  position_ids      clamp(cumsum(attention_mask) - 1, min=0); row {row}: left pad | prompt "
          f"{pos[max(0, start - 2) : start + 3]}, prompt | response {pos[P - 2 : P + 3]}")
    if args.remove_padding:
        total = rm["input_ids"].shape[1]
        starts = (rm["position_ids"][0] == 0).nonzero().flatten().tolist()
        print(f"  remove padding    unpad_input(input_ids, attention_mask): input_ids [1, {total}], position_ids "
              f"restart at 0 at the {len(starts)} sequence starts {starts}; no attention mask")
        print(f"  log-probs         {RMPAD_LABELS[args.rmpad_form]}; pad_input to [{B}, {S}], response columns "
              f"[:, {-args.max_response_length - 1}:-1]")
        layout = dualkv_compile.detect(rm["input_ids"], None, rm["position_ids"], same_columns=False)
    else:
        layout = dualkv_compile.detect(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    stats = layout.stats()
    print(f"  layout            {layout!r}: {stats.num_sequences} sequences in {stats.num_groups} trees of depth "
          f"{stats.depth}; shared nodes {[n.length for n in layout.nodes if n.count > 1]} tokens")
    unpadded = f" -> {stats.tokens_before} after remove padding" if args.remove_padding else f", {stats.tokens_before} valid"
    print(f"  tokens            {B * S} with padding{unpadded} -> {stats.tokens_after} packed (rho {stats.rho:.2f}x)")
    print(f"  attention pairs   {stats.attention_pairs_before} -> {stats.attention_pairs_after} "
          f"({stats.attention_ratio:.2f}x fewer)")
    print(f"  loss              {loss.item():+.6f} (undecorated {ref_loss.item():+.6f}), |diff| {loss_diff:.1e}")
    print(f"  gradients         worst relative error {grad_errs[worst]:.1e} ({worst}), max |diff| {grad_max:.1e}")
    refused = [r for r in reports if not r.rewritten]
    print(f"  backend           {len(reports)} graph(s): {len(reports) - len(refused)} rewritten, {len(refused)} refused; "
          f"{packed} of {calls} calls of rewritten graphs ran packed")
    for r in reports:
        print("  " + str(r).replace("\n", "\n  "))
    print(f"  total wall time   {time.perf_counter() - t_start:.1f} s")
    exact = loss_diff <= tol * max(1.0, abs(ref_loss.item())) and grad_errs[worst] <= tol
    if exact and packed > 0:
        print("verl_style_batch: OK")
        return 0
    if exact:
        print("verl_style_batch: NOT PACKED (loss and gradients exact; the graph reports above say why)")
    else:
        print(f"verl_style_batch: MISMATCH (tolerance {tol:.0e}, packed calls {packed})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
