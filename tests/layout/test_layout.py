"""Tests of dualkv_compile.layout: detect, pack, unpack, segments, dense_mask, stats.

The detection cases below carry hand-written expectations (sequences, nodes,
segments, packed offsets, index maps); nothing expected here is computed with
the code under test. The randomized tests check properties against oracles
written independently in this file (a dict-of-dicts trie over the sequences'
keys, a per-sequence python loop over tokens).

Notation of the hand-written expectations:
    sequences  (row, start, end, leaf)
    nodes      (parent, offset, length, packed_start, source, count)
    segments   (seg_start, seg_len, parent, prefix_len, subtree_end)
"""

from __future__ import annotations

import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from dualkv_compile.layout import Segments, SharedPromptLayout, dense_mask, detect, pack, unpack
from dualkv_compile.layout.sequences import read_sequences


pytestmark = pytest.mark.usefixtures("one_thread")


def seqs_of(layout: SharedPromptLayout):
    return [(s.row, s.start, s.end, s.leaf) for s in layout.sequences]


def nodes_of(layout: SharedPromptLayout):
    return [(n.parent, n.offset, n.length, n.packed_start, n.source, n.count) for n in layout.nodes]


def check_segments(layout: SharedPromptLayout, expected: list[tuple[int, int, int, int, int]]):
    assert layout.segments() == expected
    segs = layout.attention_segments
    assert isinstance(segs, Segments)
    for t in segs[:5]:
        assert t.dtype == torch.int32 and t.device == layout.device
    got = list(zip(*(t.tolist() for t in segs[:5])))
    assert got == expected
    assert segs.max_seg_len == max((s[1] for s in expected), default=0)
    assert segs.max_prefix_len == max((s[3] for s in expected), default=0)
    assert layout.num_segments == len(expected)
    assert isinstance(segs.max_seg_len, int) and isinstance(segs.max_prefix_len, int)


def T(rows):
    return torch.tensor(rows, dtype=torch.long)


# --------------------------------------------------------------------------- hand-written layouts

# veRL / TRL: prompts left-padded to a common width, responses right-padded.
# Prompt [5, 6, 7] in columns 1..3 (column 0 is padding); responses of
# lengths 3, 1 and 0 in columns 4..6.
VERL_IDS = T([[0, 5, 6, 7, 10, 11, 12], [0, 5, 6, 7, 20, 0, 0], [0, 5, 6, 7, 0, 0, 0]])
VERL_MASK = T([[0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0, 0]])
# The prompt (read from row 0, flat 1), row 0's response (flat 4), row 1's (flat 7 + 4);
# row 2 is the prompt alone: it ends at the prompt's node.
VERL_NODES = [(-1, 0, 3, 0, 1, 3), (0, 3, 3, 3, 4, 1), (0, 3, 1, 6, 11, 1)]
VERL_SEQS = [(0, 1, 7, 1), (1, 1, 5, 2), (2, 1, 4, 0)]
VERL_SEGS = [(0, 3, -1, 0, 7), (3, 3, 0, 3, 6), (6, 1, 0, 3, 7)]


def test_verl_left_padded_prompt_right_padded_responses():
    L = detect(VERL_IDS, VERL_MASK)
    assert (L.batch_size, L.seq_len, L.num_tokens) == (3, 7, 7)
    assert seqs_of(L) == VERL_SEQS
    assert nodes_of(L) == VERL_NODES
    assert [L.path(i) for i in range(3)] == [[0, 1], [0, 2], [0]]
    assert [s.length for s in L.sequences] == [6, 4, 3]
    # The empty response has no segment of its own.
    check_segments(L, VERL_SEGS)
    assert L.pack_index.tolist() == [1, 2, 3, 4, 5, 6, 11]
    assert L.valid.view(3, 7).long().tolist() == VERL_MASK.tolist()
    ui = L.unpack_index.view(3, 7).tolist()
    assert [r[1:] for r in ui] == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 6, 0, 0], [0, 1, 2, 0, 0, 0]]
    assert L.pack_index.dtype == L.unpack_index.dtype == torch.long and L.valid.dtype == torch.bool
    assert not L.one_sequence_per_row()  # left padding: the sequences start at column 1
    assert L.depth() == 2
    assert L.token_multiplicity().tolist() == [3, 3, 3, 1, 1, 1, 1]


def test_verl_dense_mask_by_hand():
    L = detect(VERL_IDS, VERL_MASK)
    expected = [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 0, 0, 0, 1],  # row 1's response: the prompt and itself, not row 0's response
    ]
    assert L.dense_mask().long().tolist() == expected
    assert dense_mask(L.attention_segments, L.num_tokens).long().tolist() == expected


def test_verl_stats():
    s = detect(VERL_IDS, VERL_MASK).stats()
    assert (s.num_rows, s.num_groups, s.padded_tokens, s.num_sequences, s.depth) == (3, 1, 21, 3, 2)
    assert (s.tokens_before, s.tokens_after) == (13, 7)  # 6 + 4 + 3 -> 3 + 3 + 1
    # causal pairs n(n+1)/2: 21 + 10 + 6; after: prompt 6, response 0: 3*3 + 6, response 1: 3*1 + 1
    assert (s.attention_pairs_before, s.attention_pairs_after) == (37, 25)
    assert s.rho == pytest.approx(13 / 7)
    assert s.attention_ratio == pytest.approx(37 / 25)
    assert "13 -> 7" in str(s) and "3 sequences in 1 trees of depth 2" in str(s)


def test_design_formula_for_rho():
    # N rows of [P prompt | R response]: rho = N(P+R)/(P+NR); pairs N(P+R)(P+R+1)/2 -> ...
    N, P, R = 4, 5, 3
    rows = [[1, 2, 3, 4, 5] + [10 + n, 20 + n, 30 + n] for n in range(N)]
    s = detect(T(rows)).stats()
    assert (s.tokens_before, s.tokens_after) == (N * (P + R), P + N * R)
    assert s.attention_pairs_before == N * 8 * 9 // 2
    assert s.attention_pairs_after == 15 + N * (P * R + 6)


# Two groups of different sizes and a sequence of its own. Row 2 starts with
# the same token as rows 0 and 1: the five rows share that one token (a root
# of one token), the two groups branch below it; row 5 shares nothing.
MIXED_IDS = T(
    [
        [1, 2, 3, 4, 5, 0],
        [1, 2, 3, 7, 0, 0],
        [1, 9, 9, 9, 4, 4],
        [1, 9, 9, 9, 5, 0],
        [1, 9, 9, 9, 6, 6],
        [8, 8, 8, 8, 0, 0],
    ]
)
MIXED_MASK = T(
    [
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 0, 0],
    ]
)


