"""The prefix forest of a set of sequences, built on the host (docs/design.md, semantics 11).

    build_forest(batch, min_shared) -> (nodes, leaf of each sequence)

Sequences (``sequences.HostBatch``) are strings of per-token keys. Sorted
lexicographically (as byte strings of their keys: any fixed-width encoding
keeps every set of strings with a common prefix contiguous), the longest
common prefix (LCP) of a contiguous range is the minimum of the LCPs of its
neighbours, and the compacted trie follows by splitting ranges where that
minimum is reached. Sorting and the LCPs compare bytes in C (``memcmp``), so
thousands of sequences of thousands of tokens take milliseconds.

Guarantees
    * Exact: a node is shared only by sequences whose keys are equal over it
      (the LCPs are exact comparisons, not hashes).
    * A node shared by several sequences is at least ``min_shared`` tokens
      long; shorter common parts are copied into each branch instead.
    * Nodes come in pre-order (a node's descendants directly follow it), and
      children in the order of their first sequence in the batch, so a batch
      of adjacent groups packs group by group, row by row.
"""

from __future__ import annotations

import ctypes
import dataclasses
import sys

from .sequences import HostBatch

__all__ = ["ForestNode", "build_forest"]


@dataclasses.dataclass(frozen=True)
class ForestNode:
    """Tokens ``[offset, offset + length)`` of every sequence in ``members`` (indices into the batch's sequences).

    ``parent`` is the index of the parent node (``-1`` for a root); the
    packed copy is read from ``members[0]``, the first of them in the batch.
    """

    parent: int
    offset: int
    length: int
    members: tuple[int, ...]


def build_forest(batch: HostBatch, min_shared: int = 1) -> tuple[list[ForestNode], list[int]]:
    """The forest's nodes in pre-order, and each sequence's last node (``-1`` for an empty sequence)."""
    keys = batch.keys
    width = keys.shape[-1] * keys.element_size()
    row_bytes = batch.seq_len * width
    base = keys.data_ptr()
    strings = [ctypes.string_at(base + b * row_bytes + s * width, (e - s) * width) for b, s, e in batch.sequences]
    lengths = [e - s for _, s, e in batch.sequences]
    order = sorted(range(len(strings)), key=strings.__getitem__)
    lcp = [0] * len(order)  # lcp[i]: common prefix (tokens) of order[i - 1] and order[i]
    for i in range(1, len(order)):
        lcp[i] = _common_prefix(strings[order[i - 1]], strings[order[i]]) // width

    nodes: list[ForestNode] = []
    leaf = [-1] * len(strings)
    # The recursion is as deep as the forest; multi-turn trees can be deep.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * len(strings) + 1000))
    try:
        _children(order, lengths, lcp, 0, len(order), 0, -1, min_shared, nodes, leaf)
    finally:
        sys.setrecursionlimit(limit)
    return nodes, leaf


def _common_prefix(a: bytes, b: bytes) -> int:
    """Length in bytes of the common prefix of ``a`` and ``b`` (binary search over memcmp'd slices)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _groups(lcp, lo: int, hi: int, depth: int) -> list[tuple[int, int]]:
    """Split sorted range [lo, hi) where neighbours share no more than ``depth`` tokens."""
    if lo >= hi:  # no sequences at all (every row is padding)
        return []
    out, start = [], lo
    for i in range(lo + 1, hi):
        if lcp[i] <= depth:
            out.append((start, i))
            start = i
    out.append((start, hi))
    return out


def _children(order, lengths, lcp, lo, hi, depth, parent, min_shared, nodes, leaf) -> None:
    """Add the nodes below ``parent`` for the sorted sequences [lo, hi), which share their first ``depth`` tokens."""
    branches: list[tuple[int, int, int]] = []
    for a, b in _groups(lcp, lo, hi, depth):
        _branches(order, lcp, a, b, depth, min_shared, branches)
    for _, a, b in sorted(branches):  # children in batch order (copied branches too)
        _node(order, lengths, lcp, a, b, depth, parent, min_shared, nodes, leaf)


def _branches(order, lcp, lo, hi, depth, min_shared, out) -> None:
    """The children at ``depth`` of the sorted sequences [lo, hi) (which agree on their next token), as
    ``(first sequence, lo, hi)``: the range itself, or, where its common part past ``depth`` is shorter than
    ``min_shared``, the children of each branch (neighbours sharing more than that part), each with its own copy.
    Equal sequences that end within that part land in branches of their own, so each gets a copy too."""
    if hi - lo > 1:
        end = min(lcp[lo + 1 : hi])
        if end - depth < min_shared:
            for a, b in _groups(lcp, lo, hi, end):
                _branches(order, lcp, a, b, depth, min_shared, out)
            return
    out.append((min(order[lo:hi]), lo, hi))


def _node(order, lengths, lcp, lo, hi, depth, parent, min_shared, nodes, leaf) -> None:
    """The node starting at ``depth`` for the sorted sequences [lo, hi) (which agree on its first token)."""
    if hi - lo == 1:
        s = order[lo]
        if lengths[s] == depth:  # the sequence ends at its parent: an empty leaf
            leaf[s] = parent
            return
        leaf[s] = len(nodes)
        nodes.append(ForestNode(parent, depth, lengths[s] - depth, (s,)))
        return
    # The range was split where neighbours share no more than ``depth`` tokens, so it shares more.
    end = min(lcp[lo + 1 : hi])
    assert end - depth >= min_shared, "a range of several sequences shares at least min_shared tokens past its depth"
    members = tuple(sorted(order[i] for i in range(lo, hi)))
    me = len(nodes)
    nodes.append(ForestNode(parent, depth, end - depth, members))
    for i in range(lo, hi):
        if lengths[order[i]] == end:
            leaf[order[i]] = me
    inner = [i for i in range(lo, hi) if lengths[order[i]] > end]
    if inner:
        # Sequences ending at ``end`` sort first in the range; the others continue below this node.
        first = lo + sum(1 for i in range(lo, hi) if lengths[order[i]] == end)
        _children(order, lengths, lcp, first, hi, end, me, min_shared, nodes, leaf)
