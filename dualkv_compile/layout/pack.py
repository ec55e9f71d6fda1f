"""``pack`` and ``unpack``: move ``[B, S, ...]`` values to and from the packed ``[T, ...]`` stream of a layout.

Both are differentiable index maps: ``pack`` reads each node of the prefix
forest from its first sequence; ``unpack`` writes zeros at padding and its
backward sums the gradient of a shared token over every sequence that reads it.
"""

from __future__ import annotations

import torch

from .shared_prompt import SharedPromptLayout

__all__ = ["pack", "unpack", "gather_valid"]


def pack(x: torch.Tensor, layout: SharedPromptLayout) -> torch.Tensor:
    """``[B, S, *rest]`` -> ``[T, *rest]``: each node of the prefix forest once, in pre-order."""
    B, S = layout.batch_size, layout.seq_len
    if x.dim() < 2 or x.shape[0] != B or x.shape[1] != S:
        raise ValueError(f"x must have shape [B, S, ...] with B={B}, S={S}, got {list(x.shape)}")
    return x.reshape(B * S, *x.shape[2:]).index_select(0, layout.pack_index)


def unpack(x: torch.Tensor, layout: SharedPromptLayout) -> torch.Tensor:
    """``[T, *rest]`` -> ``[B, S, *rest]``; zeros at padding; gradients of shared tokens summed over sequences."""
    T = layout.num_tokens
    if x.dim() < 1 or x.shape[0] != T:
        raise ValueError(f"x must have shape [T, ...] with T={T}, got {list(x.shape)}")
    if T == 0:  # every row empty: index_select cannot read from an empty axis
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    out = gather_valid(x, layout.unpack_index, layout.valid)
    return out.reshape(layout.batch_size, layout.seq_len, *x.shape[1:])


def gather_valid(x: torch.Tensor, index: torch.Tensor, keep: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``x.index_select(dim, index)`` with zeros where ``keep`` is False (padding positions).

    Differentiable: the backward sums the gradients of entries read more than
    once (a shared token read by every row of its group).
    """
    y = x.index_select(dim, index)
    shape = [1] * y.dim()
    shape[dim] = -1
    return torch.where(keep.view(shape), y, y.new_zeros(()))