def test_groups_of_different_sizes_nest_under_a_common_token():
    L = detect(MIXED_IDS, MIXED_MASK)
    assert seqs_of(L) == [(0, 0, 5, 2), (1, 0, 4, 3), (2, 0, 6, 5), (3, 0, 5, 6), (4, 0, 6, 7), (5, 0, 4, 8)]
    assert nodes_of(L) == [
        (-1, 0, 1, 0, 0, 5),  # [1]: rows 0..4
        (0, 1, 2, 1, 1, 2),  # [2, 3]: rows 0, 1
        (1, 3, 2, 3, 3, 1),  # [4, 5]
        (1, 3, 1, 5, 9, 1),  # [7]
        (0, 1, 3, 6, 13, 3),  # [9, 9, 9]: rows 2..4
        (4, 4, 2, 9, 16, 1),
        (4, 4, 1, 11, 22, 1),
        (4, 4, 2, 12, 28, 1),
        (-1, 0, 4, 14, 30, 1),  # row 5
    ]
    assert L.num_tokens == 18
    check_segments(
        L,
        [
            (0, 1, -1, 0, 14), (1, 2, 0, 1, 6), (3, 2, 1, 3, 5), (5, 1, 1, 3, 6), (6, 3, 0, 1, 14),
            (9, 2, 4, 4, 11), (11, 1, 4, 4, 12), (12, 2, 4, 4, 14), (14, 4, -1, 0, 18),
        ],
    )
    s = L.stats()
    assert (s.tokens_before, s.tokens_after, s.num_groups, s.depth) == (30, 18, 2, 3)
    assert L.pack_index.tolist() == [0, 1, 2, 3, 4, 9, 13, 14, 15, 16, 17, 22, 28, 29, 30, 31, 32, 33]
    assert L.token_multiplicity().tolist() == [5, 2, 2, 1, 1, 1, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1]


def test_min_shared_keeps_short_sharers_apart():
    # min_shared=2: the one-token root is copied into each branch.
    L = detect(MIXED_IDS, MIXED_MASK, min_shared=2)
    assert nodes_of(L) == [
        (-1, 0, 3, 0, 0, 2),
        (0, 3, 2, 3, 3, 1),
        (0, 3, 1, 5, 9, 1),
        (-1, 0, 4, 6, 12, 3),
        (3, 4, 2, 10, 16, 1),
        (3, 4, 1, 12, 22, 1),
        (3, 4, 2, 13, 28, 1),
        (-1, 0, 4, 15, 30, 1),
    ]
    check_segments(
        L,
        [
            (0, 3, -1, 0, 6), (3, 2, 0, 3, 5), (5, 1, 0, 3, 6), (6, 4, -1, 0, 15),
            (10, 2, 3, 4, 12), (12, 1, 3, 4, 13), (13, 2, 3, 4, 15), (15, 4, -1, 0, 19),
        ],
    )
    # min_shared=4: rows 0 and 1 (sharing 3) are apart too.
    L = detect(MIXED_IDS, MIXED_MASK, min_shared=4)
    assert nodes_of(L) == [
        (-1, 0, 5, 0, 0, 1),
        (-1, 0, 4, 5, 6, 1),
        (-1, 0, 4, 9, 12, 3),
        (2, 4, 2, 13, 16, 1),
        (2, 4, 1, 15, 22, 1),
        (2, 4, 2, 16, 28, 1),
        (-1, 0, 4, 18, 30, 1),
    ]
    assert L.num_tokens == 22
    L = detect(MIXED_IDS, MIXED_MASK, min_shared=5)
    assert [(n.parent, n.offset, n.count) for n in L.nodes] == [(-1, 0, 1)] * 6
    assert [n.source for n in L.nodes] == [0, 6, 12, 18, 24, 30]
    assert L.num_tokens == 30


GS_IDS = T([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 2, 3, 4, 8, 9], [1, 2, 3, 4, 8, 5]])
GS_NODES = [
    (-1, 0, 4, 0, 0, 4),  # [1, 2, 3, 4]: all four rows
    (0, 4, 1, 4, 4, 2),  # [5]: rows 0, 1
    (1, 5, 1, 5, 5, 1),
    (1, 5, 1, 6, 11, 1),
    (0, 4, 1, 7, 16, 2),  # [8]: rows 2, 3
    (4, 5, 1, 8, 17, 1),
    (4, 5, 1, 9, 23, 1),
]


def test_group_size_verifies_and_does_not_change_the_forest():
    # The forest nests the pairs under the four rows' common prefix whatever group_size says.
    for gs in (None, 1, 2, 4):
        L = detect(GS_IDS, group_size=gs)
        assert nodes_of(L) == GS_NODES, gs
    check_segments(
        L,
        [(0, 4, -1, 0, 10), (4, 1, 0, 4, 7), (5, 1, 1, 5, 6), (6, 1, 1, 5, 7), (7, 1, 0, 4, 10), (8, 1, 4, 5, 9), (9, 1, 4, 5, 10)],
    )
    # Verification uses min_shared too: with min_shared=5 the four-token root is copied into
    # the two pairs, which share 5 each; the four rows share nothing.
    L = detect(GS_IDS, group_size=2, min_shared=5)
    assert nodes_of(L) == [
        (-1, 0, 5, 0, 0, 2), (0, 5, 1, 5, 5, 1), (0, 5, 1, 6, 11, 1),
        (-1, 0, 5, 7, 12, 2), (3, 5, 1, 12, 17, 1), (3, 5, 1, 13, 23, 1),
    ]
    msg = r"group_size=4: rows 0\.\.3 share 0 leading tokens, expected at least min_shared=5"
    with pytest.raises(ValueError, match=msg):
        detect(GS_IDS, group_size=4, min_shared=5)


def test_group_size_failure_names_group_size_and_rows():
    # Rows 0..2 share the one-token root (enough for min_shared=1); rows 3..5 share nothing.
    with pytest.raises(ValueError, match=r"group_size=3: rows 3\.\.5 share 0 leading tokens, expected at least min_shared=1"):
        detect(MIXED_IDS, MIXED_MASK, group_size=3)
    with pytest.raises(ValueError, match=r"group_size=2: rows 4\.\.5 share 0"):
        detect(MIXED_IDS, MIXED_MASK, group_size=2)  # rows 4, 5 share nothing
    # With min_shared=2 the one-token root is copied into each branch: rows 0..2 share no node.
    with pytest.raises(ValueError, match=r"group_size=3: rows 0\.\.2 share 0 leading tokens, expected at least min_shared=2"):
        detect(MIXED_IDS, MIXED_MASK, group_size=3, min_shared=2)


@pytest.mark.parametrize("group_size", [0, -1, 4, 2.0, "2"])
def test_group_size_must_divide_batch(group_size):
    with pytest.raises(ValueError, match=r"group_size must be a positive integer dividing the batch size 6"):
        detect(MIXED_IDS, MIXED_MASK, group_size=group_size)


