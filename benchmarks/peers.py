"""Peers (issue 36): dualkv beside the other shared-prefix methods, one model, one GRPO batch, one process.

One Hugging Face Qwen3 model built from its config (random weights; tiny on CPU, ``--shape qwen3-0.6b|qwen3-1.7b``
on a GPU) and one GRPO batch (``--groups`` prompts of ``--prompt-len`` tokens, ``--rollouts`` responses each of
``--response-len`` tokens; ``--ragged``: response lengths uniform in [R/2, R], right padded). A step is forward +
backward of the token-mean GRPO loss ``mean(-logp * advantage)`` over the response tokens (fixed random advantage
per response). Each side runs that step on the same weights and batch, in the layout its method asks for:

- ``plain``: the HF model on the duplicated padded batch (SDPA); ``plain_compiled`` the same under Inductor
  (``--compile``); ``plain_varlen``: the batch's sequences as one remove-padding row through torch's varlen
  attention with chunked log-probs (``model_remove_padding.py``'s strongest baseline, what veRL users run).
- ``dualkv``: the same loss function as ``plain`` under ``@dualkv_compile.policy_loss``.
- ``prefix_grouper``: PrefixGrouper (``pip install prefix-grouper``) through its transformers integration
  (``register_attention``: attention ``prefix_grouper_attention``, its ``PrefixGrouper`` object passed through the
  model call), the [prefix | suffixes] layout from its ``concat_input`` / ``split_output``, positions as its README
  prescribes. Its attention calls an inner function with FlashAttention-2's contract (2-D padding mask, causal
  aligned at the bottom right): ``flash_attention_2`` where ``flash_attn`` is installed, else ``flash_style`` below
  (``--standin varlen``, the default on CUDA: torch's varlen flash attention on the valid tokens, standing in for
  FlashAttention-2 as in ``varlen_attention.py``; ``sdpa``: SDPA with that mask, as transformers' ``sdpa`` takes only
  4-D masks and PrefixGrouper lists SDPA as future work). Its layout work (``from_ungrouped_masks``, positions) is
  timed.
- ``trl_prefix_tree``: TRL 1.16's ``trl.experimental.async_grpo.packing`` (``TreeRow`` packs the samples into a
  prefix trie, ``tree_attention`` gathers each segment's root path) with its FlashAttention-3 kernel, fetched from the
  Hub through ``kernels``. ``trl_prefix_tree_standin``: the same packing and attention function with that kernel's
  call answered by the ``--standin`` kernel (SDPA per segment with ``sdpa``). TRL packs in its
  collator, outside the step, so the packing is not timed.
- ``flash_pref``: flash-pref's ``shared_prefix`` context (``pip install flash-pref``; written for transformers
  < 4.52, shares attention only under ``flash_attention_2``).

For each: loss and largest parameter-gradient difference relative to ``plain`` (float32 on CPU, bf16 on GPU), the
tokens the layers run on, whether that is packed, the median step time over ``--iters`` after 2 warm-up steps
(``model_gpu.time_step``), peak CUDA memory. A side that is not installed or fails gives ``cannot run: <reason>``.
Writes ``peers.json`` and ``peers.md`` to ``--out``.

    python benchmarks/peers.py --device cpu --out /tmp/peers                      # tiny, about 15 s on 2 cores
    python benchmarks/peers.py --device cuda --shape qwen3-0.6b --groups 2 --rollouts 8 --prompt-len 1024 \\
        --response-len 128 --ragged --compile --iters 5 --out benchmarks/results/peers_h100
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import importlib.metadata
import json
import os
import sys
import time
import traceback
from contextlib import nullcontext
from types import SimpleNamespace
from unittest import mock

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import dualkv_compile  # noqa: E402
from model_gpu import MODELS, TINY_VOCAB, VOCAB, time_step  # noqa: E402
from model_remove_padding import chunked_next_token_logp  # noqa: E402
import varlen_attention  # noqa: E402,F401  (registers torch_varlen)

SHAPES = {"qwen3-0.6b": MODELS["0.6b"], "qwen3-1.7b": MODELS["1.7b"]}


def log(msg):
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def unmet_requirements(dist):
    """The declared requirements of ``dist`` that the installed packages do not meet, as text ('' if none)."""
    from packaging.requirements import Requirement

    unmet = []
    for text in importlib.metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is None and (have := version(req.name)) is not None and have not in req.specifier:
            unmet.append(f"{dist} requires {req}, installed {have}")
    return "; ".join(unmet)


def make_batch(groups, rollouts, prompt_len, response_len, ragged, vocab, device, seed=0):
    """The duplicated batch [prompt | response | right pad] (rows group by group) and its parts per group."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, vocab, (prompt_len,), generator=g) for _ in range(groups)]
    lens = [int(torch.randint(response_len // 2, response_len + 1, (), generator=g)) if ragged else response_len
            for _ in range(groups * rollouts)]
    R = max(lens)
    B, S = groups * rollouts, prompt_len + R
    ids, mask, resp = torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S)
    comp, comp_mask = torch.zeros(B, R, dtype=torch.long), torch.zeros(B, R, dtype=torch.long)
    for b, r in enumerate(lens):
        comp[b, :r], comp_mask[b, :r] = torch.randint(2, vocab, (r,), generator=g), 1
        ids[b, :prompt_len], ids[b, prompt_len:prompt_len + r] = prompts[b // rollouts], comp[b, :r]
        mask[b, :prompt_len + r], resp[b, prompt_len:prompt_len + r] = 1, 1
    batch = dict(input_ids=ids, attention_mask=mask, response_mask=resp, advantages=torch.randn(B, generator=g),
                 prompt_ids=torch.stack(prompts), prompt_mask=torch.ones(groups, prompt_len, dtype=torch.long),
                 completion_ids=comp, completion_mask=comp_mask)
    return {k: v.to(device) for k, v in batch.items()}


def grpo_loss(model, batch):
    """mean(-logp * advantage) over the response tokens of the padded batch (plain, plain_compiled, dualkv)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    logp = logp.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    mask = batch["response_mask"][:, 1:].float()
    return -(logp * batch["advantages"][:, None] * mask).sum() / mask.sum()


def masked_mean_loss(logp, adv, mask):
    """The same loss from the log-probs a peer lays out its own way (``[M]`` or ``[B, R]``), ``mask`` 1 on targets."""
    mask = mask.float()
    return -(logp * adv * mask).sum() / mask.sum()


def flash_style_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, varlen=False, **kwargs):
    """FlashAttention-2's contract in transformers: ``attention_mask`` ``[B, Sk]`` marks valid keys, the queries are the
    last ``Sq`` columns' valid tokens, and causality is aligned at the bottom right of each row's valid tokens (query i
    of n_q sees keys up to i + n_k - n_q). Returns ``[B, Sq, H, D]``. ``varlen``: torch's varlen flash attention (CUDA)
    on the valid tokens, as FlashAttention-2 unpads them; else SDPA with that mask (padding rows arbitrary)."""
    B, H, Sq, D = query.shape
    kmask = attention_mask.bool() if attention_mask is not None else query.new_ones(B, key.shape[2], dtype=torch.bool)
    qmask = kmask[:, -Sq:]
    if varlen:
        return unpadded_varlen(query, key, value, qmask, kmask, scaling, varlen_attention._varlen_cuda), None
    rank_k, rank_q = kmask.cumsum(-1) - 1, qmask.cumsum(-1) - 1
    shift = (kmask.sum(-1) - qmask.sum(-1))[:, None, None]
    allowed = kmask[:, None, :] & (rank_k[:, None, :] <= rank_q[:, :, None] + shift)
    allowed |= ~qmask[:, :, None]  # padding queries see every key: no empty softmax row (their output is dropped)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed[:, None], scale=scaling,
                                                           enable_gqa=key.shape[1] != H)
    return out.transpose(1, 2), None


def unpadded_varlen(query, key, value, qmask, kmask, scale, kernel):
    """``[B, H, S, D]`` rows to their valid tokens, through ``kernel`` (``varlen_attention._varlen_cuda``'s
    signature), back to ``[B, Sq, H, D]`` with zeros at padding."""
    B, H, Sq, D = query.shape
    tokens = lambda x, m: x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])[m.reshape(-1)]  # noqa: E731
    nq, nk = qmask.sum(1), kmask.sum(1)
    cu = lambda n: torch.cat([n.new_zeros(1), n.cumsum(0)]).to(torch.int32)  # noqa: E731
    o = kernel(tokens(query, qmask), tokens(key, kmask), tokens(value, kmask), cu(nq), int(nq.max()), scale, cu(nk),
               int(nk.max()))
    return query.new_zeros(B * Sq, H, value.shape[3]).index_put((qmask.reshape(-1),), o.to(query.dtype)).view(B, Sq, H, -1)


def segments_sdpa(q, k, v, cu_q, max_q, scale, cu_k, max_k):
    """``varlen_attention._varlen_cuda``'s call on any device: SDPA per sequence, causal at the bottom right."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    seg = lambda x, c, s: x[c[s]:c[s + 1]].transpose(0, 1)[None]  # noqa: E731  ([1, H, len, D])
    return torch.cat([flash_style_attention(None, seg(q, cq, s), seg(k, ck, s), seg(v, ck, s), None, scale)[0][0]
                      for s in range(len(cq) - 1)])


def stand_in_flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True,
                                    window_size=(-1, -1), varlen=False, **kw):
    """The call TRL's ``tree_attention`` makes to FlashAttention-3, answered by torch's varlen flash attention (CUDA)
    with ``varlen``, else ``segments_sdpa``: tokens-first ``[T, H, D]``, causal at the bottom right (the exactness columns check
    that alignment against the plain model)."""
    if not causal or tuple(window_size) != (-1, -1) or kw:
        raise NotImplementedError(f"stand-in kernel: only causal full attention, got {window_size}, {sorted(kw)}")
    kernel = varlen_attention._varlen_cuda if varlen else segments_sdpa
    return kernel(q, k, v, cu_q, max_q, softmax_scale, cu_k, max_k)


# Each side: (loss function of (model, batch), attention implementation, tokens computed, packed, note).

def side_plain(model, batch, args, compiled=False):
    fn, how = (torch.compile(grpo_loss, dynamic=False), "Inductor") if compiled else (grpo_loss, "eager")
    return fn, "sdpa", int(batch["input_ids"].numel()), False, f"duplicated padded batch, SDPA, {how}"


def side_plain_varlen(model, batch, args):
    keep = batch["attention_mask"].bool()
    lens = keep.sum(1)
    row = dict(input_ids=batch["input_ids"][keep][None], position_ids=(keep.cumsum(1) - 1)[keep][None],
               adv=batch["advantages"][:, None].expand_as(keep)[keep][None, 1:], mask=batch["response_mask"][keep][None, 1:],
               cu=torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32), longest=int(lens.max()))

    def loss(model, _):
        hidden = model.model(input_ids=row["input_ids"], position_ids=row["position_ids"], cu_seq_lens_q=row["cu"],
                             cu_seq_lens_k=row["cu"], max_length_q=row["longest"], max_length_k=row["longest"]).last_hidden_state
        return masked_mean_loss(chunked_next_token_logp(hidden, model.lm_head, row["input_ids"]), row["adv"], row["mask"])

    fn = torch.compile(loss, dynamic=False) if args.compile else loss
    return fn, "torch_varlen", int(keep.sum()), False, "remove padding, torch varlen attention, chunked log-probs" + (
        ", Inductor" if args.compile else "")


