"""A recurrence on the prefix forest by depth levels: d batched scans for a forest of depth d.

Assumes ``segs`` is a forest in pre-order (``layout.segments.Segments``) over ``num_tokens`` packed tokens. Level
``l`` holds the segments with ``l`` ancestors, in stream order; each is one row of a batch ``[n, L, ...]`` (``L``
its longest segment, rounded up to ``pad_to``), zero-filled past the row's segment. ``forest_scan`` runs a
caller's ``scan(inputs, state0) -> (out, state)`` once per level: a root row starts from zeros, any other row from
its parent segment's final state (every child of one parent from the same one, so autograd sums the children's
state gradients into it). Guarantees: each packed token's output comes from its own row; each segment's final
state is its row's state after the level's ``L`` steps, exact when the caller's step leaves the state unchanged
on zero inputs (the scans here are built so); an empty segment's final state is its initial one.

The levels are built on the host from the segments' host twin (``layout.segments.host_twin``) or, without one,
from one copy of the three tensors to the host, then moved to the stream's device.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from ...layout.segments import Segments, host_twin, to_device

__all__ = ["Level", "depth_groups", "forest_levels", "forest_scan", "host_table"]


class Level(NamedTuple):
    """One depth level: ``segments`` int64 [n] (stream order), ``parent_row`` int64 [n] (each segment's parent's
    row in the level above; -1 at level 0), ``tokens`` int64 [n, L] (the packed token at each step, ``num_tokens``
    past the segment's end) and ``valid`` bool [n, L]."""

    segments: torch.Tensor
    parent_row: torch.Tensor
    tokens: torch.Tensor
    valid: torch.Tensor


def host_table(segs: Segments) -> tuple[list[int], list[int], list[int]]:
    """``(seg_start, seg_len, parent)`` as host lists, from the host twin where there is one."""
    twin = host_twin(segs)
    src = segs if twin is None else twin
    table = torch.stack([src.seg_start, src.seg_len, src.parent]).cpu().tolist()
    return table[0], table[1], table[2]


def depth_groups(parent: list[int]) -> tuple[list[list[int]], list[int]]:
    """The segments of each depth level (pre-order ``parent`` lists), top first, and each segment's row in its
    level."""
    depth, row, by_level = [], [], []
    for i, p in enumerate(parent):
        d = 0 if p < 0 else depth[p] + 1
        depth.append(d)
        if d == len(by_level):
            by_level.append([])
        row.append(len(by_level[d]))
        by_level[d].append(i)
    return by_level, row


def forest_levels(segs: Segments, num_tokens: int, pad_to: int = 1) -> list[Level]:
    """The forest's depth levels, top first (``pad_to``: each level's step count is a multiple of it)."""
    start, length, parent = host_table(segs)
    if start and start[-1] + length[-1] != num_tokens:
        raise ValueError(f"the segments cover {start[-1] + length[-1]} tokens, the inputs have {num_tokens}")
    by_level, row = depth_groups(parent)
    device = segs.seg_start.device
    levels = []
    for members in by_level:
        lens = torch.tensor([length[i] for i in members], dtype=torch.int64)
        steps = -(-max(lens.max().item(), 0) // pad_to) * pad_to
        step = torch.arange(steps, dtype=torch.int64)
        valid = step[None, :] < lens[:, None]
        first = torch.tensor([start[i] for i in members], dtype=torch.int64)
        tokens = torch.where(valid, first[:, None] + step[None, :], num_tokens)
        rows = torch.tensor([row[parent[i]] if parent[i] >= 0 else -1 for i in members], dtype=torch.int64)
        host = (torch.tensor(members, dtype=torch.int64), rows, tokens, valid)
        levels.append(Level(*(t if device.type == "cpu" else to_device(t, device) for t in host)))
    return levels


def forest_scan(
    segs: Segments,
    inputs: Sequence[torch.Tensor],
    scan: Callable[[list, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    state_shape: Sequence[int],
    pad_to: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, ...], final_state [S, *state_shape])`` of ``scan`` run level by level over packed ``inputs``
    (each ``[T, ...]``; gathered per level to ``[n, L, ...]``). The state's dtype and device are ``inputs[0]``'s."""
    x0 = inputs[0]
    T = x0.shape[0]
    padded = [torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))]) for x in inputs]
    outs, tokens, states, members = [], [], [], []
    prev = None
    for level in forest_levels(segs, T, pad_to):
        if prev is None:
            state0 = x0.new_zeros((level.segments.numel(),) + tuple(state_shape))
        else:
            state0 = prev.index_select(0, level.parent_row)
        if level.tokens.shape[1] == 0:  # only empty segments: their final states are their initial ones
            prev = state0
        else:
            out, prev = scan([p[level.tokens] for p in padded], state0)
            outs.append(out[level.valid])
            tokens.append(level.tokens[level.valid])
        states.append(prev)
        members.append(level.segments)
    if not outs:
        raise ValueError("the forest has no tokens")
    out_all = torch.cat(outs)
    out = out_all.new_zeros((T,) + tuple(out_all.shape[1:])).index_copy(0, torch.cat(tokens), out_all)
    state_all = torch.cat(states)
    final = state_all.new_zeros(state_all.shape).index_copy(0, torch.cat(members), state_all)
    return out, final
