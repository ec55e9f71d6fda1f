"""Per-launch tile schedules of the Triton and Gluon kernels, built from ``Segments`` on the device.

    tile_schedule(segs, T, block, kind, window=0, chunk=0)  -> int32 [2, bound], cached
    ancestor_walk(segs, block)                              -> int32 [num_segments, 4], cached
    schedule_table, walk_table                              the same, uncached (triton/windows.py derives more)

Layering: triton/windows -> schedule -> window_rule. Under a window the tile
order takes its work estimate from ``window_rule.windowed_work``; this module
never imports ``triton/windows.py`` (which builds its plans on this one).

Assumes ``Segments``: a prefix forest in pre-order, in stream order, so a
segment's ancestors total ``prefix_len`` tokens and its readers (beyond its
own rows) are the one run ``[seg_end, subtree_end)``.

Guarantees: every function is a handful of tensor ops whose sizes come from
host ints (T, the block, the number of segments), so nothing waits on the
device and a new layout never changes a grid's shape beyond those ints. They
run on the segments' host twin when there is one (``derived_on_host``: one
copy instead of dozens of tiny kernels), else on the device.
Results are cached per (segment tensors, arguments) in a ``PlanCache`` that
only hits for the very same, unmodified tensors, so the layers of one step
share one schedule.
"""

from __future__ import annotations

import weakref

import torch

from ...layout.segments import Segments, derived_on_host
from .window_rule import windowed_work

__all__ = ["PlanCache", "tile_schedule", "ancestor_walk", "clear_plans", "plans", "schedule_table", "walk_table"]


class PlanCache:
    """Tile schedules per (segments tensors, T, block, kind), reused across layers of one step.

    Keys hold weak references to the segment tensors: an entry is only hit by the
    very same (unmodified) tensors, and dies with them.
    """

    def __init__(self, size: int = 64):
        self.size = size
        self.entries: dict = {}

    def get(self, segs: Segments, extra: tuple, build):
        tensors = (segs.seg_start, segs.seg_len, segs.parent, segs.prefix_len, segs.subtree_end)
        key = tuple(id(t) for t in tensors) + tuple(t._version for t in tensors) + extra
        hit = self.entries.get(key)
        if hit is not None and all(r() is t for r, t in zip(hit[0], tensors)):
            return hit[1]
        value = build()
        if len(self.entries) >= self.size:
            self.entries.pop(next(iter(self.entries)))
        self.entries[key] = (tuple(weakref.ref(t) for t in tensors), value)
        return value


_plans = PlanCache()


def plans() -> PlanCache:
    """The cache the schedules share (``triton/windows.py`` keeps its plans there too, so ``clear_plans`` clears them)."""
    return _plans


def clear_plans() -> None:
    """Forget every cached schedule (the next call builds anew): for tests that build one forest two ways."""
    _plans.entries.clear()


def tile_schedule(segs: Segments, num_tokens: int, block: int, kind: str, window: int = 0,
                  chunk: int = 0) -> torch.Tensor:
    """int32 ``[2, bound]``: (segment, tile) per program, heaviest first; segment -1 pads the grid.

    ``bound = cdiv(T, block) + num_segments`` is a host-side upper bound on the
    number of tiles, so the grid is known without a sync. ``kind`` is "q"
    (query tiles: work = all ancestors + the causal part) or "kv" (key tiles
    of the dK/dV kernel: work = the rows from the tile to the subtree's end,
    its own later rows and every descendant's). A sliding ``window`` or
    ``chunk`` (0: none) only changes the order, to the work the windows leave
    (``window_rule.windowed_work``); the tiles are the same.
    """

    def build(s: Segments) -> torch.Tensor:
        return schedule_table(s, num_tokens, block, kind, window, chunk)

    return _plans.get(segs, (num_tokens, block, kind, window, chunk), lambda: derived_on_host(segs, build))


def schedule_table(segs: Segments, num_tokens: int, block: int, kind: str, window: int = 0,
                   chunk: int = 0) -> torch.Tensor:
    """``tile_schedule``'s table, uncached, on ``segs``' own device (for builders that derive more from it)."""
    seg_len = segs.seg_len.long()
    nseg = seg_len.numel()
    dev = seg_len.device
    bound = -(-num_tokens // block) + nseg
    ntiles = (seg_len + block - 1) // block
    cum = ntiles.cumsum(0)
    pid = torch.arange(bound, device=dev)
    seg = torch.searchsorted(cum, pid, right=True)
    valid = seg < nseg
    segc = seg.clamp(max=nseg - 1)
    tile = pid - (cum - ntiles)[segc]
    if window or chunk:
        work = windowed_work(segs, segc, tile, block, kind, window, chunk)
    elif kind == "q":
        work = segs.prefix_len.long()[segc] + torch.minimum((tile + 1) * block, seg_len[segc])
    else:
        work = segs.subtree_end.long()[segc] - (segs.seg_start.long()[segc] + tile * block)
    order = torch.argsort(torch.where(valid, work, -1), descending=True, stable=True)
    sched = torch.stack([torch.where(valid, seg, -1)[order], tile[order]])
    return sched.to(torch.int32).contiguous()


def ancestor_walk(segs: Segments, block: int) -> torch.Tensor:
    """int32 ``[num_segments, 4]``: how the query kernels walk a segment's ancestors in key blocks of ``block``.

    Per segment: the number of full blocks over all its ancestors, the number
    of its ancestors with a ragged last block (length not a multiple of
    ``block``), the nearest ancestor with a full block and the nearest with a
    ragged one (-1: none). The kernels step from ancestor to ancestor through
    the last two columns with selects, not branches (``fwd.py`` says why).
    The counts are exact for segments with tokens, the only ones with tiles.
    """
    return _plans.get(segs, ("walk", block), lambda: derived_on_host(segs, lambda s: walk_table(s, block)))


def walk_table(segs: Segments, block: int) -> torch.Tensor:
    """``ancestor_walk``'s table, uncached, on ``segs``' own device."""
    lens = segs.seg_len.long()
    nseg = lens.numel()
    weight = torch.stack([lens // block, (lens % block != 0).long()])  # [2, nseg]: full blocks, ragged blocks
    # Pre-order: the earlier segments that are not ancestors of a segment with tokens are those whose
    # subtree ends at or before its start; sum the weights of all earlier segments, minus those.
    earlier = weight.cumsum(1) - weight
    ends, order = segs.subtree_end.long().sort()
    closed = torch.cat([weight.new_zeros(2, 1), weight[:, order].cumsum(1)], 1)
    n_closed = torch.searchsorted(ends, segs.seg_start.long(), right=True)
    counts = earlier - closed[:, n_closed]
    # Nearest ancestor with a full (ragged) block by pointer doubling: no segment strictly between a
    # segment and ptr is one, and each round either stops on one (or -1) or doubles the distance.
    ptr = segs.parent.long().expand(2, nseg).contiguous()
    for _ in range(nseg.bit_length() + 1):
        at = ptr.clamp(min=0)
        stop = (ptr < 0) | (weight.gather(1, at) > 0)
        ptr = torch.where(stop, ptr, ptr.gather(1, at))
    return torch.cat([counts, ptr]).t().to(torch.int32).contiguous()
