"""``linear_log_prob_entropy``: next-token log-probs and every row's entropy from the hidden states, in chunks.

The math of ``dualkv::linear_log_prob_entropy`` and ``_entropy_bwd`` (registered in ``ops/linear_log_prob.py``);
inputs, ``post``, dtypes and chunk size as in ``kernels.linear_log_prob``. With ``logp =
log_softmax(post(linear(hidden, weight)))`` (``[N, V]``, never built whole) the forward returns

    out[t, k]   = logp[rows[t], index[t, k]]                      [T, K], as the plain op
    entropy[n]  = -sum_v exp(logp[n, v]) * logp[n, v]               [N], every row of ``hidden``
    lse[n]      = logsumexp_v post(linear(hidden, weight))[n, v]    [N], kept for the backward

``entropy`` and ``lse`` are in the compute dtype. Chunks run over rows of ``hidden``, each row's logits computed
once per pass; every chunk masks all T outputs (``O(T * K)``: looking up which read it would be a host sync). The
working set is the plain op's; the backward recomputes each chunk's logits from ``hidden``, ``weight``, ``lse`` and
``entropy``, with ``p = exp(logp)`` and ``G[n]`` the sum of ``g[t, :]`` over the outputs reading row n:

    d z[n] = scatter of g[t, k] at (rows[t] = n, index[t, k]) - p[n] * (G[n] + g_ent[n] * (logp[n] + entropy[n]))

then back through ``post`` as the plain op goes. Numerics: ``logp`` rounds as the log-softmax kernels round it;
the entropy is ``-(exp(logp) * logp).sum(-1)``, the unfused graph's own expression (more: docs/design.md,
"Chunked log-probs"); a ``-inf`` logit makes the row's entropy NaN, as unfused. Assumed, not checked: every
``rows`` entry in ``[0, N)`` (an output whose row is in no chunk would read 0), every ``index`` entry in ``[0, V)``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .linear_log_prob import _chunk_fn, _compute_dtype, _mm, _mm_accumulate, _post, _post_grad, chunk_rows, dtypes

__all__ = ["forward", "backward", "chunk_entropy", "chunk_entropy_grad"]


def chunk_entropy(y, scale, divide, scale_first, upcast, cd: torch.dtype, inplace: bool):
    """(logp [C, V], lse [C], entropy [C]) of one chunk from its raw lm_head output ``y`` [C, V]."""
    y = _post(y, scale, divide, scale_first, upcast, inplace).to(cd)
    m = y.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row of -inf: no nan from -inf - -inf
    if inplace:
        z = y.sub_(m)
        p = z.exp()
        log_sum = p.sum(dim=-1, keepdim=True).log_()
        logp = z.sub_(log_sum)
        entropy = torch.exp(logp, out=p).mul_(logp).sum(dim=-1).neg_()
    else:
        z = y - m
        log_sum = z.exp().sum(dim=-1, keepdim=True).log()
        logp = z - log_sum
        entropy = -(logp.exp() * logp).sum(dim=-1)
    return logp, (m + log_sum).squeeze(-1), entropy


def chunk_entropy_grad(
    y, g_row, g_ent, lse, entropy, flat_index, g_flat, scale, divide, scale_first, upcast, cd: torch.dtype, inplace: bool
):
    """The gradient of one chunk's raw lm_head output ``y`` [C, V] (its dtype).

    ``g_row`` [C]: the summed gradients of the log-probs read from each row; ``g_ent`` [C]: the entropy's;
    ``flat_index``, ``g_flat`` [T, K]: where in the flattened chunk each picked log-prob's gradient goes, and
    its value (zero for outputs outside the chunk). Absent terms are None; at least one of ``g_row``, ``g_ent``.
    """
    logits_dtype = y.dtype
    logp = _post(y, scale, divide, scale_first, upcast, inplace).to(cd)
    if inplace:
        p = logp.sub_(lse[:, None]).exp()
    else:
        logp = logp - lse[:, None]
        p = logp.exp()
    # d = -p * c with c = G + g_ent * (logp + H), per row.
    if g_ent is None:
        c = g_row[:, None]
    elif inplace:
        c = logp.add_(entropy[:, None]).mul_(g_ent[:, None])
        c = c if g_row is None else c.add_(g_row[:, None])
    else:
        c = (logp + entropy[:, None]) * g_ent[:, None]
        c = c if g_row is None else c + g_row[:, None]
    d = p.mul_(c).neg_() if inplace else -(p * c)
    if flat_index is not None:
        flat = d.view(-1)
        flat = flat.index_add_(0, flat_index.reshape(-1), g_flat.reshape(-1)) if inplace else flat.index_add(0, flat_index.reshape(-1), g_flat.reshape(-1))
        d = flat.view(d.shape)
    return _post_grad(d, logits_dtype, scale, divide, scale_first, upcast, inplace)


def _in_chunk(rows: torch.Tensor, n0: int, n1: int):
    """For every output: its row's place in chunk ``[n0, n1)`` (clamped into it), and whether the row is there."""
    return (rows - n0).clamp_(0, n1 - n0 - 1), (rows >= n0) & (rows < n1)


