"""The short depthwise causal convolution of GDN and Mamba layers on the packed prefix forest.

The math is transformers' torch fallback ``causal_conv1d_fn`` (``models/qwen3_next``, ``mamba2``, ``nemotron_h``):
``out[c, t] = bias[c] + sum_j weight[c, j] x[c, t - (K-1) + j]``, a zero before the sequence's start, then the
activation (None, "silu" or "swish"). On the forest the K-1 inputs before a token run back along its path: into
its parent segment's last tokens, and the grandparent's where the parent is shorter than K-1, zero before the
root's start (``layout.segments.previous_token_index`` walked K-1 times; a root's first token maps to itself,
where the path ends). So a token's output is the one it has in every root-to-leaf sequence through it.

Layout (transformers'): x ``[1, C, T]`` (channels first, the packed stream), weight ``[C, K]``, bias ``[C]`` or
None; ``segs`` the forest. Assumes no segment with children is empty (the layout builds none; ``ValueError``
otherwise). Computed in weight's dtype, returned in x's (as transformers); K-1 gathers, no loop over tokens or
segments; autograd gives the backward (a parent's last inputs get the gradient of every child that reads them).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ...layout.segments import Segments, previous_token_index
from .levels import host_table

__all__ = ["forest_causal_conv1d", "causal_conv1d_along_paths", "ACTIVATIONS"]

ACTIVATIONS = {None: lambda x: x, "silu": F.silu, "swish": F.silu}


def forest_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    segs: Segments,
    activation: Optional[str] = None,
) -> torch.Tensor:
    """``out [1, C, T]``: see the module."""
    if x.dim() != 3 or x.shape[0] != 1 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"x must be [1, C, T] and weight [C, K], got {list(x.shape)} and {list(weight.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [C] = [{weight.shape[0]}], got {list(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(map(str, ACTIVATIONS))}, got {activation!r}")
    _check_no_empty_parent(segs)
    return causal_conv1d_along_paths(x, weight, bias, previous_token_index(segs, x.shape[2]), activation)


def causal_conv1d_along_paths(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], prev: torch.Tensor,
    activation: Optional[str] = None,
) -> torch.Tensor:
    """``out [1, C, T]`` with the K-1 inputs before each token read through ``prev`` (int64 [T], each token's
    predecessor on its path; a path's first token maps to itself, where zeros begin). Torch ops only, no host
    sync: the packed graph traces it (``ops.forest_recurrent``)."""
    T, K = x.shape[2], weight.shape[1]
    xs = x[0].to(weight.dtype)  # [C, T]
    idx = torch.arange(T, device=x.device)
    alive = torch.ones(T, dtype=torch.bool, device=x.device)
    out = xs * weight[:, K - 1 : K]  # tap K-1 reads the token itself
    for back in range(1, K):  # tap K-1-back reads the token `back` steps up the path
        step = prev[idx]
        alive = alive & (step != idx)  # the walk stopped at the path's first token: zeros from here
        idx = step
        out = out + torch.where(alive[None, :], xs[:, idx], 0) * weight[:, K - 1 - back : K - back]
    if bias is not None:
        out = out + bias[:, None]
    return ACTIVATIONS[activation](out).unsqueeze(0).to(x.dtype)


def _check_no_empty_parent(segs: Segments) -> None:
    _, length, parent = host_table(segs)
    empty = sorted({p for p in parent if p >= 0 and length[p] == 0})
    if empty:
        raise ValueError(f"segments {empty} are empty but have children: the convolution's path would skip them")
