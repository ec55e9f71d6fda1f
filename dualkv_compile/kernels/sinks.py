"""Learnable attention sinks (gpt-oss) around any backend's ``(out, lse)``: exact, one softmax.

A sink is one more logit ``s_h`` per query head in every row's softmax
denominator, with no value (docs/design.md, semantics 15). Given a backend's
sink-free ``out`` and ``lse`` (natural log, over the masked scaled scores):

    lse' = logaddexp(lse, s_h)          out' = out * exp(lse - lse')

The backward of the scores is the sink-free backward evaluated at
``(out', lse')``: with ``P' = exp(S - lse')`` (the sink-aware probabilities)
and ``Delta = rowsum(dO * out')``, ``dS = P' * (dP - Delta)``; a backend
whose backward reads the saved ``out`` and ``lse`` (as FlashAttention-2's
does: ``P`` from ``lse``, ``Delta`` from ``out``) computes exactly that when
handed ``out'`` and ``lse'``. The sink's own gradient, the sink column's
``P' * (0 - Delta)`` summed over every row of its head:

    d s_h = -sum_t exp(s_h - lse'_t) * Delta_t

A row with no key (lse = -inf) gets ``lse' = s_h`` and ``out' = 0``.
Accumulates in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["check_sinks", "apply_sinks", "sink_grad"]


def check_sinks(sinks, q: torch.Tensor) -> Optional[str]:
    """None if ``sinks`` (None, or a float tensor ``[Hq]`` on q's device) fits q ``[1, Hq, T, D]``, else why not."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        return f"sinks must be None or a tensor [Hq], got {type(sinks).__name__}"
    if sinks.dim() != 1 or sinks.shape[0] != q.shape[1]:
        return f"sinks must have shape [{q.shape[1]}] (one logit per query head), got {list(sinks.shape)}"
    if not sinks.dtype.is_floating_point:
        return f"sinks must be a floating-point tensor, got dtype {sinks.dtype}"
    if sinks.device != q.device:
        return f"sinks must be on q's device {q.device}, got {sinks.device}"
    return None


def _acc(lse: torch.Tensor) -> torch.dtype:
    return torch.promote_types(lse.dtype, torch.float32)


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out', lse')``: ``out`` ``[1, Hq, T, Dv]`` and ``lse`` ``[1, Hq, T]`` with each head's sink in the denominator."""
    acc = _acc(lse)
    lse = lse.to(acc)
    s = sinks.to(acc)[None, :, None]
    lse_s = torch.logaddexp(lse, s)
    keep = torch.exp(lse - lse_s)  # 0 where the row saw no key
    return (out.to(acc) * keep[..., None]).to(out.dtype), lse_s


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``d sinks`` ``[Hq]`` in sinks' dtype, from ``dout`` and the sink-aware ``out'``, ``lse'`` of ``apply_sinks``."""
    acc = _acc(lse)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # [1, Hq, T]
    p_sink = torch.exp(sinks.to(acc)[None, :, None] - lse.to(acc))
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)