def forward(hidden, weight, rows, index, scale, divide, scale_first, upcast, chunk_bytes):
    """(out [T, K], entropy [N], lse [N]); see the module docstring."""
    out_dtype, cd = dtypes(hidden.dtype, upcast)
    N = hidden.shape[0]
    out = torch.zeros(index.shape, dtype=out_dtype, device=hidden.device)
    entropy = torch.empty(N, dtype=cd, device=hidden.device)
    lse = torch.empty(N, dtype=cd, device=hidden.device)
    C = chunk_rows(weight.shape[0], cd, chunk_bytes)
    chunk_forward, inplace = _chunk_fn(chunk_entropy, hidden.device)
    for n0 in range(0, N, C):
        n1 = min(n0 + C, N)
        logp, lse[n0:n1], entropy[n0:n1] = chunk_forward(F.linear(hidden[n0:n1], weight), scale, divide, scale_first, upcast, cd, inplace)
        if index.numel():
            local, here = _in_chunk(rows, n0, n1)
            out = torch.where(here[:, None], logp[local[:, None], index].to(out_dtype), out)
        del logp
    return out, entropy, lse


def backward(
    grad: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor], hidden, weight, rows, index, lse, entropy,
    scale, divide, scale_first, upcast, chunk_bytes, need_hidden, need_weight,
):
    """(d_hidden, d_weight), each empty where not needed; ``grad``/``grad_entropy`` None for an unused output."""
    logits_dtype = hidden.dtype
    _, cd = dtypes(logits_dtype, upcast)
    acc_dtype = _compute_dtype(logits_dtype)
    N, V = hidden.shape[0], weight.shape[0]
    # zeros: what stays if neither output has a gradient.
    d_hidden = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
    d_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_weight else None
    picked = grad is not None and index.numel() > 0
    if (picked or grad_entropy is not None) and (need_hidden or need_weight):
        g = grad.to(cd) if picked else None
        # G[n]: every output reading row n adds its gradients' sum (index_add over rows, no host sync).
        g_row_all = torch.zeros(N, dtype=cd, device=hidden.device).index_add_(0, rows, g.sum(dim=-1)) if picked else None
        g_ent_all = grad_entropy.to(cd) if grad_entropy is not None else None
        C = chunk_rows(V, cd, chunk_bytes)
        chunk_grad, inplace = _chunk_fn(chunk_entropy_grad, hidden.device)
        for n0 in range(0, N, C):
            n1 = min(n0 + C, N)
            h = hidden[n0:n1]
            g_row = g_ent = flat_index = g_flat = None
            if picked:
                local, here = _in_chunk(rows, n0, n1)
                flat_index = local[:, None] * V + index
                g_flat = torch.where(here[:, None], g, torch.zeros_like(g))
                g_row = g_row_all[n0:n1]
            if g_ent_all is not None:
                g_ent = g_ent_all[n0:n1]
            d = chunk_grad(
                F.linear(h, weight), g_row, g_ent, lse[n0:n1], entropy[n0:n1], flat_index, g_flat,
                scale, divide, scale_first, upcast, cd, inplace,
            )
            if need_hidden:
                d_hidden[n0:n1] = _mm(d, weight, acc_dtype)  # rounded once to hidden's dtype
            if need_weight:
                _mm_accumulate(d_weight, d.t(), h)
            del d
    empty = hidden.new_empty(0)
    return (d_hidden if need_hidden else empty, d_weight.to(weight.dtype) if need_weight else empty)
