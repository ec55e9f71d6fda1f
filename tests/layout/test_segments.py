"""Tests of dualkv_compile.layout.segments: the kernels' ABI and its host builder, by hand.

``host_rows``/``tree_segments`` build ``(seg_start, seg_len, parent,
prefix_len, subtree_end)`` from each segment's length and parent (a forest in
pre-order) and refuse anything else; ``segment_ids``, ``token_reach``,
``dense_mask`` and ``previous_token_index`` are the dense maps the references
and tests use. Every expectation below is written by hand.
"""

from __future__ import annotations

import pytest
import torch

from dualkv_compile.layout import Segments, dense_mask, previous_token_index, segment_ids, token_reach, tree_segments
from dualkv_compile.layout.segments import host_rows


pytestmark = pytest.mark.usefixtures("one_thread")


# Two trees: a chain 0 <- 1 <- 2 (3, 2, 1 tokens) and 3 <- 4 (4, 2 tokens).
CHAIN_LEN, CHAIN_PARENT = [3, 2, 1, 4, 2], [-1, 0, 1, -1, 3]
CHAIN_ROWS = [(0, 3, -1, 0, 6), (3, 2, 0, 3, 6), (5, 1, 1, 5, 6), (6, 4, -1, 0, 12), (10, 2, 3, 4, 12)]
# A prompt of 2 with two responses (1 and 2 tokens), then a root of 1.
SIB_LEN, SIB_PARENT = [2, 1, 2, 1], [-1, 0, 0, -1]
SIB_ROWS = [(0, 2, -1, 0, 5), (2, 1, 0, 2, 3), (3, 2, 0, 2, 5), (5, 1, -1, 0, 6)]


def test_segments_fields():
    assert Segments._fields == ("seg_start", "seg_len", "parent", "prefix_len", "subtree_end", "max_seg_len", "max_prefix_len")


@pytest.mark.parametrize(
    "lens, parents, rows",
    [
        (CHAIN_LEN, CHAIN_PARENT, CHAIN_ROWS),
        (SIB_LEN, SIB_PARENT, SIB_ROWS),
        # grandchildren: 0 <- 1 <- 2, 0 <- 3 <- 4, 3 <- 5
        (
            [1, 1, 1, 1, 1, 1],
            [-1, 0, 1, 0, 3, 3],
            [(0, 1, -1, 0, 6), (1, 1, 0, 1, 3), (2, 1, 1, 2, 3), (3, 1, 0, 1, 6), (4, 1, 3, 2, 5), (5, 1, 3, 2, 6)],
        ),
        # a zero-length segment is allowed
        ([2, 0, 1], [-1, 0, 0], [(0, 2, -1, 0, 3), (2, 0, 0, 2, 2), (2, 1, 0, 2, 3)]),
        ([], [], []),
    ],
    ids=["chain", "siblings", "grandchildren", "zero_length", "empty"],
)
def test_host_rows_and_tree_segments_by_hand(lens, parents, rows):
    assert host_rows(lens, parents) == rows
    segs = tree_segments(lens, parents)
    assert isinstance(segs, Segments)
    tensors = segs[:5]
    for i, t in enumerate(tensors):
        assert t.dtype == torch.int32 and t.device.type == "cpu" and t.is_contiguous()
        assert t.tolist() == [r[i] for r in rows]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 5 or not rows
    assert segs.max_seg_len == max(lens, default=0) and isinstance(segs.max_seg_len, int)
    assert segs.max_prefix_len == max((r[3] for r in rows), default=0) and isinstance(segs.max_prefix_len, int)
    assert tree_segments(lens, parents, torch.device("cpu")).seg_start.tolist() == [r[0] for r in rows]


@pytest.mark.parametrize(
    "parents, i, p",
    [
        ([0], 0, 0),  # a first segment with a parent
        ([-1, 1], 1, 1),  # its own parent
        ([-1, 2, -1], 1, 2),  # a parent after it
        ([-1, -1, 0], 2, 0),  # a parent whose subtree was closed by another root
        ([-1, 0, 0, 1], 3, 1),  # a parent whose subtree was closed by a sibling
        ([-1, -2], 1, -2),
    ],
)
def test_non_pre_order_parents_are_refused(parents, i, p):
    lens = [1] * len(parents)
    msg = rf"parent\[{i}\] = {p} breaks pre-order: a segment's parent must be the segment before it or one of its ancestors"
    with pytest.raises(ValueError, match=msg):
        host_rows(lens, parents)
    with pytest.raises(ValueError, match=msg):
        tree_segments(lens, parents)


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match=r"seg_len\[1\] must be >= 0, got -1"):
        tree_segments([2, -1], [-1, 0])
    with pytest.raises(ValueError, match=r"seg_len and parent must have one entry per segment, got 2 and 1"):
        host_rows([2, 1], [-1])


def test_dense_maps_siblings_by_hand():
    segs = tree_segments(SIB_LEN, SIB_PARENT)
    assert segment_ids(segs, 6).tolist() == [0, 0, 1, 2, 2, 3]
    assert token_reach(segs, 6).tolist() == [5, 5, 3, 5, 5, 6]
    assert dense_mask(segs, 6).long().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],  # the second response: the prompt and itself, not the first response
        [1, 1, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    # The first token of each response follows the prompt's last; a root's first token has none.
    assert previous_token_index(segs, 6).tolist() == [0, 0, 1, 1, 3, 5]
    for f in (segment_ids, token_reach, previous_token_index):
        assert f(segs, 6).dtype == torch.int64


def test_dense_maps_chain_by_hand():
    segs = tree_segments(CHAIN_LEN, CHAIN_PARENT)
    assert segment_ids(segs, 12).tolist() == [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4, 4]
    assert token_reach(segs, 12).tolist() == [6] * 6 + [12] * 6
    block = torch.ones(6, 6, dtype=torch.long).tril().tolist()
    assert dense_mask(segs, 12).long().tolist() == [r + [0] * 6 for r in block] + [[0] * 6 + r for r in block]
    assert previous_token_index(segs, 12).tolist() == [0, 0, 1, 2, 3, 4, 6, 6, 7, 8, 9, 10]


def test_empty_stream():
    segs = tree_segments([], [])
    assert segs.max_seg_len == 0 and segs.max_prefix_len == 0
    assert dense_mask(segs, 0).shape == (0, 0)
    assert segment_ids(segs, 0).tolist() == [] and previous_token_index(segs, 0).tolist() == []
