"""Segments: the attention structure of a packed stream, the one thing every attention kernel takes.

A segment is a run of packed query tokens that attend causally to themselves
and fully to one *prefix* run of packed tokens (empty for a shared prefix
itself). This module holds the type and the dense index maps derived from it
(segment ids, the dense mask the references use, each token's predecessor);
it imports nothing else of the package, so kernels depend on it alone.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Segments", "segment_ids", "dense_mask", "previous_token_index"]


class Segments(NamedTuple):
    """The attention structure of a packed stream, as kernels take it.

    Segment ``i`` is the packed query tokens ``[seg_start[i], seg_start[i] + seg_len[i])``;
    each of them sees the packed tokens ``[prefix_start[i], prefix_start[i] + prefix_len[i])``
    and its own segment's tokens up to and including itself. Every packed
    token belongs to exactly one segment, and segments are in stream order.
    Tensors are int32 on the stream's device; the maxima are host ints, so
    kernels can size their grids without a sync.
    """

    seg_start: torch.Tensor
    seg_len: torch.Tensor
    prefix_start: torch.Tensor
    prefix_len: torch.Tensor
    max_seg_len: int
    max_prefix_len: int


def segment_ids(segs: Segments, num_tokens: int) -> torch.Tensor:
    """int64 [T]: the segment each packed token belongs to."""
    return torch.repeat_interleave(
        torch.arange(segs.seg_len.numel(), device=segs.seg_len.device),
        segs.seg_len.long(),
        output_size=num_tokens,
    )


def dense_mask(segs: Segments, num_tokens: int) -> torch.Tensor:
    """``[T, T]`` bool: ``mask[q, kv]`` is True where packed query q attends to packed key kv."""
    seg = segment_ids(segs, num_tokens)
    q = torch.arange(num_tokens, device=seg.device)
    start = segs.seg_start.long()[seg]
    pstart, plen = segs.prefix_start.long()[seg], segs.prefix_len.long()[seg]
    kv = q[None, :]
    own = (kv >= start[:, None]) & (kv <= q[:, None])
    prefix = (kv >= pstart[:, None]) & (kv < (pstart + plen)[:, None])
    return own | prefix


def previous_token_index(segs: Segments, num_tokens: int) -> torch.Tensor:
    """int64 [T]: for each packed token, the packed token before it in its rows.

    Inside a segment that is ``t - 1``; for the first token of a response it
    is the last token of its group's shared prefix (read by every row of the
    group: DESIGN.md, semantics 5); the first token of a shared prefix has no
    predecessor and maps to itself.
    """
    seg = segment_ids(segs, num_tokens)
    t = torch.arange(num_tokens, device=seg.device)
    first = segs.seg_start.long()[seg] == t
    plen = segs.prefix_len.long()[seg]
    before_prefix_end = segs.prefix_start.long()[seg] + plen - 1
    return torch.where(first, torch.where(plen > 0, before_prefix_end, t), t - 1)
