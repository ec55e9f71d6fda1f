"""The sides of ``peers.py`` (issue 36): one GRPO step per shared-prefix method, each in the layout it asks for.

Assumes the batch of ``make_batch`` (rows group by group, [prompt | response | right pad], every prompt of one length)
and a Hugging Face Qwen3 or Qwen3-MoE model whose ``config._attn_implementation`` the caller sets to the side's
attention before calling its loss. Each ``SIDES[name](model, batch, args)`` returns a ``Side``: the loss function of
``(model, batch)``, the attention implementation it needs, and what its layout computes -- ``tokens`` (the rows the
linear layers and lm_head run on, padding included where the layout carries it) and ``pairs`` (the query/key pairs a
causal kernel over the layout's sequences needs: ``n (n + 1) / 2`` per padded row or per sequence, the prefix's pairs
once where the prefix is shared, each token's root path in TRL's trie) -- which ``peers.py`` turns into FLOPs. A
masked dense kernel (SDPA with a mask) may compute more pairs than counted; the count is the layout's, not the
kernel's. Every side's loss is ``mean(-logp * advantage)`` over the response tokens, so its loss and gradients equal
the plain side's up to rounding. Library-style: no prints; a side that cannot run raises. Imported by ``peers.py``,
which puts the repository and ``benchmarks/`` on ``sys.path``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Callable, NamedTuple, Optional
from unittest import mock

import torch

import dualkv_compile
from benchmarks.model.model_remove_padding import chunked_next_token_logp
from benchmarks.ops import varlen_attention  # noqa: F401  (registers torch_varlen)


class Side(NamedTuple):
    loss: Callable  # (model, batch) -> scalar loss
    attn: str  # the attention implementation the model runs with
    tokens: int  # rows through the linear layers and lm_head
    pairs: int  # query/key pairs the layout's attention needs
    packed: Optional[bool]  # None: decided from dualkv's reports after the first call
    note: str


def causal_pairs(n: int) -> int:
    return n * (n + 1) // 2


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


def side_plain(model, batch, args, compiled=False):
    fn, how = (torch.compile(grpo_loss, dynamic=False), "Inductor") if compiled else (grpo_loss, "eager")
    B, S = batch["input_ids"].shape
    return Side(fn, "sdpa", B * S, B * causal_pairs(S), False, f"duplicated padded batch, SDPA, {how}")


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
    return Side(fn, "torch_varlen", int(keep.sum()), sum(causal_pairs(int(n)) for n in lens), False,
                f"remove padding, {varlen_attention.kernel_name()}, chunked log-probs"
                + (", Inductor" if args.compile else ""))


def side_dualkv(model, batch, args):
    stats = dualkv_compile.detect(batch["input_ids"], batch["attention_mask"]).stats()
    return Side(dualkv_compile.policy_loss(grpo_loss, inner=args.inner, packed_compile=args.packed_compile), "sdpa",
                stats.tokens_after, stats.attention_pairs_after, None,
                f"@policy_loss, inner {args.inner}, packed graph compiled {args.packed_compile}")


def side_prefix_grouper(model, batch, args):
    from prefix_grouper import PrefixGrouper
    from prefix_grouper.utils.register_transformers import register_attention
    from transformers import AttentionInterface

    register_attention()  # (transformers builds no mask for an attention it has no mask function for: none is needed)
    inner = "flash_attention_2" if args.device == "cuda" and version("flash-attn") else "flash_style"
    AttentionInterface.register("flash_style", functools.partial(flash_style_attention, varlen=args.standin == "varlen"))
    N = args.rollouts

    def layout(batch):
        pg = PrefixGrouper.from_ungrouped_masks(prefix_mask=batch["prompt_mask"], suffix_mask=batch["completion_mask"],
                                                group_sizes=N, padding_mode="right", device=batch["input_ids"].device)
        ids = pg.concat_input(batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"])
        # Its README: each response's positions continue from the prefix, [0..p-1, p..p+r1-1, p..p+r2-1, ...].
        pos = torch.zeros_like(ids)
        for i, info in enumerate(pg.group_info):
            p, at = info.prefix_len, functools.partial(torch.arange, device=ids.device)
            pos[i, : p + sum(info.suffix_lens)] = torch.cat([at(p)] + [at(p, p + r) for r in info.suffix_lens])
        return pg, ids, pos

    def loss(model, batch):
        pg, ids, pos = layout(batch)
        logits = model(input_ids=ids, position_ids=pos, prefix_grouper=pg, prefix_grouper_attn_func=inner).logits
        _, _, suffix, suffix_mask = pg.split_output(logits, include_prefix_last=1)
        targets = pg.convert_padding(batch["completion_ids"], batch["completion_mask"], padding_mode="right")
        logp = torch.log_softmax(suffix[:, :-1].float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return masked_mean_loss(logp, batch["advantages"][:, None], suffix_mask[:, 1:])

    # Its rows [prefix | suffixes | pad] run whole through the linear layers; its attention is the prefix's causal
    # pairs once plus each suffix against the prefix and itself.
    pg, ids, _ = layout(batch)
    pairs = sum(causal_pairs(g.prefix_len) + sum(r * g.prefix_len + causal_pairs(r) for r in g.suffix_lens)
                for g in pg.group_info)
    loss.dist = "prefix-grouper"
    return Side(loss, "prefix_grouper_attention", int(ids.numel()), pairs, True,
                f"register_attention, inner attention {inner}" + (
                    f" ({varlen_attention.kernel_name() if args.standin == 'varlen' else 'SDPA'})"
                    if inner == "flash_style" else ""))


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
        f" with {varlen_attention.kernel_name() if args.standin == 'varlen' else 'SDPA'} standing in for its FlashAttention-3"
        " kernel" if stand_in else " (kernels-community/flash-attn3)")
    # Each token of the trie attends to its root path, its depth + 1 keys (the position ids are the depths).
    return Side(loss, packing.TREE_ATTENTION, int(p["input_ids"].numel()), int((p["position_ids"] + 1).sum()), True, note)


def side_flash_pref(model, batch, args):
    from flash_pref import shared_prefix

    attn = "flash_attention_2" if args.device == "cuda" and version("flash-attn") else "sdpa"

    def loss(model, batch):
        with shared_prefix(model, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], group_size=args.rollouts):
            return grpo_loss(model, batch)

    tokens = int(batch["attention_mask"].sum()) - (args.rollouts - 1) * args.groups * args.prompt_len
    # It shares attention only under FlashAttention-2; else each padded row attends whole.
    B, S = batch["input_ids"].shape
    pairs = (dualkv_compile.detect(batch["input_ids"], batch["attention_mask"]).stats().attention_pairs_after
             if attn == "flash_attention_2" else B * causal_pairs(S))
    loss.dist = "flash-pref"
    return Side(loss, attn, tokens, pairs, True,
                f"shared_prefix, {attn}" + ("" if attn == "flash_attention_2" else " (attention unshared)"))


SIDES = {"plain": side_plain, "plain_compiled": functools.partial(side_plain, compiled=True),
         "plain_varlen": side_plain_varlen, "dualkv": side_dualkv, "prefix_grouper": side_prefix_grouper,
         "trl_prefix_tree": functools.partial(side_trl, stand_in=False),
         "trl_prefix_tree_standin": functools.partial(side_trl, stand_in=True), "flash_pref": side_flash_pref}