# The old adjacent-row search chose between groupings; the forest nests instead.


def test_pair_nests_under_what_the_third_row_shares():
    # A, A' share 7; B shares 3 with them: [1, 2, 3] for all three, [4..7] for A, A'.
    ids = T([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 9], [1, 2, 3, 9, 9, 9, 9, 9]])
    L = detect(ids)
    assert nodes_of(L) == [(-1, 0, 3, 0, 0, 3), (0, 3, 4, 3, 3, 2), (1, 7, 1, 7, 7, 1), (1, 7, 1, 8, 15, 1), (0, 3, 5, 9, 19, 1)]
    check_segments(L, [(0, 3, -1, 0, 14), (3, 4, 0, 3, 9), (7, 1, 1, 7, 8), (8, 1, 1, 7, 9), (9, 5, 0, 3, 14)])
    assert L.num_tokens == 14  # 24 - 2 * 3 - 4
    assert L.depth() == 3


def test_third_row_sharing_more_nests_deeper_root():
    # B shares 4 with A': [1, 2, 3, 4] for all three, [5, 6, 7] for A, A'.
    ids = T([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 9], [1, 2, 3, 4, 9, 9, 9, 9]])
    L = detect(ids)
    assert nodes_of(L) == [(-1, 0, 4, 0, 0, 3), (0, 4, 3, 4, 4, 2), (1, 7, 1, 7, 7, 1), (1, 7, 1, 8, 15, 1), (0, 4, 4, 9, 20, 1)]
    assert L.num_tokens == 13


def test_nested_sharing_attention_pairs():
    ids = T([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 7], [1, 2, 8, 8, 8, 8]])
    L = detect(ids)
    assert nodes_of(L) == [(-1, 0, 2, 0, 0, 3), (0, 2, 2, 2, 2, 2), (1, 4, 2, 4, 4, 1), (1, 4, 2, 6, 10, 1), (0, 2, 4, 8, 14, 1)]
    s = L.stats()
    assert (s.tokens_before, s.tokens_after) == (18, 12)
    # [1, 2]: 3; [3, 4]: 2*2 + 3; [5, 6] and [7, 7]: 4*2 + 3 each; [8 x4]: 2*4 + 10
    assert (s.attention_pairs_before, s.attention_pairs_after) == (63, 3 + 7 + 11 + 11 + 18)


def test_every_row_identical():
    ids = T([[0, 1, 2, 3, 4]] * 4)
    mask = T([[0, 1, 1, 1, 1]] * 4)
    L = detect(ids, mask)
    assert seqs_of(L) == [(b, 1, 5, 0) for b in range(4)]
    assert nodes_of(L) == [(-1, 0, 4, 0, 1, 4)]
    check_segments(L, [(0, 4, -1, 0, 4)])
    assert L.pack_index.tolist() == [1, 2, 3, 4]
    assert [r[1:] for r in L.unpack_index.view(4, 5).tolist()] == [[0, 1, 2, 3]] * 4
    s = L.stats()
    assert (s.tokens_before, s.tokens_after, s.attention_pairs_before, s.attention_pairs_after) == (16, 4, 40, 10)
    assert s.rho == 4.0
    assert L.copy_runs() == [(6, 1, 4), (11, 1, 4), (16, 1, 4)]
    assert L.token_multiplicity().tolist() == [4, 4, 4, 4]


def test_nothing_shared_gives_one_root_per_sequence():
    L = detect(T([[1, 2], [3, 4], [5, 6]]))
    assert nodes_of(L) == [(-1, 0, 2, 0, 0, 1), (-1, 0, 2, 2, 2, 1), (-1, 0, 2, 4, 4, 1)]
    check_segments(L, [(0, 2, -1, 0, 2), (2, 2, -1, 0, 4), (4, 2, -1, 0, 6)])
    assert L.pack_index.tolist() == list(range(6))
    s = L.stats()
    assert (s.tokens_before, s.tokens_after, s.rho, s.num_groups, s.depth) == (6, 6, 1.0, 3, 1)
    assert L.one_sequence_per_row() and L.copy_runs() == []


def test_single_row():
    L = detect(T([[0, 0, 7, 8]]), T([[0, 0, 1, 1]]))
    assert seqs_of(L) == [(0, 2, 4, 0)]
    assert nodes_of(L) == [(-1, 0, 2, 0, 2, 1)]
    check_segments(L, [(0, 2, -1, 0, 2)])
    assert L.pack_index.tolist() == [2, 3]


@pytest.mark.parametrize(
    "ids, mask",
    [(T([[0, 0, 7, 8]]), T([[0, 0, 1, 1]])), (T([[0, 1, 2, 3, 4]] * 4), T([[0, 1, 1, 1, 1]] * 4))],
    ids=["single_row", "identical_rows"],
)
def test_one_segment_tensors_own_their_storage(ids, mask):
    # A [1, 5] table's columns are contiguous views of it: the segment tensors then
    # shared one storage, which CUDA kernels writing near them refused (overlapping memory).
    L = detect(ids, mask)
    assert L.num_segments == 1
    tensors = L.attention_segments[:5]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 5
    assert all(t.is_contiguous() and t.untyped_storage().nbytes() == 4 for t in tensors)


def test_responses_sharing_first_tokens_extend_the_shared_prefix():
    # Prompt [1, 2, 3]; both responses start with [7, 7]: the shared node is 5 tokens.
    L = detect(T([[1, 2, 3, 7, 7, 8], [1, 2, 3, 7, 7, 9]]))
    assert nodes_of(L) == [(-1, 0, 5, 0, 0, 2), (0, 5, 1, 5, 5, 1), (0, 5, 1, 6, 11, 1)]
    check_segments(L, [(0, 5, -1, 0, 7), (5, 1, 0, 5, 6), (6, 1, 0, 5, 7)])


def test_row_that_is_a_prefix_of_another():
    # Row 0 is exactly row 1's first four tokens: it ends at the shared node.
    L = detect(T([[1, 2, 3, 4, 0, 0], [1, 2, 3, 4, 5, 6]]), T([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]))
    assert seqs_of(L) == [(0, 0, 4, 0), (1, 0, 6, 1)]
    assert nodes_of(L) == [(-1, 0, 4, 0, 0, 2), (0, 4, 2, 4, 10, 1)]
    check_segments(L, [(0, 4, -1, 0, 6), (4, 2, 0, 4, 6)])
    assert L.dense_mask().long().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
    ]


def test_responses_of_length_one():
    ids = T([[0, 1, 2, 5], [0, 1, 2, 6], [0, 1, 2, 7]])
    L = detect(ids, T([[0, 1, 1, 1]] * 3))
    assert nodes_of(L) == [(-1, 0, 2, 0, 1, 3), (0, 2, 1, 2, 3, 1), (0, 2, 1, 3, 7, 1), (0, 2, 1, 4, 11, 1)]
    check_segments(L, [(0, 2, -1, 0, 5), (2, 1, 0, 2, 3), (3, 1, 0, 2, 4), (4, 1, 0, 2, 5)])


