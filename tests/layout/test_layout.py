"""Tests of dualkv_compile.layout: detect, pack, unpack, segments, dense_mask, stats.

The detection cases below carry hand-written expectations (groups, shared
lengths, packed offsets, segments, index maps); nothing expected here is
computed with the code under test. The randomized tests check properties
against oracles written independently in this file (a brute-force search
over all groupings, a per-row python loop over tokens).
"""

from __future__ import annotations

import itertools
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from dualkv_compile.layout import Segments, SharedPromptLayout, dense_mask, detect, pack, unpack


pytestmark = pytest.mark.usefixtures("one_thread")


def groups_of(layout: SharedPromptLayout):
    """(first row, end row, starts, ends, shared_len, packed_offset, rest_offsets) per group."""
    return [
        (g.rows.start, g.rows.stop, g.starts, g.ends, g.shared_len, g.packed_offset, g.rest_offsets)
        for g in layout.groups
    ]


def check_segments(layout: SharedPromptLayout, expected: list[tuple[int, int, int, int]]):
    assert layout.segments() == expected
    segs = layout.attention_segments
    assert isinstance(segs, Segments)
    for t in segs[:4]:
        assert t.dtype == torch.int32 and t.device == layout.device
    got = list(zip(*(t.tolist() for t in segs[:4])))
    assert got == expected
    assert segs.max_seg_len == max((s[1] for s in expected), default=0)
    assert segs.max_prefix_len == max((s[3] for s in expected), default=0)
    assert layout.num_segments == len(expected)


def T(rows):
    return torch.tensor(rows, dtype=torch.long)


# --------------------------------------------------------------------------- hand-written layouts

# veRL / TRL: prompts left-padded to a common width, responses right-padded.
# Prompt [5, 6, 7] in columns 1..3 (column 0 is padding); responses of
# lengths 3, 1 and 0 in columns 4..6.
VERL_IDS = T([[0, 5, 6, 7, 10, 11, 12], [0, 5, 6, 7, 20, 0, 0], [0, 5, 6, 7, 0, 0, 0]])
VERL_MASK = T([[0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0, 0]])


def test_verl_left_padded_prompt_right_padded_responses():
    L = detect(VERL_IDS, VERL_MASK)
    assert (L.batch_size, L.seq_len, L.num_tokens) == (3, 7, 7)
    assert groups_of(L) == [(0, 3, (1, 1, 1), (7, 5, 4), 3, 0, (3, 6, 7))]
    assert L.groups[0].rest_lens == (3, 1, 0)
    # Response of length 0 has no segment of its own.
    check_segments(L, [(0, 3, 0, 0), (3, 3, 0, 3), (6, 1, 0, 3)])
    # Packed stream: prompt from row 0 (flat 1, 2, 3), row 0's response (4, 5, 6), row 1's (7 + 4).
    assert L.pack_index.tolist() == [1, 2, 3, 4, 5, 6, 11]
    assert L.valid.view(3, 7).long().tolist() == VERL_MASK.tolist()
    ui = L.unpack_index.view(3, 7).tolist()
    assert [r[1:] for r in ui] == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 6, 0, 0], [0, 1, 2, 0, 0, 0]]
    assert L.pack_index.dtype == L.unpack_index.dtype == torch.long and L.valid.dtype == torch.bool


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
    assert (s.num_rows, s.num_groups, s.padded_tokens) == (3, 1, 21)
    assert (s.tokens_before, s.tokens_after) == (13, 7)  # 6 + 4 + 3 -> 3 + 3 + 1
    # causal pairs n(n+1)/2: 21 + 10 + 6; after: prompt 6, response 0: 3*3 + 6, response 1: 3*1 + 1
    assert (s.attention_pairs_before, s.attention_pairs_after) == (37, 25)
    assert s.rho == pytest.approx(13 / 7)
    assert s.attention_ratio == pytest.approx(37 / 25)
    assert "13 -> 7" in str(s)


def test_design_formula_for_rho():
    # N rows of [P prompt | R response]: rho = N(P+R)/(P+NR); pairs N(P+R)(P+R+1)/2 -> ...
    N, P, R = 4, 5, 3
    rows = [[1, 2, 3, 4, 5] + [10 + n, 20 + n, 30 + n] for n in range(N)]
    s = detect(T(rows)).stats()
    assert (s.tokens_before, s.tokens_after) == (N * (P + R), P + N * R)
    assert s.attention_pairs_before == N * 8 * 9 // 2
    assert s.attention_pairs_after == 15 + N * (P * R + 6)


