"""The gated delta rule (GDN linear attention: Qwen3-Next, Qwen3.5, OLMo-hybrid; Kimi's KDA) on the packed forest.

The math is transformers' torch fallback (``models/qwen3_next/modeling_qwen3_next.py``): per head, with state
``S [Dk, Dv]``, ``S = exp(g_t) S;  S = S + k_t (beta_t (v_t - k_t^T S))^T;  o_t = (scale q_t)^T S``, q and k
optionally L2-normalised first (``use_qk_l2norm``, eps 1e-6) and repeated to the value heads (GQA: each q/k head
serves ``Hv // Hk`` consecutive value heads). ``chunk_size=None`` steps token by token as
``torch_recurrent_gated_delta_rule``; an int uses the chunked (UT-transform) form of ``torch_chunk_gated_delta_rule``.

Layout (transformers' ``[B, T, H, D]`` with B = 1, the packed stream): q, k ``[1, T, Hk, Dk]``, v ``[1, T, Hv,
Dv]``, g (log decay, <= 0 for the chunked form's exps) and beta ``[1, T, Hv]``, or g ``[1, T, Hv, Dk]``: a decay
per key channel (Kimi's KDA, transformers' ``chunk_kimi_delta_attention``: ``S = diag(exp(g_t)) S``), which
steps token by token whatever ``chunk_size`` (the same math; only rounding differs); ``segs`` the forest
(``layout.segments.Segments``). Guarantees: a token's output is the one it has in every root-to-leaf sequence
through it run alone from a zero state (a segment's scan starts from its parent's final state); autograd gives
the backward, the children's state gradients summed into their parent's final state. Computed in float32 or the
inputs' wider dtype, returned in q's dtype (as transformers); ``output_final_state`` also returns every
segment's final state ``[S, Hv, Dk, Dv]`` in the compute dtype. A forest of depth d is d batched scans
(``levels.forest_scan``); within a segment the reference loops over tokens (or chunks).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ...layout.segments import Segments
from .levels import forest_scan

__all__ = ["forest_gated_delta_rule", "l2norm"]


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """transformers' (and flash-linear-attention's) ``x * rsqrt(sum(x^2) + eps)``."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def forest_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    segs: Segments,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
    chunk_size: Optional[int] = None,
    output_final_state: bool = False,
):
    """``out [1, T, Hv, Dv]`` (and the segments' final states with ``output_final_state``); see the module."""
    _check(q, k, v, g, beta, chunk_size)
    dtype = torch.promote_types(q.dtype, torch.float32)
    rep = v.shape[2] // k.shape[2]
    qq, kk = (x[0].to(dtype) for x in (q, k))
    if rep > 1:
        qq, kk = (x.repeat_interleave(rep, dim=1) for x in (qq, kk))
    if use_qk_l2norm:
        qq, kk = l2norm(qq), l2norm(kk)
    qq = qq * (q.shape[-1] ** -0.5 if scale is None else scale)
    inputs = [qq, kk, v[0].to(dtype), g[0].to(dtype), beta[0].to(dtype)]
    if g.dim() == 4:  # a decay per key channel: the token-by-token form
        chunk_size = None
    scan = _recurrent_scan if chunk_size is None else functools.partial(_chunk_scan, chunk_size)
    state_shape = (v.shape[2], k.shape[3], v.shape[3])
    out, final = forest_scan(segs, inputs, scan, state_shape, pad_to=chunk_size or 1)
    out = out.unsqueeze(0).to(q.dtype)
    return (out, final) if output_final_state else out


def _check(q, k, v, g, beta, chunk_size) -> None:
    if q.dim() != 4 or q.shape[0] != 1 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [1, T, Hk, Dk], got {list(q.shape)} and {list(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != q.shape[:2] or v.shape[2] % q.shape[2]:
        raise ValueError(f"v must be [1, T, Hv, Dv] with Hv a multiple of Hk, got {list(v.shape)} for q {list(q.shape)}")
    if beta.shape != v.shape[:3]:
        raise ValueError(f"beta must be [1, T, Hv] = {list(v.shape[:3])}, got {list(beta.shape)}")
    if g.shape != v.shape[:3] and g.shape != v.shape[:3] + k.shape[3:]:
        raise ValueError(f"g must be [1, T, Hv] = {list(v.shape[:3])} or [1, T, Hv, Dk] = "
                         f"{list(v.shape[:3] + k.shape[3:])}, got {list(g.shape)}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")


def _recurrent_scan(inputs, state):
    """One level, token by token (``torch_recurrent_gated_delta_rule``'s loop): inputs ``[n, L, H, ...]``, state
    ``[n, H, Dk, Dv]``; g ``[n, L, H]`` or ``[n, L, H, Dk]``. A zero-filled step (g = beta = 0, k = 0) leaves the
    state as it is."""
    q, k, v, g, beta = (x.transpose(1, 2) for x in inputs)
    outs = []
    for i in range(q.shape[2]):
        decay = g[:, :, i].exp()
        state = state * (decay[..., None] if decay.dim() == 3 else decay[..., None, None])
        kv_mem = (state * k[:, :, i].unsqueeze(-1)).sum(dim=-2)
        delta = (v[:, :, i] - kv_mem) * beta[:, :, i].unsqueeze(-1)
        state = state + k[:, :, i].unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((state * q[:, :, i].unsqueeze(-1)).sum(dim=-2))
    return torch.stack(outs, dim=1), state


def _chunk_scan(chunk_size, inputs, state):
    """One level in chunks (``torch_chunk_gated_delta_rule``'s two phases); L is a multiple of ``chunk_size``."""
    q, k, v, g, beta = (x.transpose(1, 2) for x in inputs)
    n, H, L, Dv = v.shape
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(n, H, -1, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(n, H, -1, chunk_size).cumsum(dim=3)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        ut_system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outs = []
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outs.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(n, H, L, Dv)
    return out.transpose(1, 2), state
