"""Sliding and chunked windows in the Triton kernels: the plans that let a tile skip the blocks outside them.

    window_schedule(segs, T, block_m, block_n, w, c)    -> int32 [5, bound], cached: the query kernels' tiles
    subtree_next(segs)                                  -> int32 [num_segments], cached: the dK/dV kernel's skips
    NONE, window_args, lowest_depth, last_reader, windowed_work   the rule, re-exported from ``common/window_rule.py``

The rule (``common/window_rule.py``): a query at depth dq sees a key at depth dk <= dq on its path iff dk >= lowest(dq);
``lowest`` is monotone, so a query tile's rows (depths dlo..dhi) see nothing below ``lowest(dlo)`` and all of what
lies at or above ``lowest(dhi)``; in between, the band, the kernels mask per element. A walk over each ancestor's
full blocks from its last one down visits them in descending depth, so ``window_schedule`` counts per tile the
blocks every row sees whole and the band, and the kernel stops there (docs/design.md, "Triton kernels"). Layering:
windows -> common.schedule -> common.window_rule (this module builds on the plain schedule and its cache).

Assumes ``Segments`` (a forest in pre-order, depths as ``token_depth``) and the kernels' block sizes; "none" (0)
is ``NONE`` = 2**30 to the kernels (``window_rule.window_args``). Guarantees: the tables are integer tensor ops of
the segments' values, built on the host twin when there is one (``derived_on_host``), and cached with the
schedules (``schedule.plans``); the grid is the plain schedule's, so a window never changes a launch's shape.
"""

from __future__ import annotations

import torch

from ...layout.segments import Segments, derived_on_host
from ..common.schedule import plans, schedule_table, walk_table
from ..common.window_rule import NONE, last_reader, lowest_depth, window_args, windowed_work  # the rule, re-exported

__all__ = ["NONE", "window_args", "window_schedule", "subtree_next", "windowed_work", "lowest_depth", "last_reader"]


def window_schedule(segs: Segments, num_tokens: int, block_m: int, block_n: int, window: int,
                    chunk: int) -> torch.Tensor:
    """int32 ``[5, bound]``: per program of the forward and dQ kernels (query tiles of ``block_m``, keys in
    blocks of ``block_n``), rows 0-1 the tile schedule (``schedule.tile_schedule`` with these windows), then
    how many of the ancestors' blocks the windowed walk takes, in its order (full blocks nearest ancestor
    first, each ancestor's from its last down; then each ragged last block, nearest first):

        2  full blocks every row of the tile sees whole (no mask)
        3  full blocks any row sees (those after row 2's need the window mask)
        4  ragged blocks any row sees (masked anyway)
    """
    key = ("window", num_tokens, block_m, block_n, window, chunk)
    return plans().get(segs, key, lambda: derived_on_host(
        segs, lambda s: _window_table(s, num_tokens, block_m, block_n, window, chunk)))


def subtree_next(segs: Segments) -> torch.Tensor:
    """int32 ``[num_segments]``: for segment s, a segment index past all of s's descendants that hold tokens
    and before every later non-descendant (pre-order); the dK/dV kernel's walk over a key tile's readers
    jumps there from a segment the window does not reach, skipping its whole subtree."""

    def build(segs: Segments) -> torch.Tensor:
        starts = segs.seg_start.long()
        # The first segment starting at or past the subtree's end: only empty descendants (no readers,
        # and no non-empty ones of their own) can sit at or past it; at least s + 1, so the walk moves on.
        past = torch.searchsorted(starts, segs.subtree_end.long())
        after = torch.arange(1, starts.numel() + 1, device=starts.device)
        return torch.maximum(past, after).to(torch.int32).contiguous()

    return plans().get(segs, ("subtree_next",), lambda: derived_on_host(segs, build))


def _window_table(segs: Segments, num_tokens: int, block_m: int, block_n: int, window: int,
                  chunk: int) -> torch.Tensor:
    w, c = window_args(window, chunk)
    sched = schedule_table(segs, num_tokens, block_m, "q", window, chunk)
    seg, tile = sched[0].long(), sched[1].long()
    valid, s = seg >= 0, seg.clamp(min=0)
    prefix, lens = segs.prefix_len.long(), segs.seg_len.long()
    lo = prefix[s] + tile * block_m
    hi = prefix[s] + torch.minimum((tile + 1) * block_m, lens[s]) - 1
    walk = walk_table(segs, block_n).long()
    up = _jumps(segs.parent.long())
    whole, _ = _blocks_at_or_above(segs, walk, up, s, lowest_depth(hi, w, c), block_n, whole=True)
    seen, ragged = _blocks_at_or_above(segs, walk, up, s, lowest_depth(lo, w, c), block_n, whole=False)
    counts = torch.stack([torch.where(valid, x, 0) for x in (whole, seen, ragged)])
    return torch.cat([sched, counts.to(torch.int32)]).contiguous()


def _jumps(parent: torch.Tensor) -> list[torch.Tensor]:
    """``up[k][x]``: the 2**k-th ancestor of segment x (-1: none), for every k a chain can need."""
    up = [parent]
    for _ in range(parent.numel().bit_length()):
        prev = up[-1]
        up.append(torch.where(prev >= 0, prev[prev.clamp(min=0)], -1))
    return up


def _blocks_at_or_above(segs: Segments, walk: torch.Tensor, up: list, s: torch.Tensor, d: torch.Tensor, block: int,
                        whole: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Over the ancestors of segments ``s``: the number of full blocks whose every key (``whole``) or whose last
    key (else) lies at depth >= ``d``, and the number of ragged last blocks whose last key does."""
    prefix, lens = segs.prefix_len.long(), segs.seg_len.long()
    d = d.clamp(min=0)
    inside = d < prefix[s]  # else every ancestor key lies below d: none
    # The ancestor holding depth d: the deepest with prefix_len <= d, by binary lifting from the parent up
    # over the ancestors with prefix_len > d (prefix_len shrinks towards the root, so they are a run).
    x = segs.parent.long()[s]
    for k in reversed(range(len(up))):
        y = up[k][x.clamp(min=0)]
        x = torch.where((x >= 0) & (y >= 0) & (prefix[y.clamp(min=0)] > d), y, x)
    xc = x.clamp(min=0)
    a = torch.where((x >= 0) & (prefix[xc] > d), segs.parent.long()[xc], x).clamp(min=0)
    off = d - prefix[a]
    skipped = torch.minimum((off + block - 1) // block if whole else off // block, lens[a] // block)
    full = walk[s, 0] - walk[a, 0] - skipped  # a and the ancestors below it, minus a's blocks under d
    ragged = walk[s, 1] - walk[a, 1]  # a's ragged block ends past d (a holds d): seen
    return torch.where(inside, full, 0), torch.where(inside, ragged, 0)
