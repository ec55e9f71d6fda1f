"""Per-launch tile schedules of the Triton kernels, built from ``Segments`` on the device.

    readers(segs)                          -> (first, last, rows) per segment
    reader_ranges(segs)                    -> (first, last), cached
    tile_schedule(segs, T, block, kind)    -> int32 [2, bound], cached

Assumes (on top of ``Segments``): a segment's non-empty prefix is exactly one
earlier segment, and the segments that read the same prefix are consecutive,
as ``SharedPromptLayout`` builds them. Segments are in stream order.

Guarantees: every function is a handful of device tensor ops whose sizes come
from host ints (T, the block, the number of segments), so nothing waits on
the device and a new layout never changes a grid's shape beyond those ints.
Results are cached per (segment tensors, arguments) in a ``PlanCache`` that
only hits for the very same, unmodified tensors, so the layers of one step
share one schedule.
"""

from __future__ import annotations

import weakref

import torch

from ...layout.segments import Segments

__all__ = ["PlanCache", "readers", "reader_ranges", "tile_schedule"]


class PlanCache:
    """Tile schedules per (segments tensors, T, block, kind), reused across layers of one step.

    Keys hold weak references to the segment tensors: an entry is only hit by the
    very same (unmodified) tensors, and dies with them.
    """

    def __init__(self, size: int = 64):
        self.size = size
        self.entries: dict = {}

    def get(self, segs: Segments, extra: tuple, build):
        tensors = (segs.seg_start, segs.seg_len, segs.prefix_start, segs.prefix_len)
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


def readers(segs: Segments) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per segment: the first and last segment that read it as prefix (first > last: none), and their rows."""
    nseg = segs.seg_start.numel()
    dev = segs.seg_start.device
    starts = segs.seg_start.long()
    owner = torch.searchsorted(starts, segs.prefix_start.long(), right=True) - 1
    # Segments with no prefix scatter into a dummy slot at the end.
    slot = torch.where(segs.prefix_len > 0, owner.clamp(min=0), nseg)
    ids = torch.arange(nseg, device=dev)
    first = torch.full((nseg + 1,), nseg, dtype=torch.long, device=dev).scatter_reduce(0, slot, ids, "amin")
    last = torch.full((nseg + 1,), -1, dtype=torch.long, device=dev).scatter_reduce(0, slot, ids, "amax")
    first, last = first[:nseg], last[:nseg]
    cum = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), segs.seg_len.long().cumsum(0)])
    rows = torch.where(last >= first, cum[(last + 1).clamp(min=0)] - cum[first.clamp(max=nseg)], 0)
    return first.to(torch.int32), last.to(torch.int32), rows


def tile_schedule(segs: Segments, num_tokens: int, block: int, kind: str) -> torch.Tensor:
    """int32 ``[2, bound]``: (segment, tile) per program, heaviest first; segment -1 pads the grid.

    ``bound = cdiv(T, block) + num_segments`` is a host-side upper bound on the
    number of tiles, so the grid is known without a sync. ``kind`` is "q"
    (query tiles: work = prefix + causal part) or "kv" (key tiles of the
    dK/dV kernel: work = own rows after the tile + all readers' rows).
    """

    def build():
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
        if kind == "q":
            work = segs.prefix_len.long()[segc] + torch.minimum((tile + 1) * block, seg_len[segc])
        else:
            work = seg_len[segc] - tile * block + readers(segs)[2][segc]
        order = torch.argsort(torch.where(valid, work, -1), descending=True, stable=True)
        sched = torch.stack([torch.where(valid, seg, -1)[order], tile[order]])
        return sched.to(torch.int32).contiguous()

    return _plans.get(segs, (num_tokens, block, kind), build)


def reader_ranges(segs: Segments) -> tuple[torch.Tensor, torch.Tensor]:
    """``readers(segs)[:2]`` (int32 first and last reader per segment), cached like the schedules."""
    return _plans.get(segs, ("readers",), lambda: readers(segs)[:2])
