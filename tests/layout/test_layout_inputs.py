"""Tests of what dualkv_compile.layout.detect reads from its inputs, and what it refuses.

The attention mask's default and dtypes, pad tokens, same_columns, position ids
(1xS, BxS, jumps, values at padding), and the errors on bad input_ids,
attention_mask, position_ids, min_shared and pack/unpack shapes. Hand-written
expectations in the notation of ``layout_cases.py``.
"""

from __future__ import annotations

import pytest
import torch

from dualkv_compile.layout import detect, pack, unpack

from .layout_cases import VERL_IDS, VERL_MASK, VERL_NODES, VERL_SEQS, T, nodes_of, seqs_of


pytestmark = pytest.mark.usefixtures("one_thread")


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