# Two groups of different sizes and a group of one. Row 2 starts with the
# same token as rows 0 and 1 (lcp 1 with row 1), which must not pull it into
# their group; row 5 shares nothing.
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


def test_groups_of_different_sizes_and_a_group_of_one():
    L = detect(MIXED_IDS, MIXED_MASK)
    assert groups_of(L) == [
        (0, 2, (0, 0), (5, 4), 3, 0, (3, 5)),
        (2, 5, (0, 0, 0), (6, 5, 6), 4, 6, (10, 12, 13)),
        (5, 6, (0,), (4,), 4, 15, (19,)),
    ]
    assert L.num_tokens == 19
    check_segments(
        L,
        [(0, 3, 0, 0), (3, 2, 0, 3), (5, 1, 0, 3), (6, 4, 6, 0), (10, 2, 6, 4), (12, 1, 6, 4), (13, 2, 6, 4), (15, 4, 15, 0)],
    )
    s = L.stats()
    assert (s.tokens_before, s.tokens_after, s.num_groups) == (30, 19, 3)
    assert L.pack_index.tolist() == [0, 1, 2, 3, 4, 9, 12, 13, 14, 15, 16, 17, 22, 28, 29, 30, 31, 32, 33]


def test_min_shared_keeps_short_sharers_apart():
    L = detect(MIXED_IDS, MIXED_MASK, min_shared=4)
    assert groups_of(L) == [
        (0, 1, (0,), (5,), 5, 0, (5,)),
        (1, 2, (0,), (4,), 4, 5, (9,)),
        (2, 5, (0, 0, 0), (6, 5, 6), 4, 9, (13, 15, 16)),
        (5, 6, (0,), (4,), 4, 18, (22,)),
    ]
    assert L.num_tokens == 22
    L = detect(MIXED_IDS, MIXED_MASK, min_shared=5)
    assert [g.rows for g in L.groups] == [range(i, i + 1) for i in range(6)]
    assert L.num_tokens == 30


def test_group_size_verifies_instead_of_searching():
    # The search would put all four rows in one group (3 * 4 = 12 tokens saved
    # beats 5 + 5 = 10); group_size=2 asks for pairs, each sharing 5.
    ids = T([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 2, 3, 4, 8, 9], [1, 2, 3, 4, 8, 5]])
    assert groups_of(detect(ids)) == [(0, 4, (0,) * 4, (6,) * 4, 4, 0, (4, 6, 8, 10))]
    L = detect(ids, group_size=2)
    assert groups_of(L) == [(0, 2, (0, 0), (6, 6), 5, 0, (5, 6)), (2, 4, (0, 0), (6, 6), 5, 7, (12, 13))]
    check_segments(L, [(0, 5, 0, 0), (5, 1, 0, 5), (6, 1, 0, 5), (7, 5, 7, 0), (12, 1, 7, 5), (13, 1, 7, 5)])
    L = detect(ids, group_size=4)
    assert groups_of(L) == [(0, 4, (0,) * 4, (6,) * 4, 4, 0, (4, 6, 8, 10))]
    L = detect(ids, group_size=1)
    assert groups_of(L) == [(b, b + 1, (0,), (6,), 6, 6 * b, (6 * b + 6,)) for b in range(4)]
    # Verification uses min_shared too.
    with pytest.raises(ValueError, match=r"group_size=4.*min_shared=5"):
        detect(ids, group_size=4, min_shared=5)


def test_group_size_failure_names_group_size_and_rows():
    with pytest.raises(ValueError, match=r"group_size=3: rows 3\.\.5 share 0 leading tokens"):
        detect(MIXED_IDS, MIXED_MASK, group_size=3)
    with pytest.raises(ValueError, match="group_size=2"):
        detect(MIXED_IDS, MIXED_MASK, group_size=2)  # rows 4, 5 share nothing


@pytest.mark.parametrize("group_size", [0, -1, 4, 2.0, "2"])
def test_group_size_must_divide_batch(group_size):
    with pytest.raises(ValueError, match="group_size"):
        detect(MIXED_IDS, MIXED_MASK, group_size=group_size)


