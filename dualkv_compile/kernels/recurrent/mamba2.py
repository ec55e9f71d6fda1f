"""The Mamba-2 (SSD) selective scan (Mamba-2, Nemotron-H, Falcon-H1) on the packed prefix forest.

The math is transformers' torch path ``mamba2_chunk_scan`` (``models/mamba2/modeling_mamba2.py``, the same in
``nemotron_h``; mamba-ssm's ``mamba_chunk_scan_combined`` API): ``dt = clamp(softplus?(dt + dt_bias), *dt_limit)``
(in dt's dtype), then per head, with state ``S [P, N]``: ``S = exp(dt_t A) S + dt_t x_t B_t^T;  y_t = S C_t + D
x_t``, B and C shared by the ``H // G`` heads of a group. ``chunk_size=None`` steps token by token (as
``mamba2_selective_state_update``); an int uses the chunked segment-sum form of ``mamba2_chunk_scan``.

Layout (transformers'): x ``[1, T, H, P]``, dt ``[1, T, H]``, A ``[H]`` (negative), B and C ``[1, T, G, N]``, D
and dt_bias ``[H]`` or None; ``segs`` the forest. Guarantees: a token's output is the one it has in every
root-to-leaf sequence through it run alone from a zero state (a segment's scan starts from its parent's final
state); autograd gives the backward, the children's state gradients summed into their parent's final state.
Computed and returned in float32 or the inputs' wider dtype (as transformers, which returns float32);
``output_final_state`` also returns every segment's final state ``[S, H, P, N]``. A forest of depth d is d
batched scans (``levels.forest_scan``); within a segment the reference loops over tokens (or chunks).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from ...layout.segments import Segments
from .levels import forest_scan

__all__ = ["forest_mamba2_scan", "segment_sum"]


def forest_mamba2_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    segs: Segments,
    D: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    dt_limit: tuple = (0.0, float("inf")),
    chunk_size: Optional[int] = None,
    output_final_state: bool = False,
):
    """``y [1, T, H, P]`` (and the segments' final states with ``output_final_state``); see the module."""
    _check(x, dt, A, B, C, D, dt_bias, chunk_size)
    dtype = torch.promote_types(x.dtype, torch.float32)
    H, P, G, N = x.shape[2], x.shape[3], B.shape[2], B.shape[3]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])[0].to(dtype)  # a zero-filled step (dt = 0) keeps S
    xs = x[0].to(dtype)
    BB, CC = (t[0].to(dtype).repeat_interleave(H // G, dim=1, output_size=H) for t in (B, C))
    inputs = [xs * dt[..., None], dt * A.to(dtype), BB, CC]  # dt x, dt A: [T, H, P], [T, H]
    scan = _recurrent_scan if chunk_size is None else functools.partial(_chunk_scan, chunk_size)
    y, final = forest_scan(segs, inputs, scan, (H, P, N), pad_to=chunk_size or 1)
    if D is not None:
        y = y + D.to(dtype)[:, None] * xs
    y = y.unsqueeze(0)
    return (y, final) if output_final_state else y


def _check(x, dt, A, B, C, D, dt_bias, chunk_size) -> None:
    if x.dim() != 4 or x.shape[0] != 1:
        raise ValueError(f"x must be [1, T, H, P], got {list(x.shape)}")
    if dt.shape != x.shape[:3]:
        raise ValueError(f"dt must be [1, T, H] = {list(x.shape[:3])}, got {list(dt.shape)}")
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if t is not None and t.shape != x.shape[2:3]:
            raise ValueError(f"{name} must be [H] = [{x.shape[2]}], got {list(t.shape)}")
    if B.dim() != 4 or B.shape != C.shape or B.shape[:2] != x.shape[:2] or x.shape[2] % B.shape[2]:
        raise ValueError(f"B and C must be [1, T, G, N] with G dividing H, got {list(B.shape)}, {list(C.shape)}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")


def _recurrent_scan(inputs, state):
    """One level, token by token: inputs ``[n, L, H, ...]`` (dt x, dt A, B, C), state ``[n, H, P, N]``."""
    dx, dA, B, C = inputs
    outs = []
    for i in range(dx.shape[1]):
        state = state * dA[:, i].exp()[..., None, None] + dx[:, i, :, :, None] * B[:, i, :, None, :]
        outs.append((state * C[:, i, :, None, :]).sum(dim=-1))
    return torch.stack(outs, dim=1), state


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``segment_sum``: ``[..., L] -> [..., L, L]``, ``out[i, j] = sum x[j+1..i]`` (i >= j), -inf above."""
    L = x.size(-1)
    x = x[..., None].expand(*x.size(), L)
    x = x.masked_fill(~torch.tril(torch.ones(L, L, device=x.device, dtype=torch.bool), diagonal=-1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(L, L, device=x.device, dtype=torch.bool), diagonal=0), -torch.inf)


def _chunk_scan(chunk_size, inputs, state):
    """One level in chunks (``mamba2_chunk_scan``'s four steps); L is a multiple of ``chunk_size``."""
    dx, dA, B, C = inputs
    n, L, H, P = dx.shape
    dx, B, C = (t.reshape(n, -1, chunk_size, *t.shape[2:]) for t in (dx, B, C))  # (b, c, l, h, p|n)
    A = dA.reshape(n, -1, chunk_size, H).permute(0, 3, 1, 2)  # (b, h, c, l)
    A_cumsum = torch.cumsum(A, dim=-1)
    L_mask = torch.exp(segment_sum(A))
    G = torch.einsum("bclhn,bcshn->bclsh", C, B)
    Y_diag = torch.einsum("bclsh,bcshp->bclhp", G * L_mask.permute(0, 2, 3, 4, 1), dx)
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_decay, dx)
    states = torch.cat([state[:, None], states], dim=1)  # the level's initial states: (b, h, p, n)
    decay_chunk = torch.exp(segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    states, final = new_states[:, :-1], new_states[:, -1]
    C_times_states = torch.einsum("bclhn,bchpn->bclhp", C, states)
    Y_off = C_times_states * torch.exp(A_cumsum).permute(0, 2, 3, 1)[..., None]
    return (Y_diag + Y_off).reshape(n, L, H, P), final
