"""Tests of dualkv_compile.layout.detect on hand-written layouts: sequences, nodes, segments, stats.

veRL's left-padded prompts, groups of different sizes nesting under a common
token, min_shared, group_size, nested sharing and the edge cases (identical
rows, nothing shared, a row that is a prefix of another, empty rows). Each
expectation is written by hand in the notation of ``layout_cases.py``; nothing
expected is computed with the code under test.
"""

from __future__ import annotations

import pytest
import torch

from dualkv_compile.layout import dense_mask, detect, pack, unpack

from .layout_cases import MIXED_IDS, MIXED_MASK, VERL_IDS, VERL_MASK, VERL_NODES, VERL_SEGS, VERL_SEQS, T, check_segments, nodes_of, seqs_of


pytestmark = pytest.mark.usefixtures("one_thread")


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