def test_dp_prefers_pair_when_third_row_shares_little():
    # A, A' share 7; B shares 3 with A'. {A, A'}, {B} saves 7; {A, A', B} saves 2 * 3 = 6.
    ids = T([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 9], [1, 2, 3, 9, 9, 9, 9, 9]])
    L = detect(ids)
    assert groups_of(L) == [(0, 2, (0, 0), (8, 8), 7, 0, (7, 8)), (2, 3, (0,), (8,), 8, 9, (17,))]
    assert L.num_tokens == 17


def test_dp_takes_third_row_when_it_shares_enough():
    # B shares 4 with A': {A, A', B} saves 2 * 4 = 8 > 7.
    ids = T([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 9], [1, 2, 3, 4, 9, 9, 9, 9]])
    L = detect(ids)
    assert groups_of(L) == [(0, 3, (0, 0, 0), (8, 8, 8), 4, 0, (4, 8, 12))]
    assert L.num_tokens == 16


def test_dp_tie_prefers_the_smaller_group():
    # {A, A'}, {B} and {A, A', B} both save 4 tokens (4 vs 2 * 2); the smaller
    # group keeps the longer shared prefix (more attention pairs saved), and wins.
    ids = T([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 7], [1, 2, 8, 8, 8, 8]])
    L = detect(ids)
    assert groups_of(L) == [(0, 2, (0, 0), (6, 6), 4, 0, (4, 6)), (2, 3, (0,), (6,), 6, 8, (14,))]
    assert L.stats().attention_pairs_after == 10 + 2 * (4 * 2 + 3) + 21

def test_every_row_identical():
    ids = T([[0, 1, 2, 3, 4]] * 4)
    mask = T([[0, 1, 1, 1, 1]] * 4)
    L = detect(ids, mask)
    assert groups_of(L) == [(0, 4, (1,) * 4, (5,) * 4, 4, 0, (4, 4, 4, 4))]
    check_segments(L, [(0, 4, 0, 0)])
    assert L.pack_index.tolist() == [1, 2, 3, 4]
    assert [r[1:] for r in L.unpack_index.view(4, 5).tolist()] == [[0, 1, 2, 3]] * 4
    s = L.stats()
    assert (s.tokens_before, s.tokens_after, s.attention_pairs_before, s.attention_pairs_after) == (16, 4, 40, 10)
    assert s.rho == 4.0


def test_nothing_shared_gives_groups_of_one():
    L = detect(T([[1, 2], [3, 4], [5, 6]]))
    assert groups_of(L) == [(0, 1, (0,), (2,), 2, 0, (2,)), (1, 2, (0,), (2,), 2, 2, (4,)), (2, 3, (0,), (2,), 2, 4, (6,))]
    check_segments(L, [(0, 2, 0, 0), (2, 2, 2, 0), (4, 2, 4, 0)])
    assert L.pack_index.tolist() == list(range(6))
    s = L.stats()
    assert (s.tokens_before, s.tokens_after, s.rho) == (6, 6, 1.0)


def test_single_row():
    L = detect(T([[0, 0, 7, 8]]), T([[0, 0, 1, 1]]))
    assert groups_of(L) == [(0, 1, (2,), (4,), 2, 0, (2,))]
    check_segments(L, [(0, 2, 0, 0)])
    assert L.pack_index.tolist() == [2, 3]


@pytest.mark.parametrize(
    "ids, mask",
    [(T([[0, 0, 7, 8]]), T([[0, 0, 1, 1]])), (T([[0, 1, 2, 3, 4]] * 4), T([[0, 1, 1, 1, 1]] * 4))],
    ids=["single_row", "identical_rows"],
)
def test_one_segment_tensors_own_their_storage(ids, mask):
    # A [1, 4] table's columns are contiguous views of it: the four segment tensors then
    # shared one storage, which CUDA kernels writing near them refused (overlapping memory).
    L = detect(ids, mask)
    assert L.num_segments == 1
    tensors = L.attention_segments[:4]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 4
    assert all(t.is_contiguous() and t.untyped_storage().nbytes() == 4 for t in tensors)


def test_responses_sharing_first_tokens_extend_the_shared_prefix():
    # Prompt [1, 2, 3]; both responses start with [7, 7]: the shared prefix is 5 tokens.
    L = detect(T([[1, 2, 3, 7, 7, 8], [1, 2, 3, 7, 7, 9]]))
    assert groups_of(L) == [(0, 2, (0, 0), (6, 6), 5, 0, (5, 6))]
    check_segments(L, [(0, 5, 0, 0), (5, 1, 0, 5), (6, 1, 0, 5)])


