"""Exact reference for prefix-forest attention on the packed stream.

The oracle every fast kernel is tested against, written for clarity rather than speed: the dense ``[T, T]`` mask
of the segments (``layout.segments.dense_mask``: a token sees its own segment causally and every ancestor segment
fully) and one softmax over all of it in float32 or better.

Tensors (``F.scaled_dot_product_attention``'s convention with batch 1): q ``[1, Hq, T, D]``, k ``[1, Hkv, T, D]``,
v ``[1, Hkv, T, Dv]``, Hq a multiple of Hkv (GQA); v's head dim may differ from q's and k's (MLA: 192 and 128 in
DeepSeek-V3). Returns the output ``[1, Hq, T, Dv]`` in q's dtype and the log-sum-exp ``[1, Hq, T]`` in float32
(float64 for float64 inputs), natural log, of the scaled (and capped) scores. Memory O(Hq * T^2): for tests and
small CPU models. In the backward, dK and dV (sums over every query that reads a key: N rows' worth for a prompt
shared by N) are summed in float64 by blocks of queries, so their float32 error does not grow with N.

A logit softcap ``c > 0`` (Gemma 2's ``attn_logit_softcapping``; 0: none) makes the score ``s = scale * q.k``
``c * tanh(s / c)`` before the mask and the softmax; its derivative ``1 - tanh^2`` enters dQ and dK. Windows
(``window``, ``chunk``; 0: none) narrow the mask by token depth. The backward reads the saved ``lse`` for the
probabilities, as the fast kernels' do, so a softmax with sinks (``kernels.sinks``) differentiates exactly.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..layout.segments import Segments, dense_mask
from ..layout.shared_prompt import SharedPromptLayout

__all__ = ["shared_prompt_attention", "reference_forward", "reference_backward", "attention_with_mask", "backward_with_mask",
           "check_qkv"]


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_tokens: int) -> None:
    """Raise ``ValueError`` unless q, k, v follow the packed-stream convention."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4 or t.shape[0] != 1 or t.shape[2] != num_tokens:
            raise ValueError(f"{name} must have shape [1, H, T, D] with T={num_tokens}, got {list(t.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same shape but for the head dim, got {list(k.shape)} and {list(v.shape)}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[3]} and {k.shape[3]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q's heads ({q.shape[1]}) must be a multiple of k's heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def shared_prompt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SharedPromptLayout,
    scale: Optional[float] = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the packed stream with the layout's prefix-forest mask; returns ``(out, lse)``."""
    check_qkv(q, k, v, layout.num_tokens)
    return reference_forward(q, k, v, layout.attention_segments, scale, softcap)


def reference_forward(q, k, v, segs: Segments, scale: Optional[float] = None, softcap: float = 0.0, window: int = 0,
                      chunk: int = 0):
    """``(out, lse)`` of the packed stream described by ``segs`` (under the windows)."""
    return attention_with_mask(q, k, v, dense_mask(segs, q.shape[2], window, chunk), scale, softcap)


def reference_backward(dout, q, k, v, out, lse, segs: Segments, scale: Optional[float] = None, deterministic: bool = False,
                       softcap: float = 0.0, window: int = 0, chunk: int = 0):
    """``(dq, dk, dv)`` of the reference forward, recomputed in fp32 or better from the saved ``lse``.

    ``out`` is unused (Delta comes from the recomputed output, which the saved lse
    makes equal to it); the arguments match the fast kernels' backward.
    """
    return backward_with_mask(dout, q, k, v, dense_mask(segs, q.shape[2], window, chunk), scale, softcap, lse=lse)


def backward_with_mask(dout, q, k, v, mask: torch.Tensor, scale: Optional[float] = None, softcap: float = 0.0,
                       lse: Optional[torch.Tensor] = None):
    """``(dq, dk, dv)`` of ``attention_with_mask`` (any leading batch dim; ``mask`` broadcast to the scores).

    ``lse`` (the forward's, ``[.., Hq, Tq]``; None: recomputed): P = exp(S - lse) on the mask. A saved
    lse larger than the scores' own (a sink's, ``kernels.sinks``) gives that softmax's gradient.
    With P the softmax of the (capped) scores, O = P V and Delta = rowsum(dO * O):
    dV = P^T dO, dS = P * (dO V^T - Delta), times ``1 - tanh^2(s / c)`` under a softcap c,
    dQ = scale * dS K, dK = scale * dS^T Q; for GQA, dK and dV are summed over the query
    heads that share a KV head. The sums over queries of dK and dV are float64 (``_sum_over_queries``).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    groups = q.shape[1] // k.shape[1]
    qf, do = q.to(acc), dout.to(acc)
    kf = k.to(acc).repeat_interleave(groups, dim=1)
    vf = v.to(acc).repeat_interleave(groups, dim=1)
    scores, tanh = _scores(qf, kf, scale, softcap)
    p = _probs(scores, mask) if lse is None else _probs_from_lse(scores, mask, lse.to(acc))
    o = p @ vf
    delta = (do * o).sum(-1, keepdim=True)
    ds = p * (do @ vf.transpose(-1, -2) - delta)
    if tanh is not None:
        ds = ds * (1 - tanh * tanh)
    dq = scale * (ds @ kf)
    dk = scale * _sum_over_queries(ds, qf)
    dv = _sum_over_queries(p, do)

    def per_kv_head(t):
        return t.unflatten(1, (k.shape[1], groups)).sum(2)

    return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)


# Query rows per block of the float64 key-gradient sums: a [.., T, 256] float64 copy at a time, never a [T, T] one.
_QUERY_BLOCK = 256


def _sum_over_queries(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a^T b`` summed over the query axis (a ``[.., Tq, Tk]``, b ``[.., Tq, D]``) in float64, returned in a's dtype.

    A key's dK and dV sum one term per query that reads it: for a prompt shared by N rows, N times its
    readers. One float32 matmul over all of them carried an error that grew with N (issue 35, defect 5);
    in float64 the sum is exact to float32's precision whatever N, and the blocks keep the float64 copies small.
    """
    out = torch.zeros((*a.shape[:-2], a.shape[-1], b.shape[-1]), dtype=torch.float64, device=a.device)
    for start in range(0, a.shape[-2], _QUERY_BLOCK):
        rows = slice(start, start + _QUERY_BLOCK)
        out += a[..., rows, :].transpose(-1, -2).double() @ b[..., rows, :].double()
    return out.to(a.dtype)


def _scores(q, k, scale: float, softcap: float):
    """The scores ``scale * q k^T``, capped to ``softcap * tanh(. / softcap)`` when softcap > 0; and that tanh (or None)."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if not softcap:
        return scores, None
    tanh = torch.tanh(scores / softcap)
    return tanh * softcap, tanh


def _probs(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax of ``scores`` over the keys ``mask`` allows; rows with no key give zeros."""
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse))