def test_all_responses_empty():
    # Only the prompt in every row: one node, both sequences end there.
    ids = T([[0, 1, 2, 0], [0, 1, 2, 0]])
    L = detect(ids, T([[0, 1, 1, 0]] * 2))
    assert seqs_of(L) == [(0, 1, 3, 0), (1, 1, 3, 0)]
    assert nodes_of(L) == [(-1, 0, 2, 0, 1, 2)]
    check_segments(L, [(0, 2, -1, 0, 2)])


def test_row_with_zero_valid_tokens():
    # Row 1 is all padding (no sequence); rows 0 and 2 share three tokens
    # though they are not adjacent: sharing is between sequences in any order.
    ids = T([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5]])
    mask = T([[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    L = detect(ids, mask)
    assert seqs_of(L) == [(0, 0, 4, 1), (2, 0, 4, 2)]
    assert nodes_of(L) == [(-1, 0, 3, 0, 0, 2), (0, 3, 1, 3, 3, 1), (0, 3, 1, 4, 11, 1)]
    assert L.num_tokens == 5
    check_segments(L, [(0, 3, -1, 0, 5), (3, 1, 0, 3, 4), (4, 1, 0, 3, 5)])
    assert L.valid.view(3, 4).long().tolist() == mask.tolist()
    x = torch.arange(12.0).view(3, 4)
    # The shared node is read from row 0 only.
    assert unpack(pack(x, L), L).tolist() == [[0, 1, 2, 3], [0, 0, 0, 0], [0, 1, 2, 11]]
    assert L.sequence_ids().tolist() == [0, 0, 0, 0, -1, -1, -1, -1, 1, 1, 1, 1]


def test_empty_row_next_to_left_padded_row():
    ids = T([[0, 0, 0], [0, 4, 5], [0, 0, 0]])
    mask = T([[0, 0, 0], [0, 1, 1], [0, 0, 0]])
    L = detect(ids, mask)
    assert seqs_of(L) == [(1, 1, 3, 0)]
    assert nodes_of(L) == [(-1, 0, 2, 0, 4, 1)]
    assert L.pack_index.tolist() == [4, 5]


def test_every_row_empty():
    L = detect(T([[0, 0, 0], [0, 0, 0]]), T([[0, 0, 0], [0, 0, 0]]))
    assert L.num_tokens == 0
    assert L.sequences == () and L.nodes == ()
    check_segments(L, [])
    x = torch.randn(2, 3, 4, requires_grad=True)
    p = pack(x, L)
    assert p.shape == (0, 4)
    out = unpack(p, L)
    assert out.shape == (2, 3, 4) and not out.any()
    out.sum().backward()
    assert x.grad is not None and not x.grad.any()
    s = L.stats()
    assert (s.tokens_before, s.tokens_after, s.num_sequences, s.depth) == (0, 0, 0, 0)
    assert L.dense_mask().shape == (0, 0)
    assert L.token_multiplicity().tolist() == [] and L.copy_runs() == []
    assert L.sequence_ids().tolist() == [-1] * 6


def test_default_mask_is_all_ones():
    ids = T([[1, 2, 3], [1, 2, 4]])
    L = detect(ids)
    assert nodes_of(L) == [(-1, 0, 2, 0, 0, 2), (0, 2, 1, 2, 2, 1), (0, 2, 1, 3, 5, 1)]
    assert L.valid.all()
    assert L.one_sequence_per_row()


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int32, torch.int64, torch.float32, torch.bfloat16])
def test_mask_dtypes(mask_dtype):
    L = detect(VERL_IDS.to(torch.int32), VERL_MASK.to(mask_dtype))
    assert nodes_of(L) == VERL_NODES and seqs_of(L) == VERL_SEQS


def test_pad_tokens_do_not_matter():
    # Different pad ids (and the pad id equal to a real token) change nothing.
    ids = VERL_IDS.clone()
    ids[0, 0], ids[1, 5], ids[2, 4] = 99, 10, 20
    L = detect(ids, VERL_MASK)
    assert nodes_of(L) == VERL_NODES and seqs_of(L) == VERL_SEQS


def test_same_tokens_different_padding_are_not_shared_unless_columns_do_not_matter():
    # Same valid tokens, but left-padded in one row and right-padded in the
    # other: the columns differ, so with same_columns (the default) nothing is shared.
    ids, mask = T([[0, 1, 2, 3], [1, 2, 3, 0]]), T([[0, 1, 1, 1], [1, 1, 1, 0]])
    L = detect(ids, mask)
    assert nodes_of(L) == [(-1, 0, 3, 0, 1, 1), (-1, 0, 3, 3, 4, 1)]
    # same_columns=False (the program reads no value of the column): one node.
    L = detect(ids, mask, same_columns=False)
    assert seqs_of(L) == [(0, 1, 4, 0), (1, 0, 3, 0)]
    assert nodes_of(L) == [(-1, 0, 3, 0, 1, 2)]
    assert L.unpack_index.view(2, 4).tolist()[1][:3] == [0, 1, 2]
    assert L.copy_runs() == [(4, 1, 3)]
    # ... unless the positions differ (default-style positions: the column).
    L = detect(ids, mask, torch.arange(4).view(1, 4), same_columns=False)
    assert nodes_of(L) == [(-1, 0, 3, 0, 1, 1), (-1, 0, 3, 3, 4, 1)]
    # HF-style positions (cumsum of the mask - 1) agree: shared again.
    L = detect(ids, mask, (mask.cumsum(1) - 1).clamp(min=0), same_columns=False)
    assert nodes_of(L) == [(-1, 0, 3, 0, 1, 2)]


# --------------------------------------------------------------------------- position ids


def test_position_ids_1xS_and_BxS():
    pos1 = torch.arange(7).view(1, 7)
    for pos in (pos1, pos1.expand(3, 7)):
        L = detect(VERL_IDS, VERL_MASK, pos)
        assert nodes_of(L) == VERL_NODES and seqs_of(L) == VERL_SEQS
    # HF style: cumsum of the mask - 1, padding filled with 1 (differs between rows).
    pos = (VERL_MASK.cumsum(1) - 1).masked_fill(VERL_MASK == 0, 1)
    L = detect(VERL_IDS, VERL_MASK, pos)
    assert nodes_of(L) == VERL_NODES and seqs_of(L) == VERL_SEQS


def test_position_jump_starts_a_new_sequence():
    # Row 1's positions jump at column 2 (1 -> 7): columns 0..1 and 2..4 are two
    # sequences. The first shares [1, 2] with row 0 (and ends there); the second
    # has positions 7.. that no other sequence has.
    ids = T([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]])
    pos = T([[0, 1, 2, 3, 4], [0, 1, 7, 8, 9]])
    L = detect(ids, position_ids=pos)
    assert seqs_of(L) == [(0, 0, 5, 1), (1, 0, 2, 0), (1, 2, 5, 2)]
    assert nodes_of(L) == [(-1, 0, 2, 0, 0, 2), (0, 2, 3, 2, 2, 1), (-1, 0, 3, 5, 7, 1)]
    # Offset positions (continuing, but from another start) share nothing.
    pos = T([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]])
    L = detect(ids, position_ids=pos)
    assert seqs_of(L) == [(0, 0, 5, 0), (1, 0, 5, 1)]
    assert nodes_of(L) == [(-1, 0, 5, 0, 0, 1), (-1, 0, 5, 5, 5, 1)]