def test_row_that_is_a_prefix_of_another():
    # Row 0 is exactly row 1's first four tokens: row 0's rest is empty.
    L = detect(T([[1, 2, 3, 4, 0, 0], [1, 2, 3, 4, 5, 6]]), T([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]))
    assert groups_of(L) == [(0, 2, (0, 0), (4, 6), 4, 0, (4, 4))]
    check_segments(L, [(0, 4, 0, 0), (4, 2, 0, 4)])
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
    assert groups_of(L) == [(0, 3, (1, 1, 1), (4, 4, 4), 2, 0, (2, 3, 4))]
    check_segments(L, [(0, 2, 0, 0), (2, 1, 0, 2), (3, 1, 0, 2), (4, 1, 0, 2)])


def test_all_responses_empty():
    # Only the prompt in every row: one group, nothing but the shared prefix.
    ids = T([[0, 1, 2, 0], [0, 1, 2, 0]])
    L = detect(ids, T([[0, 1, 1, 0]] * 2))
    assert groups_of(L) == [(0, 2, (1, 1), (3, 3), 2, 0, (2, 2))]
    check_segments(L, [(0, 2, 0, 0)])


def test_row_with_zero_valid_tokens():
    # Row 1 is all padding; rows 0 and 2 share three tokens but are not
    # consecutive, so they are not grouped (groups are runs of rows).
    ids = T([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5]])
    mask = T([[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    L = detect(ids, mask)
    assert groups_of(L) == [(0, 1, (0,), (4,), 4, 0, (4,)), (1, 2, (0,), (0,), 0, 4, (4,)), (2, 3, (0,), (4,), 4, 4, (8,))]
    assert L.num_tokens == 8
    check_segments(L, [(0, 4, 0, 0), (4, 4, 4, 0)])
    assert L.valid.view(3, 4).long().tolist() == mask.tolist()
    x = torch.arange(12.0).view(3, 4)
    assert unpack(pack(x, L), L).tolist() == [[0, 1, 2, 3], [0, 0, 0, 0], [8, 9, 10, 11]]


def test_empty_row_next_to_left_padded_row():
    ids = T([[0, 0, 0], [0, 4, 5], [0, 0, 0]])
    mask = T([[0, 0, 0], [0, 1, 1], [0, 0, 0]])
    L = detect(ids, mask)
    assert [g.rows for g in L.groups] == [range(0, 1), range(1, 2), range(2, 3)]
    assert [g.shared_len for g in L.groups] == [0, 2, 0]
    assert L.pack_index.tolist() == [4, 5]


def test_every_row_empty():
    L = detect(T([[0, 0, 0], [0, 0, 0]]), T([[0, 0, 0], [0, 0, 0]]))
    assert L.num_tokens == 0
    check_segments(L, [])
    x = torch.randn(2, 3, 4, requires_grad=True)
    p = pack(x, L)
    assert p.shape == (0, 4)
    out = unpack(p, L)
    assert out.shape == (2, 3, 4) and not out.any()
    out.sum().backward()
    assert x.grad is not None and not x.grad.any()
    assert L.stats().tokens_after == 0


def test_default_mask_is_all_ones():
    ids = T([[1, 2, 3], [1, 2, 4]])
    L = detect(ids)
    assert groups_of(L) == [(0, 2, (0, 0), (3, 3), 2, 0, (2, 3))]
    assert L.valid.all()


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int32, torch.int64, torch.float32, torch.bfloat16])
def test_mask_dtypes(mask_dtype):
    L = detect(VERL_IDS.to(torch.int32), VERL_MASK.to(mask_dtype))
    assert groups_of(L) == [(0, 3, (1, 1, 1), (7, 5, 4), 3, 0, (3, 6, 7))]


def test_pad_tokens_do_not_matter():
    # Different pad ids (and the pad id equal to a real token) change nothing.
    ids = VERL_IDS.clone()
    ids[0, 0], ids[1, 5], ids[2, 4] = 99, 10, 20
    L = detect(ids, VERL_MASK)
    assert groups_of(L) == [(0, 3, (1, 1, 1), (7, 5, 4), 3, 0, (3, 6, 7))]


def test_same_tokens_different_padding_are_not_shared():
    # Same valid tokens, but left-padded in one row and right-padded in the
    # other: columns (hence default positions) differ, so nothing is shared.
    L = detect(T([[0, 1, 2, 3], [1, 2, 3, 0]]), T([[0, 1, 1, 1], [1, 1, 1, 0]]))
    assert groups_of(L) == [(0, 1, (1,), (4,), 3, 0, (3,)), (1, 2, (0,), (3,), 3, 3, (6,))]


# --------------------------------------------------------------------------- position ids


def test_position_ids_1xS_and_BxS():
    pos1 = torch.arange(7).view(1, 7)
    expected = [(0, 3, (1, 1, 1), (7, 5, 4), 3, 0, (3, 6, 7))]
    assert groups_of(detect(VERL_IDS, VERL_MASK, pos1)) == expected
    assert groups_of(detect(VERL_IDS, VERL_MASK, pos1.expand(3, 7))) == expected
    # HF style: cumsum of the mask - 1, padding filled with 1 (differs between rows).
    pos = (VERL_MASK.cumsum(1) - 1).masked_fill(VERL_MASK == 0, 1)
    assert groups_of(detect(VERL_IDS, VERL_MASK, pos)) == expected


def test_position_ids_that_differ_end_the_shared_prefix():
    ids = T([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]])
    pos = T([[0, 1, 2, 3, 4], [0, 1, 7, 8, 9]])
    L = detect(ids, position_ids=pos)
    assert groups_of(L) == [(0, 2, (0, 0), (5, 5), 2, 0, (2, 5))]
    # With nothing shared at all: groups of one.
    pos = T([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]])
    L = detect(ids, position_ids=pos)
    assert [g.rows for g in L.groups] == [range(0, 1), range(1, 2)]


