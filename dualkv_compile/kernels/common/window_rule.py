"""The window rule on token depth, as host tensor ops: the one module ``schedule.py`` and ``triton/windows.py`` read it from.

    NONE                                     2**30: "no window" / "no chunks" to the kernels
    window_args(window, chunk)           -> (w, c): the kernels' runtime ints
    lowest_depth(d, w, c)                -> the lowest key depth a query at depth d sees
    last_reader(d, w, c)                 -> the deepest query depth that sees a key at depth d
    windowed_work(segs, seg, tile, ...)  -> the work of each tile under the windows (``schedule_table``'s order)

The rule (``layout.segments``; docs/design.md, semantics 15): a query at depth dq sees a key at depth dk <= dq (on
its path) iff dk >= lowest(dq) = max(dq - w + 1, (dq // c) * c) (a window w: dq - dk < w; chunks of c: the same
chunk, the upper end being causal). ``lowest`` and ``last_reader`` are monotone, so a run of query depths dlo..dhi
sees nothing below ``lowest(dlo)`` and a run of key depths klo..khi is read by no query past ``last_reader(khi)``.
``triton/tiles.lowest_depth`` / ``last_reader`` are the same two functions jitted for the kernels.

Layering: this module imports only ``layout.segments``; ``schedule.py`` (the tile order) and ``triton/windows.py``
(the windowed plans, built on the schedule) import it: triton/windows -> schedule -> window_rule.
Assumes ``Segments`` (a forest in pre-order, depths as ``token_depth``) and depths below 2**21 (``launch.check_launch``
bounds T), so ``NONE`` is wider than any window and the arithmetic needs no branch for "none". Guarantees: pure
integer tensor ops on the inputs' device; no sync, no cache, no state.
"""

from __future__ import annotations

import torch

from ...layout.segments import Segments

__all__ = ["NONE", "window_args", "lowest_depth", "last_reader", "windowed_work"]

NONE = 1 << 30  # "no window" / "no chunks": wider than any stream the kernels take


def window_args(window: int, chunk: int) -> tuple[int, int]:
    """The kernels' ``(window, chunk)`` ints: 0 (none) becomes ``NONE``."""
    return window or NONE, chunk or NONE


def lowest_depth(d: torch.Tensor, w: int, c: int) -> torch.Tensor:
    """The lowest key depth a query at depth ``d`` sees (``w``, ``c`` as ``window_args`` gives them)."""
    return torch.maximum(d - w + 1, torch.div(d, c, rounding_mode="floor") * c)


def last_reader(d: torch.Tensor, w: int, c: int) -> torch.Tensor:
    """The deepest query that sees a key at depth ``d``: the largest dq with ``lowest_depth(dq) <= d``."""
    return torch.minimum(d + w - 1, (torch.div(d, c, rounding_mode="floor") + 1) * c - 1)


def windowed_work(segs: Segments, seg: torch.Tensor, tile: torch.Tensor, block: int, kind: str, window: int,
                  chunk: int) -> torch.Tensor:
    """The work of each tile (``schedule_table``'s order, heaviest first) under the windows: "q" the keys the
    tile's rows reach, "kv" the rows that read the tile (its own, and its subtree's where the window reaches it)."""
    w, c = window_args(window, chunk)
    prefix, lens = segs.prefix_len.long()[seg], segs.seg_len.long()[seg]
    lo = prefix + tile * block
    hi = prefix + torch.minimum((tile + 1) * block, lens) - 1
    if kind == "q":
        return hi + 1 - lowest_depth(lo, w, c).clamp(min=0)
    reach, end = last_reader(hi, w, c), prefix + lens
    below = segs.subtree_end.long()[seg] - (segs.seg_start.long()[seg] + lens)
    return torch.minimum(reach + 1, end) - lo + torch.where(reach >= end, below, 0)