def _probs_from_lse(scores: torch.Tensor, mask: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(scores - lse)`` on the mask; rows whose lse is -inf (no key) or +inf (padding rows) give zeros."""
    lse = lse[..., None]
    p = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse))
    return p.masked_fill(~mask | torch.isinf(lse), 0.0)


def attention_with_mask(q, k, v, mask: torch.Tensor, scale: Optional[float] = None, softcap: float = 0.0):
    """Masked attention with a ``[T, T]`` boolean mask (or any mask broadcast to the scores, with any leading
    batch dim); rows with no key give zeros and lse = -inf."""
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    groups = q.shape[1] // k.shape[1]
    k = k.to(acc).repeat_interleave(groups, dim=1)
    v = v.to(acc).repeat_interleave(groups, dim=1)
    scores, _ = _scores(q.to(acc), k, scale, softcap)
    # One softmax over everything the row sees (ancestor segments and its own tokens).
    lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = _probs(scores, mask) @ v
    return out.to(q.dtype), lse


# The kernel-module protocol the op dispatches through (see ops/attention.py).
def supports(q: torch.Tensor, v: Optional[torch.Tensor] = None, *, window: int = 0, chunk: int = 0,
             sinks: bool = False, softcap: float = 0.0) -> Optional[str]:
    return None


forward = reference_forward
backward = reference_backward