def test_position_ids_differing_only_at_padding_are_ignored():
    ids = T([[0, 1, 2, 3], [0, 1, 2, 4]])
    mask = T([[0, 1, 1, 1]] * 2)
    pos = T([[0, 0, 1, 2], [5, 0, 1, 2]])
    assert groups_of(detect(ids, mask, pos)) == [(0, 2, (1, 1), (4, 4), 2, 0, (2, 3))]


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


@pytest.mark.parametrize("min_shared", [0, -3, 1.5])
def test_bad_min_shared(min_shared):
    with pytest.raises(ValueError, match="min_shared"):
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
    x[1:, 1:4] = x[0, 1:4]  # the shared columns agree across the group's rows
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


def test_pack_reads_shared_prefix_from_first_row_of_group():
    # The docstring's guarantee: the shared prefix comes from the group's first row.
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
def batches(draw, max_groups=3, max_rows=4, max_prompt=5, max_resp=4, vocab=3):
    """A veRL-style padded batch: per group a prompt, left-padded to a common
    width, and responses right-padded to a common width. A small vocabulary
    makes responses (and neighbouring groups) share leading tokens by chance.
    Returns (input_ids, attention_mask, position_ids or None)."""
    groups = []
    for _ in range(draw(st.integers(1, max_groups))):
        P = draw(st.integers(0, max_prompt))
        prompt = draw(st.lists(st.integers(1, vocab), min_size=P, max_size=P))
        n = draw(st.integers(1, max_rows))
        resps = [draw(st.lists(st.integers(1, vocab), max_size=max_resp)) for _ in range(n)]
        groups.append((prompt, resps))
    Pw = max(len(p) for p, _ in groups) + draw(st.integers(0, 1))
    Rw = max(len(r) for _, rs in groups for r in rs) + draw(st.integers(0, 1))
    if Pw + Rw == 0:
        Rw = 1
    ids, mask = [], []
    for prompt, resps in groups:
        for r in resps:
            lp, rp = Pw - len(prompt), Rw - len(r)
            ids.append([0] * lp + prompt + r + [0] * rp)
            mask.append([0] * lp + [1] * (len(prompt) + len(r)) + [0] * rp)
    ids, mask = T(ids), T(mask)
    pad = draw(st.sampled_from(["zero", "random"]))
    if pad == "random":  # pad ids are arbitrary, even real tokens
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        ids = torch.where(mask.bool(), ids, torch.randint(0, vocab + 1, ids.shape, generator=g))
    kind = draw(st.sampled_from(["none", "arange", "hf", "perturbed"]))
    if kind == "none":
        pos = None
    elif kind == "arange":
        pos = torch.arange(ids.shape[1]).view(1, -1)
    else:
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        if kind == "perturbed":  # some row's positions jump somewhere
            b = draw(st.integers(0, ids.shape[0] - 1))
            c = draw(st.integers(0, ids.shape[1] - 1))
            pos = pos.clone()
            pos[b, c:] += 1
    return ids, mask, pos


