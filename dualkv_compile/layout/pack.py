"""``pack`` and ``unpack``: move ``[B, S, ...]`` values to and from the packed ``[T, ...]`` stream of a layout.

Both are differentiable index maps: ``pack`` reads each node of the prefix
forest from its first sequence; ``unpack`` writes zeros at padding and its
backward sums the gradient of a shared token over every sequence that reads it.

``gather_valid`` (the gather under ``unpack`` and ``packed_ops.unpack_tokens``)
takes one of two equivalent forms by device. Both give the same values, and
the backward of both sums each row's gradients over the positions that read
it, padding positions contributing nothing. On CPU the sum runs in increasing
position order, deterministically, on every thread count, in a wider dtype than
the value's (float64 for float32, float32 for bf16 and fp16), rounded once at
the end; on CUDA it is ``index_select``'s backward, atomic adds in no fixed
order, in the same wider dtype, rounded once at the end.
"""

from __future__ import annotations

import torch

from .shared_prompt import SharedPromptLayout

__all__ = ["pack", "unpack", "gather_valid", "gather_valid_indexed"]


# The dtype a gather's backward sums in, for each dtype it is given (both forms of ``gather_valid``).
_WIDER = {torch.float32: torch.float64, torch.bfloat16: torch.float32, torch.float16: torch.float32}


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

    ``index`` and ``keep`` are 1-D of one length; ``index`` must be in range
    wherever ``keep`` is True (at padding it is not read on CPU).
    Differentiable: the backward sums the gradients of entries read more than
    once (a shared token read by every row of its group).
    """
    if x.device.type == "cpu":
        return _gather_valid_cpu(x, index, keep, dim)
    return gather_valid_indexed(x, index, keep, dim)


def gather_valid_indexed(x: torch.Tensor, index: torch.Tensor, keep: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``gather_valid``'s CUDA form, on any device: ``index_select``, then zeros at padding. Its backward is
    ``index_select``'s, an ``index_add``, run in the wider dtype of ``_WIDER`` and rounded once at the cast back.

    Why wider: a float32 ``index_add`` of a prompt token read by 2,048 rows rounds after each of its 2,048 atomic
    adds, 45x the uncompiled model's float32 error on an H100 (issue 35, defect 5); in bf16 it would round to 8
    bits each time. The casts are exact in the forward. Under Inductor both casts fuse into the gather and
    scatter kernels, so the wider copy that remains is the ``[T, ...]`` accumulator, not the ``[N, ...]`` gradient.
    """
    wide = x.to(_WIDER[x.dtype]) if x.dtype in _WIDER else x
    y = wide.index_select(dim, index)
    shape = [1] * y.dim()
    shape[dim] = -1
    return torch.where(keep.view(shape), y, y.new_zeros(())).to(x.dtype)




def _gather_valid_cpu(x: torch.Tensor, index: torch.Tensor, keep: torch.Tensor, dim: int) -> torch.Tensor:
    """``gather_valid`` as a ``gather`` with a row index expanded over the flattened trailing axes.

    Why: ``index_select``'s backward is an ``index_add``, which Inductor on
    CPU at two or more threads compiles to a parallel loop of atomic adds:
    slower than one thread (a shared token's row is hit by every sequence of
    its group) and in no fixed order. ``gather``'s backward is ``scatter_add``,
    which Inductor at two or more threads hands to ATen (its
    ``cpp.fallback_scatter_reduce_sum``), whose kernel for an index expanded
    from one axis sorts the index stably and sums each row's positions in
    order, rows in parallel; eager takes the same kernel, and Inductor at one
    thread writes a serial loop over the positions in order.

    Padding positions read an extra zero row after the last: the forward needs
    no mask, and their gradients go to that row, which the ``cat``'s backward
    drops, so no masked copy of the ``[N, ...]`` gradient is made.
    """
    y = x.movedim(dim, 0)
    rows, rest = y.shape[0], y.shape[1:]
    flat = y.flatten(1) if y.dim() > 1 else y.unsqueeze(1)  # flatten, not reshape(rows, -1): rows may be 0
    if flat.dtype in _WIDER:
        # A scatter_add in the value's dtype rounds after every add of a row's up to B gradients, in order:
        # for a prompt read by 2,048 rows that is 20x the uncompiled model's float32 error, whose sums run
        # per row inside blocked matrix products (issue 35, defect 5). In the wider dtype the sum is rounded
        # once, at the cast back; the forward's values are unchanged (both casts are exact).
        flat = flat.to(_WIDER[flat.dtype])
    flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
    idx = index.masked_fill(~keep, rows)
    out = flat.gather(0, idx.unsqueeze(1).expand(idx.shape[0], flat.shape[1])).to(x.dtype)
    return out.reshape(idx.shape[0], *rest).movedim(0, dim)
