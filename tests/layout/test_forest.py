"""Tests of the prefix forest (docs/design.md, semantics 10-12): sharing between sequences in any order, nested.

Hand-written expectations (nothing expected is computed with the code under
test) in the notation of ``layout_cases.py``:
    sequences  (row, start, end, leaf)
    nodes      (parent, offset, length, packed_start, source, count)
    segments   (seg_start, seg_len, parent, prefix_len, subtree_end)
plus properties: shuffling rows (or the sequences of packed rows) changes
neither the packed length nor the nodes' lengths and counts.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dualkv_compile.layout import SharedPromptLayout, detect, pack, previous_token_index, unpack
from dualkv_compile.layout.forest import build_forest
from dualkv_compile.layout.sequences import read_sequences


pytestmark = pytest.mark.usefixtures("one_thread")


def T(rows):
    return torch.tensor(rows, dtype=torch.long)


def seqs_of(layout: SharedPromptLayout):
    return [(s.row, s.start, s.end, s.leaf) for s in layout.sequences]


def nodes_of(layout: SharedPromptLayout):
    return [(n.parent, n.offset, n.length, n.packed_start, n.source, n.count) for n in layout.nodes]


# --------------------------------------------------------------------------- shuffled rows

# GRPO: 2 groups x 3 rows. Group A: prompt [1, 2, 3], responses [4, 5], [6], [4, 9]
# (two responses share their first token). Group B: prompt [7, 8] left-padded to
# the prompt width 3, responses [5, 5], [6], [3]. Responses right-padded to 2.
A0, A1, A2 = [1, 2, 3, 4, 5], [1, 2, 3, 6, 0], [1, 2, 3, 4, 9]
B0, B1, B2 = [0, 7, 8, 5, 5], [0, 7, 8, 6, 0], [0, 7, 8, 3, 0]
MA0, MA1, MA2 = [1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]
MB0, MB1, MB2 = [0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [0, 1, 1, 1, 0]
GRPO_SEGS = [
    (0, 3, -1, 0, 7),  # A's prompt
    (3, 1, 0, 3, 6),  # [4]: A0, A2
    (4, 1, 1, 4, 5),  # [5]: A0
    (5, 1, 1, 4, 6),  # [9]: A2
    (6, 1, 0, 3, 7),  # [6]: A1
    (7, 2, -1, 0, 13),  # B's prompt
    (9, 2, 5, 2, 11),  # [5, 5]: B0
    (11, 1, 5, 2, 12),  # [6]: B1
    (12, 1, 5, 2, 13),  # [3]: B2
]


def test_grpo_groups_in_order():
    L = detect(T([A0, A1, A2, B0, B1, B2]), T([MA0, MA1, MA2, MB0, MB1, MB2]))
    assert nodes_of(L) == [
        (-1, 0, 3, 0, 0, 3),
        (0, 3, 1, 3, 3, 2),
        (1, 4, 1, 4, 4, 1),
        (1, 4, 1, 5, 14, 1),
        (0, 3, 1, 6, 8, 1),
        (-1, 0, 2, 7, 16, 3),
        (5, 2, 2, 9, 18, 1),
        (5, 2, 1, 11, 23, 1),
        (5, 2, 1, 12, 28, 1),
    ]
    assert seqs_of(L) == [(0, 0, 5, 2), (1, 0, 4, 4), (2, 0, 5, 3), (3, 1, 5, 6), (4, 1, 4, 7), (5, 1, 4, 8)]
    assert L.segments() == GRPO_SEGS
    s = L.stats()
    assert (s.tokens_before, s.tokens_after, s.num_groups, s.depth) == (24, 13, 2, 3)
    assert s.rho == pytest.approx(24 / 13)


def test_grpo_groups_interleaved_pack_the_same():
    # Rows interleaved A0, B0, A1, B1, A2, B2 (a trainer's shuffle): the same forest,
    # in the same order (each node where its first sequence puts it), read from other rows.
    L = detect(T([A0, B0, A1, B1, A2, B2]), T([MA0, MB0, MA1, MB1, MA2, MB2]))
    assert nodes_of(L) == [
        (-1, 0, 3, 0, 0, 3),
        (0, 3, 1, 3, 3, 2),
        (1, 4, 1, 4, 4, 1),
        (1, 4, 1, 5, 24, 1),  # A2 is row 4
        (0, 3, 1, 6, 13, 1),  # A1 is row 2
        (-1, 0, 2, 7, 6, 3),  # B's prompt from row 1, column 1
        (5, 2, 2, 9, 8, 1),
        (5, 2, 1, 11, 18, 1),
        (5, 2, 1, 12, 28, 1),
    ]
    assert seqs_of(L) == [(0, 0, 5, 2), (1, 1, 5, 6), (2, 0, 4, 4), (3, 1, 4, 7), (4, 0, 5, 3), (5, 1, 4, 8)]
    assert L.segments() == GRPO_SEGS
    s = L.stats()
    assert (s.tokens_before, s.tokens_after) == (24, 13)
    assert s.rho == pytest.approx(24 / 13)
    # Reversed: B's tree comes first now.
    L = detect(T([B2, B1, B0, A2, A1, A0]), T([MB2, MB1, MB0, MA2, MA1, MA0]))
    assert [(n.parent, n.offset, n.length, n.count) for n in L.nodes] == [
        (-1, 0, 2, 3), (0, 2, 1, 1), (0, 2, 1, 1), (0, 2, 2, 1),
        (-1, 0, 3, 3), (4, 3, 1, 2), (5, 4, 1, 1), (5, 4, 1, 1), (4, 3, 1, 1),
    ]
    assert L.num_tokens == 13


# --------------------------------------------------------------------------- nested sharing

# A system prompt [1, 2] shared by two groups: group 0's prompt [3, 4], group 1's [5].
SYS_IDS = T([[1, 2, 3, 4, 6, 7], [1, 2, 3, 4, 8, 0], [1, 2, 5, 6, 0, 0], [1, 2, 5, 9, 9, 0]])
SYS_MASK = T([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]])


def test_system_prompt_shared_by_two_groups_by_hand():
    L = detect(SYS_IDS, SYS_MASK)
    assert seqs_of(L) == [(0, 0, 6, 2), (1, 0, 5, 3), (2, 0, 4, 5), (3, 0, 5, 6)]
    assert nodes_of(L) == [
        (-1, 0, 2, 0, 0, 4),  # system prompt
        (0, 2, 2, 2, 2, 2),  # group 0's prompt
        (1, 4, 2, 4, 4, 1),
        (1, 4, 1, 6, 10, 1),
        (0, 2, 1, 7, 14, 2),  # group 1's prompt
        (4, 3, 1, 8, 15, 1),
        (4, 3, 2, 9, 21, 1),
    ]
    assert [L.path(i) for i in range(4)] == [[0, 1, 2], [0, 1, 3], [0, 4, 5], [0, 4, 6]]
    assert L.segments() == [
        (0, 2, -1, 0, 11), (2, 2, 0, 2, 7), (4, 2, 1, 4, 6), (6, 1, 1, 4, 7), (7, 1, 0, 2, 11), (8, 1, 4, 3, 9), (9, 2, 4, 3, 11),
    ]
    assert L.dense_mask().long().tolist() == [
        [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 1, 0, 1, 0],
        [1, 1, 0, 0, 0, 0, 0, 1, 0, 1, 1],
    ]
    # Each node's first token follows its parent's last.
    assert previous_token_index(L.attention_segments, L.num_tokens).tolist() == [0, 0, 1, 2, 3, 4, 3, 1, 7, 7, 9]
    s = L.stats()
    assert (s.num_rows, s.num_sequences, s.num_groups, s.depth) == (4, 4, 1, 3)
    assert (s.tokens_before, s.tokens_after) == (20, 11)
    # pairs: 21 + 15 + 10 + 15; after: 3 + (4 + 3) + (8 + 3) + (4 + 1) + (2 + 1) + (3 + 1) + (6 + 3)
    assert (s.attention_pairs_before, s.attention_pairs_after) == (61, 42)


def test_system_prompt_multiplicity_copy_runs_sequence_ids_by_hand():
    L = detect(SYS_IDS, SYS_MASK)
    assert L.token_multiplicity().tolist() == [4, 4, 2, 2, 1, 1, 1, 2, 1, 1, 1]
    assert L.token_multiplicity().dtype == torch.long
    # (flat position, flat position packing keeps, length) of every dropped copy
    assert L.copy_runs() == [(6, 0, 2), (8, 2, 2), (12, 0, 2), (18, 0, 2), (20, 14, 1)]
    assert L.sequence_ids().tolist() == (
        [0] * 6 + [1] * 5 + [-1] + [2] * 4 + [-1] * 2 + [3] * 5 + [-1]
    )
    # Semantics 12: a sum over the batch's tokens is the multiplicity-weighted sum over the stream.
    x = torch.randn(4, 6, dtype=torch.float64)
    x[:, :2] = x[0, :2]
    x[1, 2:4] = x[0, 2:4]
    x[3, 2] = x[2, 2]
    torch.testing.assert_close((pack(x, L) * L.token_multiplicity()).sum(), (x * SYS_MASK).sum())


def test_min_shared_copies_a_short_shared_part_into_each_branch():
    # min_shared=3: the two-token system prompt is too short to share; each group
    # gets its own copy, in front of its prompt.
    L = detect(SYS_IDS, SYS_MASK, min_shared=3)
    assert nodes_of(L) == [
        (-1, 0, 4, 0, 0, 2),  # [1, 2, 3, 4]
        (0, 4, 2, 4, 4, 1),
        (0, 4, 1, 6, 10, 1),
        (-1, 0, 3, 7, 12, 2),  # [1, 2, 5]
        (3, 3, 1, 10, 15, 1),
        (3, 3, 2, 11, 21, 1),
    ]
    assert L.segments() == [
        (0, 4, -1, 0, 7), (4, 2, 0, 4, 6), (6, 1, 0, 4, 7), (7, 3, -1, 0, 13), (10, 1, 3, 3, 11), (11, 2, 3, 3, 13),
    ]
    assert L.copy_runs() == [(6, 0, 4), (18, 12, 3)]
    # min_shared=4: group 1 (sharing 3) is copied too, into each of its sequences.
    L = detect(SYS_IDS, SYS_MASK, min_shared=4)
    assert nodes_of(L) == [
        (-1, 0, 4, 0, 0, 2), (0, 4, 2, 4, 4, 1), (0, 4, 1, 6, 10, 1), (-1, 0, 4, 7, 12, 1), (-1, 0, 5, 11, 18, 1),
    ]
    assert L.num_tokens == 16
    with pytest.raises(ValueError, match=r"group_size=4: rows 0\.\.3 share 0 leading tokens, expected at least min_shared=3"):
        detect(SYS_IDS, SYS_MASK, group_size=4, min_shared=3)
    assert nodes_of(detect(SYS_IDS, SYS_MASK, group_size=2, min_shared=3)) == nodes_of(detect(SYS_IDS, SYS_MASK, min_shared=3))


def test_copied_branches_keep_batch_order():
    # Copies of a short shared part are children in order of their first sequence,
    # not in the order their tokens sort: row 1 sorts first ([1, 2] < [1, 5]).
    L = detect(T([[1, 5, 6, 7], [1, 2, 3, 4], [1, 5, 6, 8]]), min_shared=2)
    assert nodes_of(L) == [(-1, 0, 3, 0, 0, 2), (0, 3, 1, 3, 3, 1), (0, 3, 1, 4, 11, 1), (-1, 0, 4, 5, 4, 1)]
    # Rows 0 and 2 share a token that min_shared copies, row 1 none; row order stays.
    L = detect(T([[9, 5, 1, 1], [8, 1, 1, 1], [9, 2, 2, 2]]), min_shared=2)
    assert nodes_of(L) == [(-1, 0, 4, 0, 0, 1), (-1, 0, 4, 4, 4, 1), (-1, 0, 4, 8, 8, 1)]
    # Without min_shared the copies would have been one node.
    L = detect(T([[9, 5, 1, 1], [8, 1, 1, 1], [9, 2, 2, 2]]))
    assert nodes_of(L) == [(-1, 0, 1, 0, 0, 2), (0, 1, 3, 1, 1, 1), (0, 1, 3, 4, 9, 1), (-1, 0, 4, 7, 4, 1)]


def test_multi_turn_growing_prefixes():
    # Turn 1, turn 1 + turn 2, turn 1 + turn 2 + turn 3: a chain, each sequence ending in its node.
    ids = T([[1, 2, 0, 0, 0, 0], [1, 2, 3, 4, 0, 0], [1, 2, 3, 4, 5, 6]])
    mask = T([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    L = detect(ids, mask)
    assert seqs_of(L) == [(0, 0, 2, 0), (1, 0, 4, 1), (2, 0, 6, 2)]
    assert nodes_of(L) == [(-1, 0, 2, 0, 0, 3), (0, 2, 2, 2, 8, 2), (1, 4, 2, 4, 16, 1)]
    assert L.segments() == [(0, 2, -1, 0, 6), (2, 2, 0, 2, 6), (4, 2, 1, 4, 6)]
    assert L.num_tokens == 6 and L.depth() == 3
    assert L.dense_mask().long().tolist() == torch.ones(6, 6, dtype=torch.long).tril().tolist()


# --------------------------------------------------------------------------- packed rows

# veRL remove-padding: one [1, total] row of four sequences, positions restarting, no mask.
PACKED_IDS = T([[1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 9, 7, 7]])
PACKED_POS = T([[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 0, 1]])


def test_one_packed_row_shares_within_the_row():
    L = detect(PACKED_IDS, position_ids=PACKED_POS, same_columns=False)
    assert seqs_of(L) == [(0, 0, 4, 2), (0, 4, 8, 3), (0, 8, 11, 4), (0, 11, 13, 5)]
    assert nodes_of(L) == [
        (-1, 0, 2, 0, 0, 3),  # [1, 2] at positions 0, 1
        (0, 2, 1, 2, 2, 2),  # [3]
        (1, 3, 1, 3, 3, 1),
        (1, 3, 1, 4, 7, 1),
        (0, 2, 1, 5, 10, 1),  # [9]
        (-1, 0, 2, 6, 11, 1),  # [7, 7]
    ]
    assert L.segments() == [
        (0, 2, -1, 0, 6), (2, 1, 0, 2, 5), (3, 1, 1, 3, 4), (4, 1, 1, 3, 5), (5, 1, 0, 2, 6), (6, 2, -1, 0, 8),
    ]
    assert L.pack_index.tolist() == [0, 1, 2, 3, 7, 10, 11, 12]
    assert L.unpack_index.tolist() == [0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 5, 6, 7]
    assert L.valid.all()
    assert L.token_multiplicity().tolist() == [3, 3, 2, 1, 1, 1, 1, 1]
    assert L.copy_runs() == [(4, 0, 2), (6, 2, 1), (8, 0, 2)]
    assert L.sequence_ids().tolist() == [0] * 4 + [1] * 4 + [2] * 3 + [3] * 2
    assert not L.one_sequence_per_row()
    s = L.stats()
    assert (s.num_rows, s.num_sequences, s.tokens_before, s.tokens_after, s.num_groups, s.depth) == (1, 4, 13, 8, 2, 3)
    # A value of (token, position) comes back everywhere.
    x = (PACKED_IDS * 10 + PACKED_POS).double()
    assert pack(x, L).tolist() == [10, 21, 32, 43, 53, 92, 70, 71]
    assert torch.equal(unpack(pack(x, L), L), x)


def test_one_packed_row_with_same_columns_shares_nothing():
    # With same_columns (the default: the program reads values of the column) the
    # sequences of one row sit at different columns: four roots.
    L = detect(PACKED_IDS, position_ids=PACKED_POS)
    assert seqs_of(L) == [(0, 0, 4, 0), (0, 4, 8, 1), (0, 8, 11, 2), (0, 11, 13, 3)]
    assert nodes_of(L) == [(-1, 0, 4, 0, 0, 1), (-1, 0, 4, 4, 4, 1), (-1, 0, 3, 8, 8, 1), (-1, 0, 2, 11, 11, 1)]
    # Without position ids the row is one sequence.
    L = detect(PACKED_IDS)
    assert seqs_of(L) == [(0, 0, 13, 0)] and nodes_of(L) == [(-1, 0, 13, 0, 0, 1)]


# Padded rows each holding packed sequences, right- or left-padded.
#   row 0: [1, 2, 3] [1, 2, 4] pad
#   row 1: [1, 2, 5] [6, 6] pad pad
#   row 2: pad [6, 6, 8] [1, 2, 3]
MIX_IDS = T([[1, 2, 3, 1, 2, 4, 0], [1, 2, 5, 6, 6, 0, 0], [0, 6, 6, 8, 1, 2, 3]])
MIX_POS = T([[0, 1, 2, 0, 1, 2, 0], [0, 1, 2, 0, 1, 0, 0], [0, 0, 1, 2, 0, 1, 2]])
MIX_MASK = T([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1]])


def test_padded_rows_of_packed_sequences_share_across_and_within_rows():
    L = detect(MIX_IDS, MIX_MASK, MIX_POS, same_columns=False)
    # Row 2's second sequence equals row 0's first: both end in node 1.
    assert seqs_of(L) == [(0, 0, 3, 1), (0, 3, 6, 2), (1, 0, 3, 3), (1, 3, 5, 4), (2, 1, 4, 5), (2, 4, 7, 1)]
    assert nodes_of(L) == [
        (-1, 0, 2, 0, 0, 4),  # [1, 2]: four sequences in three rows
        (0, 2, 1, 2, 2, 2),  # [3]
        (0, 2, 1, 3, 5, 1),  # [4]
        (0, 2, 1, 4, 9, 1),  # [5]
        (-1, 0, 2, 5, 10, 2),  # [6, 6]: row 1's second sequence ends here
        (4, 2, 1, 7, 17, 1),  # [8]
    ]
    assert L.segments() == [
        (0, 2, -1, 0, 5), (2, 1, 0, 2, 3), (3, 1, 0, 2, 4), (4, 1, 0, 2, 5), (5, 2, -1, 0, 8), (7, 1, 4, 2, 8),
    ]
    assert L.token_multiplicity().tolist() == [4, 4, 2, 1, 1, 2, 2, 1]
    assert L.sequence_ids().tolist() == [0, 0, 0, 1, 1, 1, -1, 2, 2, 2, 3, 3, -1, -1, -1, 4, 4, 4, 5, 5, 5]
    assert L.copy_runs() == [(3, 0, 2), (7, 0, 2), (15, 10, 2), (18, 0, 2), (20, 2, 1)]
    s = L.stats()
    assert (s.tokens_before, s.tokens_after, s.num_groups, s.depth) == (17, 8, 2, 2)
    x = (MIX_IDS * 10 + MIX_POS).double()
    assert torch.equal(unpack(pack(x, L), L), torch.where(MIX_MASK.bool(), x, 0.0))


def test_padded_rows_of_packed_sequences_with_same_columns():
    # Only sequences at the same columns share: rows 0 and 1's first sequences.
    L = detect(MIX_IDS, MIX_MASK, MIX_POS)
    assert seqs_of(L) == [(0, 0, 3, 1), (0, 3, 6, 3), (1, 0, 3, 2), (1, 3, 5, 4), (2, 1, 4, 5), (2, 4, 7, 6)]
    assert nodes_of(L) == [
        (-1, 0, 2, 0, 0, 2),
        (0, 2, 1, 2, 2, 1),
        (0, 2, 1, 3, 9, 1),
        (-1, 0, 3, 4, 3, 1),
        (-1, 0, 2, 7, 10, 1),
        (-1, 0, 3, 9, 15, 1),
        (-1, 0, 3, 12, 18, 1),
    ]
    assert L.num_tokens == 15


def test_group_size_with_packed_rows():
    # A row holding several sequences shares no leading tokens with another row as a whole.
    with pytest.raises(ValueError, match=r"group_size=3: rows 0\.\.2 share 0 leading tokens, expected at least min_shared=1"):
        detect(MIX_IDS, MIX_MASK, MIX_POS, group_size=3, same_columns=False)
    L = detect(MIX_IDS, MIX_MASK, MIX_POS, group_size=1, same_columns=False)
    assert L.num_tokens == 8
    with pytest.raises(ValueError, match=r"group_size must be a positive integer dividing the batch size 3, got 2"):
        detect(MIX_IDS, MIX_MASK, MIX_POS, group_size=2)


# --------------------------------------------------------------------------- empty and one-token leaves


def test_empty_leaves():
    # Row 3 is a prefix of all others (ends at the root); rows 0 and 2 are identical
    # and a prefix of row 1 (end at the [3] node).
    ids = T([[1, 2, 3, 0], [1, 2, 3, 4], [1, 2, 3, 0], [1, 2, 0, 0]])
    mask = T([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])
    L = detect(ids, mask)
    assert seqs_of(L) == [(0, 0, 3, 1), (1, 0, 4, 2), (2, 0, 3, 1), (3, 0, 2, 0)]
    assert nodes_of(L) == [(-1, 0, 2, 0, 0, 4), (0, 2, 1, 2, 2, 3), (1, 3, 1, 3, 7, 1)]
    assert L.segments() == [(0, 2, -1, 0, 4), (2, 1, 0, 2, 4), (3, 1, 1, 3, 4)]
    assert [L.path(i) for i in range(4)] == [[0, 1], [0, 1, 2], [0, 1], [0]]
    assert L.token_multiplicity().tolist() == [4, 4, 3, 1]
    assert L.copy_runs() == [(4, 0, 2), (6, 2, 1), (8, 0, 2), (10, 2, 1), (12, 0, 2)]
    s = L.stats()
    assert (s.tokens_before, s.tokens_after, s.depth) == (12, 4, 3)
    # pairs: 6 + 10 + 6 + 3 -> 3 + (2 + 1) + (3 + 1)
    assert (s.attention_pairs_before, s.attention_pairs_after) == (25, 10)
    y = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    unpack(y, L).backward(torch.ones(4, 4, dtype=torch.float64))
    assert y.grad.tolist() == [4, 4, 3, 1]  # the gradient of a shared token sums over its sequences


def test_identical_sequences_with_min_shared_get_a_copy_each():
    ids = T([[1, 2, 0], [1, 2, 0], [1, 2, 3]])
    mask = T([[1, 1, 0], [1, 1, 0], [1, 1, 1]])
    L = detect(ids, mask, min_shared=3)
    assert seqs_of(L) == [(0, 0, 2, 0), (1, 0, 2, 1), (2, 0, 3, 2)]
    assert nodes_of(L) == [(-1, 0, 2, 0, 0, 1), (-1, 0, 2, 2, 3, 1), (-1, 0, 3, 4, 6, 1)]
    L = detect(ids, mask, min_shared=2)
    assert nodes_of(L) == [(-1, 0, 2, 0, 0, 3), (0, 2, 1, 2, 8, 1)]


def test_one_token_sequences_and_leaves():
    # One-token sequences: rows 0 and 1 are [5] (identical), row 2 is [5, 6].
    L = detect(T([[5, 0], [5, 0], [5, 6]]), T([[1, 0], [1, 0], [1, 1]]))
    assert seqs_of(L) == [(0, 0, 1, 0), (1, 0, 1, 0), (2, 0, 2, 1)]
    assert nodes_of(L) == [(-1, 0, 1, 0, 0, 3), (0, 1, 1, 1, 5, 1)]
    assert L.segments() == [(0, 1, -1, 0, 2), (1, 1, 0, 1, 2)]
    # A one-token sequence of its own next to one-token leaves under a prompt.
    L = detect(T([[4, 0, 0], [1, 2, 7], [1, 2, 8]]), T([[1, 0, 0], [1, 1, 1], [1, 1, 1]]))
    assert nodes_of(L) == [(-1, 0, 1, 0, 0, 1), (-1, 0, 2, 1, 3, 2), (1, 2, 1, 3, 5, 1), (1, 2, 1, 4, 8, 1)]
    assert L.segments() == [(0, 1, -1, 0, 1), (1, 2, -1, 0, 5), (3, 1, 1, 2, 4), (4, 1, 1, 2, 5)]
    assert L.max_seg_len == 2 and L.max_prefix_len == 2


def test_build_forest_directly():
    batch = read_sequences(T([[1, 2, 3], [1, 2, 0], [7, 0, 0]]), T([[1, 1, 1], [1, 1, 0], [1, 0, 0]]))
    nodes, leaf = build_forest(batch)
    assert [(n.parent, n.offset, n.length, n.members) for n in nodes] == [(-1, 0, 2, (0, 1)), (0, 2, 1, (0,)), (-1, 0, 1, (2,))]
    assert leaf == [1, 0, 2]
    nodes, leaf = build_forest(batch, min_shared=3)
    assert [(n.parent, n.offset, n.length, n.members) for n in nodes] == [(-1, 0, 3, (0,)), (-1, 0, 2, (1,)), (-1, 0, 1, (2,))]
    assert leaf == [0, 1, 2]


# --------------------------------------------------------------------------- shuffles (property)


@st.composite
def grpo_batches(draw, vocab=3):
    """Groups of rows (a prompt, then responses), some groups sharing a system prompt;
    one sequence per row, right-padded; and a permutation of the rows."""
    system = draw(st.lists(st.integers(1, vocab), max_size=2))
    seqs = []
    for _ in range(draw(st.integers(1, 3))):
        prompt = (system if draw(st.booleans()) else []) + draw(st.lists(st.integers(1, vocab), max_size=3))
        for _ in range(draw(st.integers(1, 3))):
            seqs.append(prompt + draw(st.lists(st.integers(1, vocab), max_size=3)))
    seqs = [s or [1] for s in seqs]
    return seqs, draw(st.permutations(range(len(seqs))))


def right_padded(seqs):
    S = max(len(s) for s in seqs)
    return T([s + [0] * (S - len(s)) for s in seqs]), T([[1] * len(s) + [0] * (S - len(s)) for s in seqs])


def packed_row(seqs):
    return T([[t for s in seqs for t in s]]), T([[p for s in seqs for p in range(len(s))]])


def shape_of(L: SharedPromptLayout):
    return L.num_tokens, sorted((n.length, n.count) for n in L.nodes), L.stats().rho, L.depth()


@settings(max_examples=60, deadline=None)
@given(batch=grpo_batches(), min_shared=st.integers(1, 3))
def test_shuffling_rows_changes_nothing_but_the_order(batch, min_shared):
    seqs, perm = batch
    shuffled = [seqs[i] for i in perm]
    a = detect(*right_padded(seqs), min_shared=min_shared)
    b = detect(*right_padded(shuffled), min_shared=min_shared)
    assert shape_of(a) == shape_of(b)
    # The same sequences packed into one row (positions restarting), in either order.
    ids, pos = packed_row(seqs)
    c = detect(ids, position_ids=pos, min_shared=min_shared, same_columns=False)
    ids, pos = packed_row(shuffled)
    d = detect(ids, position_ids=pos, min_shared=min_shared, same_columns=False)
    assert shape_of(c) == shape_of(d) == shape_of(a)
    # Roots, and each node's children, come in order of their first sequence.
    for L in (a, b, c, d):
        first = [min(i for i in range(len(L.sequences)) if n in L.path(i)) for n in range(len(L.nodes))]
        for p in {-1, *range(len(L.nodes))}:
            kids = [first[n] for n, node in enumerate(L.nodes) if node.parent == p]
            assert kids == sorted(kids)
