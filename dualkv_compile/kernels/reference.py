"""Exact reference for prefix-forest attention on the packed stream.

The oracle every fast kernel is tested against, written for clarity rather
than speed: it builds the dense ``[T, T]`` mask of the segments
(``layout.segments.dense_mask``: a token sees its own segment causally and
every ancestor segment fully) and runs one softmax over all of it in float32
or better.

Tensor convention (the same as ``F.scaled_dot_product_attention`` with batch 1):
    q  [1, Hq, T, D],  k, v  [1, Hkv, T, D],  Hq a multiple of Hkv (GQA).
Returns the output ``[1, Hq, T, D]`` in q's dtype and the log-sum-exp
``[1, Hq, T]`` in float32 (float64 for float64 inputs), natural log, scaled
scores. Memory is O(Hq * T^2): use it for tests and small CPU models.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..layout.segments import Segments, dense_mask
from ..layout.shared_prompt import SharedPromptLayout

__all__ = ["shared_prompt_attention", "reference_forward", "reference_backward", "attention_with_mask", "check_qkv"]


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_tokens: int) -> None:
    """Raise ``ValueError`` unless q, k, v follow the packed-stream convention."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4 or t.shape[0] != 1 or t.shape[2] != num_tokens:
            raise ValueError(f"{name} must have shape [1, H, T, D] with T={num_tokens}, got {list(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the packed stream with the layout's prefix-forest mask; returns ``(out, lse)``."""
    check_qkv(q, k, v, layout.num_tokens)
    return reference_forward(q, k, v, layout.attention_segments, scale)


def reference_forward(q, k, v, segs: Segments, scale: Optional[float] = None):
    """``(out, lse)`` of the packed stream described by ``segs``."""
    return attention_with_mask(q, k, v, dense_mask(segs, q.shape[2]), scale)


def reference_backward(dout, q, k, v, out, lse, segs: Segments, scale: Optional[float] = None, deterministic: bool = False):
    """``(dq, dk, dv)`` of the reference forward, recomputed in fp32 or better.

    ``out`` and ``lse`` are unused (the recomputation makes its own); the
    arguments match the fast kernels' backward so the op treats all alike.
    With P the softmax, O = P V and Delta = rowsum(dO * O):
    dV = P^T dO, dS = P * (dO V^T - Delta), dQ = scale * dS K, dK = scale * dS^T Q;
    for GQA, dK and dV are summed over the query heads that share a KV head.
    """
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    groups = q.shape[1] // k.shape[1]
    mask = dense_mask(segs, q.shape[2])
    qf, do = q.to(acc), dout.to(acc)
    kf = k.to(acc).repeat_interleave(groups, dim=1)
    vf = v.to(acc).repeat_interleave(groups, dim=1)
    p = _probs((qf @ kf.transpose(-1, -2)) * scale, mask)
    o = p @ vf
    delta = (do * o).sum(-1, keepdim=True)
    ds = p * (do @ vf.transpose(-1, -2) - delta)
    dq = scale * (ds @ kf)
    dk = scale * (ds.transpose(-1, -2) @ qf)
    dv = p.transpose(-1, -2) @ do

    def per_kv_head(t):
        return t.unflatten(1, (k.shape[1], groups)).sum(2)

    return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)


def _probs(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax of ``scores`` over the keys ``mask`` allows; rows with no key give zeros."""
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse))


def attention_with_mask(q, k, v, mask: torch.Tensor, scale: Optional[float] = None):
    """Masked attention with a ``[T, T]`` boolean mask; rows with no key give zeros and lse = -inf."""
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    groups = q.shape[1] // k.shape[1]
    k = k.to(acc).repeat_interleave(groups, dim=1)
    v = v.to(acc).repeat_interleave(groups, dim=1)
    scores = (q.to(acc) @ k.transpose(-1, -2)) * scale
    # One softmax over everything the row sees (ancestor segments and its own tokens).
    lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = _probs(scores, mask) @ v
    return out.to(q.dtype), lse


# The kernel-module protocol the op dispatches through (see op.py).
def supports(q: torch.Tensor) -> Optional[str]:
    return None


forward = reference_forward
backward = reference_backward