def test_position_ids_differing_only_at_padding_are_ignored():
    ids = T([[0, 1, 2, 3], [0, 1, 2, 4]])
    mask = T([[0, 1, 1, 1]] * 2)
    pos = T([[0, 0, 1, 2], [5, 0, 1, 2]])
    L = detect(ids, mask, pos)
    assert nodes_of(L) == [(-1, 0, 2, 0, 1, 2), (0, 2, 1, 2, 3, 1), (0, 2, 1, 3, 7, 1)]


# --------------------------------------------------------------------------- bad input


def test_bad_input_ids():
    with pytest.raises(ValueError, match=r"input_ids.*\[B, S\].*\[6\]"):
        detect(torch.arange(6))
    with pytest.raises(ValueError, match=r"input_ids.*\[B, S\]"):
        detect(torch.zeros(2, 3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids"):
        detect([[1, 2], [3, 4]])
    for dtype in (torch.float32, torch.float64, torch.bool, torch.complex64):
        with pytest.raises(ValueError, match=r"input_ids.*integer"):
            detect(torch.ones(2, 3, dtype=dtype))
    with pytest.raises(ValueError, match="input_ids"):
        detect(torch.zeros(0, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids"):
        detect(torch.zeros(2, 0, dtype=torch.long))


def test_bad_attention_mask():
    ids = T([[1, 2, 3, 4], [1, 2, 3, 5]])
    with pytest.raises(ValueError, match=r"attention_mask.*\[2, 4\].*\[2, 3\]"):
        detect(ids, torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask.*\[2, 4\]"):
        detect(ids, torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        detect(ids, [[1, 1, 1, 1], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"attention_mask.*0 and 1"):
        detect(ids, T([[1, 1, 1, 1], [1, 2, 1, 1]]))
    with pytest.raises(ValueError, match=r"attention_mask.*0 and 1"):
        detect(ids, torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.5, 1.0, 1.0]]))
    with pytest.raises(ValueError, match=r"attention_mask.*0 and 1"):
        detect(ids, T([[1, 1, 1, 1], [-1, 1, 1, 1]]))
    with pytest.raises(ValueError, match=r"attention_mask.*contiguous.*rows \[1\]"):
        detect(ids, T([[0, 1, 1, 1], [1, 0, 1, 1]]))
    with pytest.raises(ValueError, match=r"attention_mask.*rows \[0, 1\]"):
        detect(ids, T([[1, 1, 0, 1], [1, 0, 0, 1]]))


def test_bad_position_ids():
    ids = T([[1, 2, 3, 4], [1, 2, 3, 5]])
    for bad in (torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long), torch.zeros(4, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"position_ids.*\[2, 4\]"):
            detect(ids, position_ids=bad)
    with pytest.raises(ValueError, match=r"position_ids must have shape \[B, S\] = \[2, 4\] or \[1, S\], got list"):
        detect(ids, position_ids=[[0, 1, 2, 3]])


@pytest.mark.parametrize("min_shared", [0, -3, 1.5])
def test_bad_min_shared(min_shared):
    with pytest.raises(ValueError, match="min_shared must be a positive integer"):
        detect(T([[1, 2]]), min_shared=min_shared)


def test_bad_pack_unpack_shapes():
    L = detect(VERL_IDS, VERL_MASK)
    with pytest.raises(ValueError, match=r"\[B, S, \.\.\.\].*B=3, S=7.*\[3, 6\]"):
        pack(torch.zeros(3, 6), L)
    with pytest.raises(ValueError, match=r"B=3"):
        pack(torch.zeros(7), L)
    with pytest.raises(ValueError, match=r"\[T, \.\.\.\].*T=7.*\[6, 2\]"):
        unpack(torch.zeros(6, 2), L)


# --------------------------------------------------------------------------- pack / unpack


def test_pack_unpack_by_hand():
    L = detect(VERL_IDS, VERL_MASK)
    x = torch.arange(21.0).view(3, 7) + 100
    x[1:, 1:4] = x[0, 1:4]  # the shared columns agree across the sequences
    p = pack(x, L)
    assert p.tolist() == [101, 102, 103, 104, 105, 106, 111]
    assert unpack(p, L).tolist() == [
        [0, 101, 102, 103, 104, 105, 106],
        [0, 101, 102, 103, 111, 0, 0],
        [0, 101, 102, 103, 0, 0, 0],
    ]


def test_pack_unpack_trailing_dims_and_dtypes():
    L = detect(VERL_IDS, VERL_MASK)
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        x = torch.ones(3, 7, 2, 3, dtype=dtype)
        p = pack(x, L)
        assert p.shape == (7, 2, 3) and p.dtype == dtype
        u = unpack(p, L)
        assert u.shape == (3, 7, 2, 3) and u.dtype == dtype
        assert u.to(torch.long).sum(dim=(2, 3)).tolist() == (VERL_MASK * 6).tolist()


def test_pack_reads_each_node_from_its_first_sequence():
    # The docstring's guarantee: a shared node comes from the first sequence that holds it.
    L = detect(VERL_IDS, VERL_MASK)
    x = torch.arange(21.0, dtype=torch.float64).view(3, 7).requires_grad_()
    g = torch.arange(1.0, 8.0, dtype=torch.float64)
    pack(x, L).backward(g)
    assert x.grad.tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 7, 0, 0], [0, 0, 0, 0, 0, 0, 0]]


def test_unpack_gradient_sums_shared_copies_by_hand():
    L = detect(VERL_IDS, VERL_MASK)
    y = torch.zeros(7, dtype=torch.float64, requires_grad=True)
    g = torch.tensor(
        [
            [1000.0, 1, 2, 4, 8, 16, 32],
            [2000.0, 64, 128, 256, 512, 3000, 4000],
            [5000.0, 1024, 2048, 4096, 6000, 7000, 8000],
        ],
        dtype=torch.float64,
    )  # the large values sit at padding: they must not reach y
    unpack(y, L).backward(g)
    assert y.grad.tolist() == [1 + 64 + 1024, 2 + 128 + 2048, 4 + 256 + 4096, 8, 16, 32, 512]


def test_gradcheck_pack_and_unpack():
    L = detect(MIXED_IDS, MIXED_MASK)
    y = torch.randn(L.num_tokens, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: unpack(t, L), (y,))
    assert torch.autograd.gradgradcheck(lambda t: unpack(t, L), (y,))
    x = torch.randn(6, 6, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: pack(t, L), (x,))
    L = detect(VERL_IDS, VERL_MASK)
    y = torch.randn(L.num_tokens, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: unpack(t, L), (y,))


# --------------------------------------------------------------------------- randomized


@st.composite
def sequence_sets(draw, max_seqs=7, vocab=3):
    """Token sequences that nest: each new one is either fresh or a prefix of an
    earlier one (possibly all of it, possibly none) extended by a few tokens, so
    system prompts, group prompts, responses, identical sequences and sequences
    that end inside another all occur. A small vocabulary adds chance sharing."""
    seqs = []
    for _ in range(draw(st.integers(1, max_seqs))):
        if seqs and draw(st.booleans()):
            base = draw(st.sampled_from(seqs))
            base = base[: draw(st.integers(0, len(base)))]
        else:
            base = []
        seq = base + draw(st.lists(st.integers(1, vocab), max_size=3))
        seqs.append(seq or [draw(st.integers(1, vocab))])
    return seqs


@st.composite
def forest_batches(draw, vocab=3):
    """A batch of nested sequences in one of the layouts trainers use, rows shuffled.

    right  one sequence per row, right-padded (a row may be all padding)
    left   one sequence per row, left-padded
    verl   prompt (the first P tokens) left-padded to P, the rest right-padded
    packed several sequences per row, positions restarting at each (veRL remove-padding,
           TRL padding-free); one row without a mask, or right-padded rows
    Returns (input_ids, attention_mask or None, position_ids or None, same_columns).
    """
    seqs = draw(sequence_sets(vocab=vocab))
    kind = draw(st.sampled_from(["right", "left", "verl", "packed"]))
    rows, masks, poss = [], [], []  # per row: ids, mask, restarting positions
    if kind == "packed":
        n_rows = draw(st.integers(1, min(3, len(seqs))))
        cuts = sorted(draw(st.lists(st.integers(1, len(seqs) - 1), max_size=n_rows - 1, unique=True))) if len(seqs) > 1 else []
        bounds = [0] + cuts + [len(seqs)]
        for lo, hi in zip(bounds, bounds[1:]):
            row = [t for s in seqs[lo:hi] for t in s]
            rows.append(row)
            masks.append([1] * len(row))
            poss.append([p for s in seqs[lo:hi] for p in range(len(s))])
        S = max(len(r) for r in rows) + draw(st.integers(0, 1))
        for r, m, p in zip(rows, masks, poss):
            n = S - len(r)
            r += [0] * n
            m += [0] * n
            p += [0] * n
    else:
        if kind != "left" and draw(st.booleans()):
            seqs = seqs + [[]]  # a row of padding only
        P = draw(st.integers(0, 3)) if kind == "verl" else 0
        S0 = max(len(s) for s in seqs) + draw(st.integers(0, 1))
        R = max(max(len(s) - P, 0) for s in seqs) + draw(st.integers(0, 1))
        S = P + R if kind == "verl" else S0
        S = max(S, 1)
        for s in seqs:
            if kind == "right":
                lp = 0
            elif kind == "left":
                lp = S - len(s)
            else:
                lp = P - min(P, len(s))
            rp = S - lp - len(s)
            rows.append([0] * lp + s + [0] * rp)
            masks.append([0] * lp + [1] * len(s) + [0] * rp)
            poss.append([0] * lp + list(range(len(s))) + [0] * rp)
    ids, mask, hf_pos = T(rows), T(masks), T(poss)
    perm = draw(st.permutations(range(ids.shape[0])))
    ids, mask, hf_pos = ids[perm], mask[perm], hf_pos[perm]
    if draw(st.booleans()):  # pad ids are arbitrary, even real tokens
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        ids = torch.where(mask.bool(), ids, torch.randint(0, vocab + 1, ids.shape, generator=g))
    if kind == "packed":
        pos_kind = draw(st.sampled_from(["restart", "perturbed"]))
    else:
        pos_kind = draw(st.sampled_from(["none", "arange", "restart", "perturbed"]))
    if pos_kind == "none":
        pos = None
    elif pos_kind == "arange":
        pos = torch.arange(ids.shape[1]).view(1, -1)
    else:
        pos = hf_pos
        if pos_kind == "perturbed":  # some row's positions jump somewhere
            b = draw(st.integers(0, ids.shape[0] - 1))
            c = draw(st.integers(0, ids.shape[1] - 1))
            pos = pos.clone()
            pos[b, c:] += 1
    if kind == "packed" and ids.shape[0] == 1 and bool(mask.all()) and draw(st.booleans()):
        mask = None  # veRL remove-padding: one [1, total] row, no mask
    same_columns = draw(st.booleans())
    return ids, mask, pos, same_columns


def oracle_sequences(ids, mask, pos):
    """(row, start, end) of each sequence: valid runs split where the positions do not continue."""
    B, S = ids.shape
    m = torch.ones(B, S, dtype=torch.long) if mask is None else mask
    p = None if pos is None else pos.expand(B, S)
    out = []
    for b in range(B):
        start = None
        for c in range(S + 1):
            on = c < S and bool(m[b, c])
            new = on and (start is None or (p is not None and int(p[b, c]) != int(p[b, c - 1]) + 1))
            if start is not None and (not on or new):
                out.append((b, start, c))
                start = None
            if new:
                start = c
    return out


def oracle_keys(ids, pos, same_columns, b, c):
    key = [int(ids[b, c])]
    if pos is not None:
        key.append(int(pos.expand(ids.shape)[b, c]))
    if same_columns:
        key.append(c)
    return tuple(key)


class _Trie:
    """A plain trie over key tuples: one node per token, counting the sequences through it and ending at it."""

    def __init__(self):
        self.children: dict[tuple, _Trie] = {}
        self.count = 0
        self.end = 0

    def insert(self, keys):
        n = self
        for k in keys:
            n = n.children.setdefault(k, _Trie())
            n.count += 1
        n.end += 1


def trie_nodes(root: _Trie, min_shared: int) -> list[tuple[int, int]]:
    """(length, count) of each node of the packed forest, from the trie.

    Chains of trie nodes that no sequence leaves or ends in compact into one
    node; a compacted node shared by several sequences but shorter (with what
    it inherits) than ``min_shared`` is dissolved: each sequence ending there
    gets its own copy, and its children inherit its tokens."""
    out = []

    def walk(n, length, carry):
        while n.end == 0 and len(n.children) == 1:
            (n,) = n.children.values()
            length += 1
        size = carry + length
        if n.count >= 2 and size < min_shared:
            out.extend([(size, 1)] * n.end)
            for c in n.children.values():
                walk(c, 1, size)
        else:
            out.append((size, n.count))
            for c in n.children.values():
                walk(c, 1, 0)

    for c in root.children.values():
        walk(c, 1, 0)
    return out


@settings(max_examples=150, deadline=None)
@given(batch=forest_batches(), min_shared=st.integers(1, 3), data=st.data())
def test_detect_properties_against_trie_oracle(batch, min_shared, data):
    ids, mask, pos, same_columns = batch
    B, S = ids.shape
    L = detect(ids, mask, pos, min_shared=min_shared, same_columns=same_columns)
    valid = torch.ones(B, S, dtype=torch.bool) if mask is None else mask.bool()

    # Sequences: valid runs split where positions restart, in row and column order.
    seqs = oracle_sequences(ids, mask, pos)
    assert [(s.row, s.start, s.end) for s in L.sequences] == seqs
    keys = [[oracle_keys(ids, pos, same_columns, b, c) for c in range(s, e)] for b, s, e in seqs]

    # The forest: as many packed tokens (and the same nodes) as the compacted trie.
    trie = _Trie()
    for k in keys:
        trie.insert(k)
    expected = trie_nodes(trie, min_shared)
    if min_shared == 1:
        distinct = {tuple(k[:j]) for k in keys for j in range(1, len(k) + 1)}
        assert L.num_tokens == len(distinct)
    assert L.num_tokens == sum(n for n, _ in expected)
    assert sorted((n.length, n.count) for n in L.nodes) == sorted(expected)
    assert all(n.length >= min_shared for n in L.nodes if n.count > 1)

    # Paths: pre-order, offsets add up, every copy of a node holds the same keys,
    # each node read from its first sequence, children in order of first sequence.
    holders = [[] for _ in L.nodes]
    for i, (b, s, e) in enumerate(seqs):
        path = L.path(i)
        off = 0
        for n in path:
            node = L.nodes[n]
            assert node.offset == off and node.length > 0
            holders[n].append(i)
            src_b, src_c = divmod(node.source, S)
            src = [oracle_keys(ids, pos, same_columns, src_b, c) for c in range(src_c, src_c + node.length)]
            assert keys[i][off : off + node.length] == src
            off += node.length
        assert off == e - s
    packed = 0
    for n, node in enumerate(L.nodes):
        assert node.packed_start == packed
        packed += node.length
        assert node.parent < n and node.count == len(holders[n]) >= 1
        first = holders[n][0]
        assert node.source == seqs[first][0] * S + seqs[first][1] + node.offset
        assert L.pack_index[node.packed_start : node.packed_start + node.length].tolist() == list(
            range(node.source, node.source + node.length)
        )
    assert packed == L.num_tokens
    for p in {-1, *range(len(L.nodes))}:
        kids = [n for n, node in enumerate(L.nodes) if node.parent == p]
        assert [holders[n][0] for n in kids] == sorted(holders[n][0] for n in kids)

    # Segments: one per node; prefix = offset; subtree end = the end of the last descendant.
    ends = [node.packed_start + node.length for node in L.nodes]
    for n in reversed(range(len(L.nodes))):
        if L.nodes[n].parent >= 0:
            ends[L.nodes[n].parent] = max(ends[L.nodes[n].parent], ends[n])
    assert L.segments() == [(nd.packed_start, nd.length, nd.parent, nd.offset, ends[n]) for n, nd in enumerate(L.nodes)]

    # The mask, restricted to a sequence's packed tokens, is exactly causal over it;
    # and its tokens see nothing else.
    M = L.dense_mask()
    packed_of = []
    for i in range(len(seqs)):
        idx = [t for n in L.path(i) for t in range(L.nodes[n].packed_start, L.nodes[n].packed_start + L.nodes[n].length)]
        idx = torch.tensor(idx, dtype=torch.long)
        packed_of.append(idx)
        n = idx.numel()
        assert torch.equal(M[idx][:, idx], torch.ones(n, n, dtype=torch.bool).tril())
        assert M[idx].sum(1).tolist() == list(range(1, n + 1))

    # Stats, multiplicities, sequence ids and copy runs.
    s = L.stats()
    lens = [e - s_ for _, s_, e in seqs]
    assert s.tokens_before == sum(lens) == int(valid.sum())
    assert s.tokens_after == L.num_tokens and s.num_sequences == len(seqs)
    assert s.attention_pairs_before == sum(n * (n + 1) // 2 for n in lens)
    assert s.attention_pairs_after == int(M.sum())
    assert s.num_groups == sum(1 for n in L.nodes if n.parent < 0)
    assert s.depth == max((len(L.path(i)) for i in range(len(seqs))), default=0)
    mult = torch.zeros(L.num_tokens, dtype=torch.long)
    for idx in packed_of:
        mult[idx] += 1
    assert torch.equal(L.token_multiplicity(), mult)
    sid = torch.full((B * S,), -1, dtype=torch.long)
    for i, (b, s_, e) in enumerate(seqs):
        sid[b * S + s_ : b * S + e] = i
    assert torch.equal(L.sequence_ids(), sid)
    runs = L.copy_runs()
    assert sum(n for _, _, n in runs) == s.tokens_before - s.tokens_after
    for dst, src, n in runs:
        assert dst != src
        assert [oracle_keys(ids, pos, same_columns, *divmod(dst + j, S)) for j in range(n)] == [
            oracle_keys(ids, pos, same_columns, *divmod(src + j, S)) for j in range(n)
        ]

    # pack/unpack: a value that depends only on the keys comes back at valid
    # positions, zero at padding.
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    x = torch.randn(8, 2, generator=g, dtype=torch.float64)[ids]
    if pos is not None:
        x = x + pos.expand(B, S).unsqueeze(-1).double() * 0.125
    if same_columns:
        x = x + torch.randn(S, 2, generator=g, dtype=torch.float64)
    u = unpack(pack(x, L), L)
    assert torch.equal(u, torch.where(valid.unsqueeze(-1), x, 0.0))
    assert torch.equal(L.valid.view(B, S), valid)

    # unpack's backward: each packed token gets the sum of the gradients at
    # every position that reads it (oracle: a python loop over the paths).
    y = torch.randn(L.num_tokens, 2, generator=g, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(B, S, 2, generator=g, dtype=torch.float64)
    unpack(y, L).backward(dout)
    ts, bs, cs = [], [], []
    for i, (b, s_, e) in enumerate(seqs):
        for j, t in enumerate(packed_of[i].tolist()):
            ts.append(t)
            bs.append(b)
            cs.append(s_ + j)
    expected_grad = torch.zeros_like(y).index_add_(0, torch.tensor(ts, dtype=torch.long), dout[bs, cs])
    torch.testing.assert_close(y.grad, expected_grad, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- one sync


class _CountHostSyncs(TorchFunctionMode):
    """CPU proxy for device-to-host syncs: counts the calls that, on a CUDA
    tensor, read device data on the host (or wait for the device to size a
    result).

    Host tensors are tracked: ``.cpu()``'s result, factories called without a
    ``device`` (``torch.tensor(...)``, ``torch.arange(n)``) and whatever is
    computed from host tensors alone. Reading those costs no sync, nor does
    moving one to the device (a host-to-device copy, not counted here: the
    CUDA test below sees those). Anything else is taken to live on the device."""

    ALWAYS = {
        "tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy",
        "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose",
        "__repr__", "__format__", "bincount",
    }
    FACTORIES = {"tensor", "as_tensor", "arange", "zeros", "ones", "full", "empty", "randint", "randn", "rand"}

    def __init__(self):
        super().__init__()
        self.syncs = []
        self._host = {}  # id -> weakref of host tensors

    def is_host(self, t):
        r = self._host.get(id(t))
        return r is not None and r() is t

    def _mark(self, out):
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self._host[id(o)] = weakref.ref(o)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        inputs += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
        inputs += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        host = bool(inputs) and all(self.is_host(t) for t in inputs)
        self_t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        hit = name in self.ALWAYS
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            hit = True
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put") and len(args) > 1:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            hit |= any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
        if name in ("cpu", "to") and self_t is not None:
            hit = True
        if name == "tensor" and inputs:
            hit = True
        if hit and not host:
            self.syncs.append(name)
        out = func(*args, **kwargs)
        if name in ("cpu", "to") and out is self_t:
            out = out.clone()  # on CPU these return their input: stand for the copy a device would make
        if name == "cpu" or (name in self.FACTORIES and kwargs.get("device") is None and not inputs):
            self._mark(out)
        elif host and name != "to":  # a host tensor moved with .to(device) is on the device
            self._mark(out)
        return out


def test_proxy_counts_syncs():
    t = torch.arange(4)  # built outside the mode: a device tensor for the proxy
    with _CountHostSyncs() as c:
        t.tolist()
        bool(t[0])
        t[t > 1]
        t.nonzero()
        h = t.cpu()
        torch.tensor([1, 2]).to(t.device)  # host -> device: not counted
        # Reading host data is free: .cpu()'s result, host factories, and what they compute.
        h.tolist()
        int(h[1] + 1)
        (h > 1).nonzero().tolist()
        torch.where(h > 1, torch.arange(4), 0).amax().item()
        torch.tensor([3, 4]).tolist()
        # ... but not once moved to the device, nor when mixed with device data.
        torch.tensor([3, 4]).to(t.device).tolist()
        (h + t).tolist()
    assert c.syncs == ["tolist", "__bool__", "__getitem__", "nonzero", "cpu", "tolist", "tolist"]


# veRL remove-padding: one [1, total] row of four sequences, positions restarting, no mask.
PACKED_IDS = T([[1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 9, 7, 7]])
PACKED_POS = T([[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 0, 1]])


@pytest.mark.parametrize(
    "ids, kwargs",
    [
        (VERL_IDS, dict()),
        (VERL_IDS, dict(attention_mask=VERL_MASK)),
        (VERL_IDS, dict(attention_mask=VERL_MASK.bool(), position_ids=torch.arange(7).view(1, 7))),
        (VERL_IDS, dict(attention_mask=VERL_MASK, position_ids=(VERL_MASK.cumsum(1) - 1).clamp(min=0), group_size=3)),
        (VERL_IDS, dict(attention_mask=VERL_MASK, group_size=1, min_shared=2)),
        (MIXED_IDS, dict(attention_mask=MIXED_MASK)),
        (MIXED_IDS, dict(attention_mask=MIXED_MASK, min_shared=3, same_columns=False)),
        (PACKED_IDS, dict(position_ids=PACKED_POS, same_columns=False)),
        (PACKED_IDS, dict(position_ids=PACKED_POS)),
        (T([[0, 0, 0], [0, 0, 0]]), dict(attention_mask=T([[0, 0, 0], [0, 0, 0]]))),
    ],
    ids=["verl_no_mask", "verl", "verl_pos_1xS", "verl_hf_pos_group_size", "verl_min_shared", "mixed",
         "mixed_min_shared_any_column", "packed_row", "packed_row_same_columns", "all_padding"],
)
def test_detect_does_one_host_sync(ids, kwargs):
    with _CountHostSyncs() as c:
        detect(ids, **kwargs)
    assert c.syncs == ["cpu"], c.syncs


def test_read_sequences_does_one_host_sync():
    with _CountHostSyncs() as c:
        read_sequences(PACKED_IDS, None, PACKED_POS, same_columns=False)
    assert c.syncs == ["cpu"], c.syncs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_detect_one_cuda_sync():
    import warnings

    dev = torch.device("cuda")
    cases = [
        (VERL_IDS.to(dev), VERL_MASK.to(dev), None, None, True),
        (MIXED_IDS.to(dev), MIXED_MASK.to(dev), torch.arange(6, device=dev).view(1, 6), None, True),
        (VERL_IDS.to(dev), VERL_MASK.to(dev), (VERL_MASK.to(dev).cumsum(1) - 1).clamp(min=0), 3, True),
        (PACKED_IDS.to(dev), None, PACKED_POS.to(dev), None, False),
    ]
    for ids, mask, pos, gs, same_columns in cases:
        detect(ids, mask, pos, group_size=gs, same_columns=same_columns)  # warm up (allocators, pinned memory)
        torch.cuda.synchronize()
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                L = detect(ids, mask, pos, group_size=gs, same_columns=same_columns)
        finally:
            torch.cuda.set_sync_debug_mode(prev)
        syncs = [x for x in w if "synchronizing" in str(x.message)]
        assert len(syncs) <= 1, [(x.filename, x.lineno) for x in syncs]
        assert L.pack_index.device.type == "cuda" and L.attention_segments.seg_start.device.type == "cuda"
        ref = detect(
            ids.cpu(), None if mask is None else mask.cpu(), None if pos is None else pos.cpu(),
            group_size=gs, same_columns=same_columns,
        )
        assert L.sequences == ref.sequences and L.nodes == ref.nodes
        for name in ("pack_index", "unpack_index", "valid"):
            assert torch.equal(getattr(L, name).cpu(), getattr(ref, name)), name
        for name in ("seg_start", "seg_len", "parent", "prefix_len", "subtree_end"):
            assert torch.equal(getattr(L.attention_segments, name).cpu(), getattr(ref.attention_segments, name)), name