def side_dualkv(model, batch, args):
    stats = dualkv_compile.detect(batch["input_ids"], batch["attention_mask"]).stats()
    return (dualkv_compile.policy_loss(grpo_loss, inner=args.inner), "sdpa", stats.tokens_after, None,
            f"@policy_loss, inner {args.inner}")


def side_prefix_grouper(model, batch, args):
    from prefix_grouper import PrefixGrouper
    from prefix_grouper.utils.register_transformers import register_attention
    from transformers import AttentionInterface

    register_attention()  # (transformers builds no mask for an attention it has no mask function for: none is needed)
    inner = "flash_attention_2" if args.device == "cuda" and version("flash-attn") else "flash_style"
    AttentionInterface.register("flash_style", functools.partial(flash_style_attention, varlen=args.standin == "varlen"))
    N = args.rollouts

    def loss(model, batch):
        pg = PrefixGrouper.from_ungrouped_masks(prefix_mask=batch["prompt_mask"], suffix_mask=batch["completion_mask"],
                                                group_sizes=N, padding_mode="right", device=batch["input_ids"].device)
        ids = pg.concat_input(batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"])
        # Its README: each response's positions continue from the prefix, [0..p-1, p..p+r1-1, p..p+r2-1, ...].
        pos = torch.zeros_like(ids)
        for i, info in enumerate(pg.group_info):
            p, at = info.prefix_len, functools.partial(torch.arange, device=ids.device)
            pos[i, : p + sum(info.suffix_lens)] = torch.cat([at(p)] + [at(p, p + r) for r in info.suffix_lens])
        logits = model(input_ids=ids, position_ids=pos, prefix_grouper=pg, prefix_grouper_attn_func=inner).logits
        _, _, suffix, suffix_mask = pg.split_output(logits, include_prefix_last=1)
        targets = pg.convert_padding(batch["completion_ids"], batch["completion_mask"], padding_mode="right")
        logp = torch.log_softmax(suffix[:, :-1].float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return masked_mean_loss(logp, batch["advantages"][:, None], suffix_mask[:, 1:])

    tokens = args.groups * args.prompt_len + int(batch["completion_mask"].sum())
    loss.dist = "prefix-grouper"
    return loss, "prefix_grouper_attention", tokens, True, f"register_attention, inner attention {inner}" + (
        f" ({'torch varlen flash attention' if args.standin == 'varlen' else 'SDPA'})" if inner == "flash_style" else "")


def side_trl(model, batch, args, stand_in):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # the import is the point here: no warning about it
    from trl.experimental.async_grpo import packing

    packing.register_tree_attention()
    row = packing.TreeRow()
    keep, resp = batch["attention_mask"].bool().cpu(), batch["response_mask"].cpu()
    for b in range(keep.shape[0]):  # the samples as TRL's rollout worker hands them over: unpadded, one group id per prompt
        row.add(dict(input_ids=batch["input_ids"][b].cpu()[keep[b]], completion_mask=resp[b][keep[b]],
                     old_log_probs=torch.zeros(int(keep[b].sum())), advantage=float(batch["advantages"][b]),
                     group_id=b // args.rollouts))
    p = {k: v.to(args.device) for k, v in row.pack().items()}
    kw = dict(tree_kv_index=p["tree_kv_index"], tree_cu_seqlens_q=p["tree_cu_seqlens_q"],
              tree_cu_seqlens_k=p["tree_cu_seqlens_k"])
    kw["tree_max_seqlen_q"], kw["tree_max_seqlen_k"] = p["tree_max_seqlens"].tolist()
    targets = p["shift_labels"][p["token_index"]]
    kernel = SimpleNamespace(  # what TRL's _flash_attn() returns
        flash_attn_varlen_func=functools.partial(stand_in_flash_attn_varlen_func, varlen=args.standin == "varlen"))

    def loss(model, _):
        # What TRL's compute_loss does, with the plain lm_head and log_softmax in place of its fused_lm_head patch.
        with mock.patch.object(packing, "_flash_attn", lambda: kernel) if stand_in else nullcontext():
            logits = model(input_ids=p["input_ids"][None], position_ids=p["position_ids"][None], **kw).logits[0]
        logp = torch.log_softmax(logits[p["token_index"]].float(), -1).gather(-1, targets[:, None])[:, 0]
        return masked_mean_loss(logp, p["advantages"], torch.ones_like(logp))

    note = "TreeRow packing (in TRL's collator: not timed), tree_attention" + (
        f" with {'torch varlen flash attention' if args.standin == 'varlen' else 'SDPA'} standing in for its FlashAttention-3"
        " kernel" if stand_in else " (kernels-community/flash-attn3)")
    return loss, packing.TREE_ATTENTION, int(p["input_ids"].numel()), True, note


def side_flash_pref(model, batch, args):
    from flash_pref import shared_prefix

    attn = "flash_attention_2" if args.device == "cuda" and version("flash-attn") else "sdpa"

    def loss(model, batch):
        with shared_prefix(model, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], group_size=args.rollouts):
            return grpo_loss(model, batch)

    tokens = int(batch["attention_mask"].sum()) - (args.rollouts - 1) * args.groups * args.prompt_len
    loss.dist = "flash-pref"
    return loss, attn, tokens, True, f"shared_prefix, {attn}" + ("" if attn == "flash_attention_2" else " (attention unshared)")


SIDES = {"plain": side_plain, "plain_compiled": functools.partial(side_plain, compiled=True),
         "plain_varlen": side_plain_varlen, "dualkv": side_dualkv, "prefix_grouper": side_prefix_grouper,
         "trl_prefix_tree": functools.partial(side_trl, stand_in=False),
         "trl_prefix_tree_standin": functools.partial(side_trl, stand_in=True), "flash_pref": side_flash_pref}


def loss_and_grads(fn, model, batch, ref=None):
    """One step's loss and, against ``ref`` (the plain side's ``(loss, grads)``), its differences; without ``ref``,
    the gradients themselves, kept on the host so that no side's peak memory holds them."""
    model.zero_grad(set_to_none=True)
    loss = fn(model, batch)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if ref is None:
        out = loss.item(), {n: g.detach().to("cpu", copy=True) for n, g in grads.items()}
    else:
        # Largest over parameters of max |g - g_plain| / max |g_plain|; a parameter left without a gradient counts 1.
        worst = 0.0
        for name, r in ref[1].items():
            g, r = grads.get(name), r.to(loss.device).float()
            worst = max(worst, 1.0 if g is None else float((g.float() - r).abs().max() / r.abs().max().clamp_min(1e-30)))
        out = dict(loss=loss.item(), loss_rel=abs(loss.item() - ref[0]) / max(abs(ref[0]), 1e-30), grad_rel=worst)
    model.zero_grad(set_to_none=True)
    return out


def run_side(name, model, batch, args, ref):
    row, fn = dict(side=name), None
    try:
        fn, attn, tokens, packed, note = SIDES[name](model, batch, args)
        row.update(tokens=tokens, note=note)
        model.config._attn_implementation = attn
        torch._dynamo.reset()
        start = len(dualkv_compile.reports())
        checked = loss_and_grads(fn, model, batch, ref)
        if packed is None:  # dualkv: packed if one of its graphs ran rewritten on a packed call
            packed = any(r.rewritten and r.packed_calls for r in dualkv_compile.reports()[start:])
        row.update(packed=packed, **(dict(loss=checked[0]) if ref is None else checked))
        ms, peak, _ = time_step(fn, model, batch, args.iters, args.device)
        row.update(status="ok", ms=ms, peak_gb=peak if args.device == "cuda" else None)
        return row, checked if ref is None else None
    except Exception as e:  # noqa: BLE001  (a peer that fails is a row, not a crash)
        where = traceback.extract_tb(e.__traceback__)[-1]
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]
        unmet = unmet_requirements(getattr(fn, "dist", "")) if getattr(fn, "dist", None) else ""
        row.update(status=f"cannot run: {reason} (at {os.path.basename(where.filename)}:{where.lineno})"
                          + (f"; {unmet}" if unmet else ""))
        return row, None
    finally:
        model.config._attn_implementation = "sdpa"
        model.zero_grad(set_to_none=True)
        if args.device == "cuda":  # what a side left (an out-of-memory one's tensors too) is not the next side's peak
            gc.collect()
            torch.cuda.empty_cache()


def markdown(meta, rows):
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    # The speedup is against the fastest way to run the duplicated batch without sharing (plain, compiled, varlen).
    fastest = min((r for r in rows if r["side"].startswith("plain") and r.get("ms")), key=lambda r: r["ms"], default={})
    lines = [f"# Peers: one GRPO step, {meta['model']} ({meta['device']}, {meta['dtype']}, {meta['date']})", "",
             f"- batch: {meta['batch']}; {meta['tokens_duplicated']} valid tokens duplicated, {meta['tokens_unique']} unique",
             f"- torch {meta['torch']}, transformers {meta['transformers']}, trl {meta['trl']}, prefix-grouper "
             f"{meta['prefix_grouper']}, flash-pref {meta['flash_pref']}, kernels {meta['kernels']}, flash-attn "
             f"{meta['flash_attn']}; median of {meta['iters']} steps after 2 warm-up"
             + (f", CPU threads: {meta['threads']}" if meta.get("threads") else ""),
             "- loss / grad rel: against `plain`; grad rel = max over parameters of max|g - g_plain| / max|g_plain|",
             f"- vs fastest plain: {fastest.get('side')}'s step time over the side's", f"- `{meta['command']}`", "",
             "| side | status | packed | tokens | step ms | vs fastest plain | peak GB | loss | loss rel | grad rel | how |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        speed = f"{fastest['ms'] / r['ms']:.2f}x" if fastest and r.get("ms") else "-"
        lines.append(f"| {r['side']} | {r['status']} | {r.get('packed', '-')} | {r.get('tokens', '-')} | {fmt(r.get('ms'), '.1f')} "
                     f"| {speed} | {fmt(r.get('peak_gb'), '.2f')} | {fmt(r.get('loss'), '.6f')} | {fmt(r.get('loss_rel'), '.1e')} "
                     f"| {fmt(r.get('grad_rel'), '.1e')} | {r.get('note', '')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a Qwen3 preset (vocab 151936); shape flags given override it")
    model_flags = dict(layers="num_hidden_layers", hidden="hidden_size", heads="num_attention_heads",
                       kv_heads="num_key_value_heads", head_dim="head_dim", intermediate="intermediate_size")
    for flag in [*model_flags, "vocab"]:  # unset: the preset's, else model_gpu.py's tiny model (vocab 512)
        ap.add_argument(f"--{flag.replace('_', '-')}", type=int)
    for flag, default in (("groups", 2), ("rollouts", 4), ("prompt-len", 48), ("response-len", 12), ("iters", 3)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--ragged", action="store_true", help="response lengths uniform in [R/2, R]")
    ap.add_argument("--compile", action="store_true", help="add plain_compiled (Inductor) and compile plain_varlen")
    ap.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads); 1 gives steady times on shared cores")
    ap.add_argument("--standin", choices=["varlen", "sdpa"], help="the kernel that answers PrefixGrouper's inner "
                    "attention and TRL's FlashAttention-3 call: torch's varlen flash attention (CUDA; the default there) or SDPA")
    ap.add_argument("--inner", default=None, help="dualkv's inner compiler (default inductor on cuda, aot_eager on cpu)")
    ap.add_argument("--sides", default=",".join(s for s in SIDES if s not in ("plain", "plain_compiled")),
                    help="the sides beside plain (which always runs first: the reference)")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(HERE, "results", "peers")))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.standin = args.standin or ("varlen" if args.device == "cuda" else "sdpa")
    args.inner = args.inner or ("inductor" if args.device == "cuda" else "aot_eager")
    sides = [s for s in args.sides.split(",") if s and s != "plain"]
    if args.compile and "plain_compiled" not in sides:
        sides.insert(0, "plain_compiled")
    if set(sides) - set(SIDES):
        ap.error(f"unknown sides {sorted(set(sides) - set(SIDES))}; known: {list(SIDES)}")

    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = dict(SHAPES[args.shape] if args.shape else MODELS["tiny"])
    cfg.update({key: getattr(args, flag) for flag, key in model_flags.items() if getattr(args, flag) is not None})
    vocab = args.vocab or (VOCAB if args.shape else TINY_VOCAB)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, max_position_embeddings=32768, use_cache=False,
                                         tie_word_embeddings=False, attn_implementation="sdpa", **cfg))
    model = model.to(device=args.device, dtype=dtype).train()
    batch = make_batch(args.groups, args.rollouts, args.prompt_len, args.response_len, args.ragged, vocab, args.device)
    valid = int(batch["attention_mask"].sum())
    label = ("qwen3 ({num_hidden_layers} layers, hidden {hidden_size}, heads {num_attention_heads}/{num_key_value_heads}, "
             "head_dim {head_dim}, mlp {intermediate_size}, vocab {v})").format(v=vocab, **cfg)
    meta = dict(
        date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        dtype=str(dtype).removeprefix("torch."), torch=torch.__version__, transformers=version("transformers"),
        trl=version("trl"), prefix_grouper=version("prefix-grouper"), flash_pref=version("flash-pref"),
        kernels=version("kernels"), flash_attn=version("flash-attn"), model=f"{args.shape or 'qwen3'} {label[6:]}",
        threads=torch.get_num_threads() if args.device == "cpu" else None, iters=args.iters,
        command=" ".join(["python"] + sys.argv), tokens_duplicated=valid,
        tokens_unique=valid - (args.rollouts - 1) * args.groups * args.prompt_len,
        batch=f"{args.groups} prompts x {args.prompt_len} tokens, {args.rollouts} responses each of "
              f"{f'{args.response_len // 2}..' if args.ragged else ''}{args.response_len} tokens")
    os.makedirs(args.out, exist_ok=True)

    log(f"{meta['model']} on {meta['device']}: {meta['batch']}; sides plain, {', '.join(sides)}")
    rows, ref = [], None
    for name in ["plain"] + sides:
        log(f"{name}: exactness, warm-up and {args.iters} steps")
        row, checked = run_side(name, model, batch, args, ref)
        ref = checked if name == "plain" else ref
        rows.append(row)
        log(f"{name}: {row['status']}" + (f", {row['ms']:.1f} ms, packed {row['packed']}" if row["status"] == "ok" else "")
            + (f", grad rel {row['grad_rel']:.1e}" if "grad_rel" in row else ""))
        with open(os.path.join(args.out, "peers.json"), "w") as f:  # after every side: a run cut short keeps what it has
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    text = markdown(meta, rows)
    with open(os.path.join(args.out, "peers.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