def valid_runs(mask):
    """(start, end) of each row's valid columns, from the mask alone."""
    out = []
    for row in mask.tolist():
        cols = [c for c, m in enumerate(row) if m]
        out.append((cols[0], cols[-1] + 1) if cols else (0, 0))
    return out


def oracle_lcp(ids, mask, pos, rows, runs=None):
    """Longest prefix of valid tokens that rows agree on (same columns, tokens, positions), by brute force."""
    runs = valid_runs(mask) if runs is None else runs
    if len({runs[b][0] for b in rows}) > 1 and any(runs[b][1] > runs[b][0] for b in rows):
        return 0
    s0 = runs[rows[0]][0]
    n = 0
    while True:
        c = s0 + n
        if any(c >= runs[b][1] for b in rows):
            return n
        if len({int(ids[b, c]) for b in rows}) > 1:
            return n
        if pos is not None and len({int(pos[b if pos.shape[0] > 1 else 0, c]) for b in rows}) > 1:
            return n
        n += 1


@settings(max_examples=200, deadline=None)
@given(batch=batches(), min_shared=st.integers(1, 3))
def test_detect_properties_against_brute_force(batch, min_shared):
    ids, mask, pos = batch
    B, S = ids.shape
    L = detect(ids, mask, pos, min_shared=min_shared)
    runs = valid_runs(mask)
    # Groups partition the rows into consecutive runs, in order.
    assert [r for g in L.groups for r in g.rows] == list(range(B))
    offset = 0
    for g in L.groups:
        rows = list(g.rows)
        assert list(zip(g.starts, g.ends)) == [runs[b] for b in rows]
        lcp = oracle_lcp(ids, mask, pos, rows, runs)
        if len(rows) == 1:
            assert g.shared_len == runs[rows[0]][1] - runs[rows[0]][0]
        else:
            assert g.shared_len == lcp >= min_shared
        assert g.packed_offset == offset
        offset += g.shared_len
        for i, b in enumerate(rows):
            assert g.rest_offsets[i] == offset
            offset += runs[b][1] - runs[b][0] - g.shared_len
    assert L.num_tokens == offset
    # The grouping saves as many tokens as the best of all groupings into runs.
    lcps = {
        (lo, hi): oracle_lcp(ids, mask, pos, list(range(lo, hi)), runs) for lo in range(B) for hi in range(lo + 2, B + 1)
    }
    best = 0
    for cuts in itertools.product([False, True], repeat=B - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [B]
        saved = 0
        for lo, hi in zip(bounds, bounds[1:]):
            if hi - lo > 1:
                lcp = lcps[lo, hi]
                saved = -1 if lcp < min_shared or saved < 0 else saved + (hi - lo - 1) * lcp
        best = max(best, saved)
    s = L.stats()
    assert s.tokens_before == sum(e - s_ for s_, e in runs) == int(mask.sum())
    assert s.tokens_before - s.tokens_after == best
    # Segments: in stream order, covering every packed token once; shared
    # segments see no prefix, the others see their group's whole shared prefix.
    segs = L.segments()
    covered = 0
    for start, n, pstart, plen in segs:
        assert start == covered and n > 0
        covered += n
        assert pstart + plen <= start
    assert covered == L.num_tokens


@settings(max_examples=200, deadline=None)
@given(batch=batches(), data=st.data())
def test_pack_unpack_roundtrip(batch, data):
    ids, mask, pos = batch
    B, S = ids.shape
    L = detect(ids, mask, pos)
    # A value that depends only on (token, column, position) agrees on shared columns.
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    table = torch.randn(8, S, 3, generator=g, dtype=torch.float64)
    x = table[ids, torch.arange(S)]
    if pos is not None:
        x = x + pos.expand(B, S).unsqueeze(-1).double() * 0.125
    u = unpack(pack(x, L), L)
    m = mask.bool().unsqueeze(-1)
    assert torch.equal(u, torch.where(m, x, 0.0))
    # unpack's backward: each packed token gets the sum of the gradients at
    # every padded position that reads it (oracle: a python loop).
    y = torch.randn(L.num_tokens, 3, generator=g, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(B, S, 3, generator=g, dtype=torch.float64)
    unpack(y, L).backward(dout)
    ts, bs, cs = [], [], []
    for grp in L.groups:
        for i, b in enumerate(grp.rows):
            s0 = grp.starts[i]
            for j in range(grp.ends[i] - s0):
                ts.append(grp.packed_offset + j if j < grp.shared_len else grp.rest_offsets[i] + j - grp.shared_len)
                bs.append(b)
                cs.append(s0 + j)
    expected = torch.zeros_like(y).index_add_(0, torch.tensor(ts, dtype=torch.long), dout[bs, cs])
    torch.testing.assert_close(y.grad, expected, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- one sync


class _CountHostSyncs(TorchFunctionMode):
    """CPU proxy for device-to-host syncs: counts the calls that, on a CUDA
    tensor, read device data on the host (or wait for the device to size a
    result). Tensors built from host data by ``torch.tensor`` are host
    tensors: moving them with ``.to`` is a host-to-device copy, not counted
    here (the CUDA test below sees those)."""

    ALWAYS = {
        "tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy",
        "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose",
        "__repr__", "__format__", "bincount",
    }

    def __init__(self):
        super().__init__()
        self.syncs = []
        self._host = {}  # id -> weakref of tensors built from host data

    def is_host(self, t):
        r = self._host.get(id(t))
        return r is not None and r() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        self_t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        hit = name in self.ALWAYS
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            hit = True
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put") and len(args) > 1:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            hit |= any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
        if name in ("cpu", "to") and self_t is not None and not self.is_host(self_t):
            hit = True
        if name == "tensor" and any(isinstance(a, torch.Tensor) for a in args):
            hit = True
        if hit:
            self.syncs.append(name)
        out = func(*args, **kwargs)
        if name in ("tensor", "as_tensor") or (self_t is not None and self.is_host(self_t)):
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor):
                    self._host[id(o)] = weakref.ref(o)
        return out


def test_proxy_counts_syncs():
    t = torch.arange(4)
    with _CountHostSyncs() as c:
        t.tolist()
        bool(t[0])
        t[t > 1]
        t.nonzero()
        t.cpu()
        torch.tensor([1, 2]).to(t.device)  # host -> device: not counted
    assert c.syncs == ["tolist", "__bool__", "__getitem__", "nonzero", "cpu"]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(attention_mask=VERL_MASK),
        dict(attention_mask=VERL_MASK.bool(), position_ids=torch.arange(7).view(1, 7)),
        dict(attention_mask=VERL_MASK, position_ids=(VERL_MASK.cumsum(1) - 1).clamp(min=0), group_size=3),
        dict(attention_mask=VERL_MASK, group_size=1, min_shared=2),
    ],
)
def test_detect_does_at_most_one_host_sync(kwargs):
    with _CountHostSyncs() as c:
        detect(VERL_IDS, **kwargs)
    assert len(c.syncs) <= 1, c.syncs
    with _CountHostSyncs() as c:
        detect(MIXED_IDS, MIXED_MASK)
    assert len(c.syncs) <= 1, c.syncs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_detect_one_cuda_sync():
    import warnings

    dev = torch.device("cuda")
    cases = [
        (VERL_IDS.to(dev), VERL_MASK.to(dev), None, None),
        (MIXED_IDS.to(dev), MIXED_MASK.to(dev), torch.arange(6, device=dev).view(1, 6), None),
        (VERL_IDS.to(dev), VERL_MASK.to(dev), (VERL_MASK.to(dev).cumsum(1) - 1).clamp(min=0), 3),
    ]
    for ids, mask, pos, gs in cases:
        detect(ids, mask, pos, group_size=gs)  # warm up (allocators, pinned memory)
        torch.cuda.synchronize()
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                L = detect(ids, mask, pos, group_size=gs)
        finally:
            torch.cuda.set_sync_debug_mode(prev)
        syncs = [x for x in w if "synchronizing" in str(x.message)]
        assert len(syncs) <= 1, [(x.filename, x.lineno) for x in syncs]
        assert L.pack_index.device.type == "cuda" and L.seg_start.device.type == "cuda"
        ref = detect(ids.cpu(), mask.cpu(), None if pos is None else pos.cpu(), group_size=gs)
        assert groups_of(L) == groups_of(ref)
        for name in ("pack_index", "unpack_index", "valid", "seg_start", "seg_len", "prefix_start", "prefix_len"):
            assert torch.equal(getattr(L, name).cpu(), getattr(ref, name)), name
