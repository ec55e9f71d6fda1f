"""Segments: the attention structure of a packed stream, the one thing every attention kernel takes.

The packed stream holds a *prefix forest* (docs/design.md, semantics 11): each tree node is a run of packed
tokens, a *segment*; a token attends causally to its own segment and fully to every ancestor segment, one softmax.

Assumes (``tree_segments`` checks it; the layout builds it so): segments are in stream order, cover ``[0, T)`` and
are listed in *pre-order* (each segment's descendants directly follow it). Then a segment's subtree is one run
``[seg_start, subtree_end)`` and the whole mask is

    q sees kv  <=>  kv <= q < reach[kv],   reach[kv] = subtree_end of kv's segment

(an ancestor precedes q and its subtree contains q; any other earlier segment's subtree ends before q). The
readers of a segment's keys are its own tokens (causally) and the run ``[seg_end, subtree_end)`` (fully), so the
backward's sum over every descendant that reads a node (semantics 4) is one range. Windows (semantics 15) are
rules on a token's *depth*, ``prefix_len[seg] + (t - seg_start[seg])``, the same for every sequence through it:
a sliding window ``w`` keeps ``depth(q) - depth(kv) < w``, chunks of ``c`` keep ``depth(q) // c == depth(kv) //
c`` (Hugging Face's ``sliding_window_overlay`` and ``chunked_overlay`` on a padded row's columns); 0 means none.

The module holds the type, its host-side builder and the dense index maps derived from it (segment ids, reach, the
dense mask of the references, each token's predecessor); it imports nothing else of the package, so kernels
depend on it alone. Segments built for a CUDA device keep a *host twin* (``host_twin``): the per-step schedules,
sized by segments and tiles, are built on it and copied over in one transfer each (``derived_on_host``; why:
docs/design.md, "Layout").
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "Segments", "tree_segments", "segment_ids", "token_reach", "token_depth", "dense_mask", "window_allows",
    "previous_token_index", "host_rows",
    "to_device", "host_twin", "register_host_twin", "derived_on_host",
]


class Segments(NamedTuple):
    """The attention structure of a packed stream, as kernels take it.

    Segment ``i`` is the packed tokens ``[seg_start[i], seg_start[i] + seg_len[i])``.
    ``parent[i]`` is its parent segment (``-1`` for a root; always ``< i``);
    its tokens see every token of the chain ``parent[i], parent[parent[i]], ...``
    and their own segment's tokens up to themselves. ``prefix_len[i]`` is the
    total length of that chain; ``subtree_end[i]`` the end (exclusive) of the
    run holding ``i`` and all its descendants (pre-order).
    Tensors are int32 on the stream's device; the maxima are host ints, so
    kernels can size their grids without a sync.
    """

    seg_start: torch.Tensor
    seg_len: torch.Tensor
    parent: torch.Tensor
    prefix_len: torch.Tensor
    subtree_end: torch.Tensor
    max_seg_len: int
    max_prefix_len: int


def host_rows(seg_len: Sequence[int], parent: Sequence[int]) -> list[tuple[int, int, int, int, int]]:
    """``(seg_start, seg_len, parent, prefix_len, subtree_end)`` per segment, on the host.

    ``ValueError`` unless the segments are a forest in pre-order: ``parent[i]``
    is ``-1`` or ``i - 1`` or one of ``i - 1``'s ancestors, lengths are >= 0.
    """
    if len(seg_len) != len(parent):
        raise ValueError(f"seg_len and parent must have one entry per segment, got {len(seg_len)} and {len(parent)}")
    starts, prefix, depth_chain = [], [], []  # depth_chain: the open ancestors of the last segment
    off = 0
    for i, (n, p) in enumerate(zip(seg_len, parent)):
        if n < 0:
            raise ValueError(f"seg_len[{i}] must be >= 0, got {n}")
        while depth_chain and depth_chain[-1] != p:
            depth_chain.pop()
        if p != -1 and not depth_chain:
            raise ValueError(
                f"parent[{i}] = {p} breaks pre-order: a segment's parent must be the segment before it or one of its ancestors"
            )
        starts.append(off)
        prefix.append(0 if p == -1 else prefix[p] + seg_len[p])
        depth_chain.append(i)
        off += n
    ends = [s + n for s, n in zip(starts, seg_len)]
    subtree = list(ends)
    for i in range(len(parent) - 1, -1, -1):  # children follow their parent: fold the ends upwards
        if parent[i] >= 0:
            subtree[parent[i]] = max(subtree[parent[i]], subtree[i])
    return [(s, n, p, pl, e) for s, n, p, pl, e in zip(starts, seg_len, parent, prefix, subtree)]


def tree_segments(seg_len: Sequence[int], parent: Sequence[int], device: Optional[torch.device] = None) -> Segments:
    """``Segments`` of a forest given in pre-order by each segment's length and parent (host lists).

    The tensors are separate contiguous int32 tensors (kernels refuse overlapping
    storage). The copy to a CUDA device does not synchronise (pinned memory).
    """
    rows = host_rows(seg_len, parent)
    host = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5).t().contiguous()
    maxima = (max((r[1] for r in rows), default=0), max((r[3] for r in rows), default=0))
    table = host if device is None else to_device(host, torch.device(device))
    segs = Segments(*(table[i].clone() for i in range(5)), *maxima)
    if segs.seg_start.device.type == "cuda":
        register_host_twin(segs, Segments(*host, *maxima))  # rows of the host table: only read, so views do
    return segs


# device Segments' seg_start -> (the host twin, weak references to the five device tensors and their versions then)
_twins = WeakIdKeyDictionary()


def register_host_twin(segs: Segments, host: Segments) -> None:
    """Record ``host`` (CPU tensors, the same values) as the twin of ``segs`` for ``host_twin``. The caller vouches
    that the values are equal; ``tree_segments`` registers the twin of every CUDA ``Segments`` it builds."""
    _twins[segs.seg_start] = (host, tuple((weakref.ref(t), t._version) for t in segs[:5]))


def host_twin(segs: Segments) -> Optional[Segments]:
    """The registered host twin of ``segs``, or None: none was registered, or any of its five tensors is not the
    very tensor registered or has been modified in place since (so the twin may no longer hold its values)."""
    entry = _twins.get(segs.seg_start)
    if entry is None:
        return None
    host, stamps = entry
    if any(ref() is not t or t._version != version for t, (ref, version) in zip(segs[:5], stamps)):
        return None
    return host


def derived_on_host(segs: Segments, build: Callable[[Segments], torch.Tensor]) -> torch.Tensor:
    """``build(segs)``, computed on the host twin and copied to ``segs``' device when ``segs`` has one; ``build``
    must be a function of the segments' values alone (integer tensor ops, so both places give the same bits)."""
    twin = host_twin(segs)
    if twin is None:
        return build(segs)
    return to_device(build(twin), segs.seg_start.device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without synchronising it.

    A plain host-to-CUDA copy from pageable memory waits for the whole stream;
    from pinned memory with ``non_blocking=True`` it is queued like a kernel
    (the caching host allocator keeps the pinned buffer alive until it is done).
    """
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def segment_ids(segs: Segments, num_tokens: int) -> torch.Tensor:
    """int64 [T]: the segment each packed token belongs to."""
    return torch.repeat_interleave(
        torch.arange(segs.seg_len.numel(), device=segs.seg_len.device),
        segs.seg_len.long(),
        output_size=num_tokens,
    )


def token_reach(segs: Segments, num_tokens: int) -> torch.Tensor:
    """int64 [T]: for each packed key, the end (exclusive) of the queries that see it (its segment's subtree end)."""
    return segs.subtree_end.long()[segment_ids(segs, num_tokens)]


def token_depth(segs: Segments, num_tokens: int) -> torch.Tensor:
    """int64 [T]: each packed token's index along its sequences from the root (the windows' coordinate)."""
    seg = segment_ids(segs, num_tokens)
    t = torch.arange(num_tokens, device=seg.device)
    return segs.prefix_len.long()[seg] + t - segs.seg_start.long()[seg]


def window_allows(depth_q: torch.Tensor, depth_kv: torch.Tensor, window: int = 0, chunk: int = 0) -> torch.Tensor:
    """Where a sliding ``window`` and ``chunk`` size (0: none) let depth ``depth_q`` see depth ``depth_kv``
    (broadcast); causality and the forest are the caller's. ``ValueError`` for a negative or non-int size."""
    check_window(window, chunk)
    ok = torch.ones(torch.broadcast_shapes(depth_q.shape, depth_kv.shape), dtype=torch.bool, device=depth_q.device)
    if window:
        ok = ok & (depth_q - depth_kv < window)
    if chunk:
        ok = ok & (torch.div(depth_q, chunk, rounding_mode="floor") == torch.div(depth_kv, chunk, rounding_mode="floor"))
    return ok


def check_window(window, chunk) -> None:
    for name, x in (("window", window), ("chunk", chunk)):
        if not isinstance(x, int) or isinstance(x, bool) or x < 0:
            raise ValueError(f"{name} must be an int >= 0 (0: none), got {x!r}")


def dense_mask(segs: Segments, num_tokens: int, window: int = 0, chunk: int = 0) -> torch.Tensor:
    """``[T, T]`` bool: ``mask[q, kv]`` is True where packed query q attends to packed key kv (under the windows)."""
    reach = token_reach(segs, num_tokens)
    t = torch.arange(num_tokens, device=reach.device)
    mask = (t[None, :] <= t[:, None]) & (t[:, None] < reach[None, :])
    if window or chunk:
        depth = token_depth(segs, num_tokens)
        mask = mask & window_allows(depth[:, None], depth[None, :], window, chunk)
    return mask


def previous_token_index(segs: Segments, num_tokens: int) -> torch.Tensor:
    """int64 [T]: for each packed token, the packed token before it in its sequences.

    Inside a segment that is ``t - 1``; for the first token of a segment with a
    parent it is the parent's last token (read by every sequence through the
    node: docs/design.md, semantics 5); the first token of a root has no
    predecessor and maps to itself.
    """
    seg = segment_ids(segs, num_tokens)
    t = torch.arange(num_tokens, device=seg.device)
    first = segs.seg_start.long()[seg] == t
    parent = segs.parent.long()[seg]
    pc = parent.clamp(min=0)
    parent_last = segs.seg_start.long()[pc] + segs.seg_len.long()[pc] - 1
    return torch.where(first, torch.where(parent >= 0, parent_last, t), t - 1)
