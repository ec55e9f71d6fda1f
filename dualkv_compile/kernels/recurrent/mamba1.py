"""The Mamba (v1) selective scan (Mamba, Falcon-Mamba, Jamba) on the packed prefix forest.

The math is transformers' torch path ``mamba_selective_scan`` (``models/mamba/modeling_mamba.py``; mamba-ssm's
``selective_scan_fn`` API): ``dt = softplus?(dt + delta_bias)``, then per channel d, with state ``S [D, N]``:
``S = exp(A dt_t) S + dt_t B_t x_t;  y_t = S C_t + D x_t``, times ``silu(z_t)`` where z is given. B and C are
shared by every channel. As transformers, the state is kept in float32 (or the inputs' wider dtype) and cast to
x's dtype before it meets C.

Layout (transformers', channels first): x, dt and z ``[1, Dc, T]``, A ``[Dc, N]`` (negative), B and C
``[1, N, T]``, D and delta_bias ``[Dc]`` or None; ``segs`` the forest. Guarantees: a token's output is the one it
has in every root-to-leaf sequence through it run alone from a zero state (a segment's scan starts from its
parent's final state); autograd gives the backward. Returned ``[1, Dc, T]`` in ``mamba1_out_dtype``. A forest of
depth d is d batched scans (``levels.forest_scan``), each looping over its tokens.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ...layout.segments import Segments
from .levels import forest_scan

__all__ = ["forest_selective_scan", "mamba1_out_dtype"]


def mamba1_out_dtype(x_dtype: torch.dtype, D: Optional[torch.Tensor], z: Optional[torch.Tensor]) -> torch.dtype:
    """The dtype transformers' ``mamba_selective_scan`` returns: x's, promoted with D's and z's where given."""
    out = x_dtype
    for t in (D, z):
        if t is not None:
            out = torch.promote_types(out, t.dtype)
    return out


def forest_selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    segs: Segments,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    delta_bias: Optional[torch.Tensor] = None,
    delta_softplus: bool = False,
) -> torch.Tensor:
    """``y [1, Dc, T]``; see the module docstring."""
    _check(x, dt, A, B, C, D, z, delta_bias)
    in_dtype = x.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    work = torch.promote_types(torch.promote_types(A.dtype, dt.dtype), torch.float32)
    # Token-major [T, ...] for the levels; a padded step (dt = 0, x = 0) keeps the state.
    inputs = [dt[0].t().to(work), x[0].t().to(work), B[0].t().to(work), C[0].t().to(in_dtype)]
    A = A.to(work)

    def scan(level_inputs, state):
        dts, xs, Bs, Cs = level_inputs  # [n, L, Dc], [n, L, Dc], [n, L, N], [n, L, N]
        outs = []
        for i in range(dts.shape[1]):
            dA = torch.exp(A[None] * dts[:, i, :, None])
            state = dA * state + dts[:, i, :, None] * Bs[:, i, None, :] * xs[:, i, :, None]
            outs.append((state.to(in_dtype) * Cs[:, i, None, :]).sum(-1))
        return torch.stack(outs, dim=1), state

    y, _ = forest_scan(segs, inputs, scan, (x.shape[1], A.shape[1]))
    y = y.t().unsqueeze(0)  # [1, Dc, T]
    if D is not None:
        y = y + x * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    return y.to(mamba1_out_dtype(in_dtype, D, z))


def _check(x, dt, A, B, C, D, z, delta_bias) -> None:
    if x.dim() != 3 or x.shape[0] != 1:
        raise ValueError(f"x must be [1, D, T], got {list(x.shape)}")
    for name, t in (("dt", dt), ("z", z)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{name} must be [1, D, T] = {list(x.shape)}, got {list(t.shape)}")
    if A.dim() != 2 or A.shape[0] != x.shape[1]:
        raise ValueError(f"A must be [D, N] with D = {x.shape[1]}, got {list(A.shape)}")
    for name, t in (("B", B), ("C", C)):
        if t.shape != (1, A.shape[1], x.shape[2]):
            raise ValueError(f"{name} must be [1, N, T] = [1, {A.shape[1]}, {x.shape[2]}], got {list(t.shape)}")
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        if t is not None and t.shape != x.shape[1:2]:
            raise ValueError(f"{name} must be [D] = [{x.shape[1]}], got {list(t.shape)}")
