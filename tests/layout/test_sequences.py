"""Tests of dualkv_compile.layout.sequences.read_sequences: the sequences of a batch and their keys.

A sequence is a padded row's valid run, split where the position ids do not
continue (packed rows: veRL remove-padding, TRL padding-free). Expectations
are written by hand; the single host transfer is counted in ``test_layout_syncs.py``.
"""

from __future__ import annotations

import pytest
import torch

from dualkv_compile.layout.sequences import HostBatch, read_sequences


pytestmark = pytest.mark.usefixtures("one_thread")


def T(rows):
    return torch.tensor(rows, dtype=torch.long)


IDS = T([[0, 5, 6], [7, 8, 0]])
MASK = T([[0, 1, 1], [1, 1, 0]])
POS = T([[0, 0, 1], [0, 1, 0]])


def test_padded_rows_keys_are_token_and_column():
    hb = read_sequences(IDS, MASK)
    assert isinstance(hb, HostBatch)
    assert (hb.batch_size, hb.seq_len) == (2, 3)
    assert hb.sequences == ((0, 1, 3), (1, 0, 2))
    assert hb.keys.dtype == torch.int64 and hb.keys.device.type == "cpu" and hb.keys.is_contiguous()
    # (token, column) per position, padding included (never read: no sequence covers it)
    assert hb.keys.tolist() == [[[0, 0], [5, 1], [6, 2]], [[7, 0], [8, 1], [0, 2]]]


@pytest.mark.parametrize(
    "pos, same_columns, expected",
    [
        (None, False, [[[0], [5], [6]], [[7], [8], [0]]]),
        (POS, False, [[[0, 0], [5, 0], [6, 1]], [[7, 0], [8, 1], [0, 0]]]),
        (POS, True, [[[0, 0, 0], [5, 0, 1], [6, 1, 2]], [[7, 0, 0], [8, 1, 1], [0, 0, 2]]]),
        (torch.arange(3).view(1, 3), False, [[[0, 0], [5, 1], [6, 2]], [[7, 0], [8, 1], [0, 2]]]),
    ],
    ids=["tokens", "tokens_positions", "tokens_positions_columns", "positions_1xS"],
)
def test_key_fields(pos, same_columns, expected):
    hb = read_sequences(IDS.to(torch.int32), MASK.bool(), pos, same_columns=same_columns)
    assert hb.keys.tolist() == expected
    assert hb.sequences == ((0, 1, 3), (1, 0, 2))


def test_packed_row_splits_where_positions_restart():
    ids = T([[1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 9, 7, 7]])
    pos = T([[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 0, 1]])
    hb = read_sequences(ids, None, pos)
    assert hb.sequences == ((0, 0, 4), (0, 4, 8), (0, 8, 11), (0, 11, 13))
    # Without positions there is nothing to split on: one sequence.
    assert read_sequences(ids).sequences == ((0, 0, 13),)


def test_any_position_that_does_not_continue_starts_a_sequence():
    # A jump (5 -> 9), a repeat (0, 0), a step back (2 -> 1).
    assert read_sequences(T([[1, 1, 1, 1, 1]]), None, T([[3, 4, 5, 9, 10]])).sequences == ((0, 0, 3), (0, 3, 5))
    assert read_sequences(T([[1, 1, 1]]), None, T([[0, 0, 1]])).sequences == ((0, 0, 1), (0, 1, 3))
    assert read_sequences(T([[1, 1, 1, 1]]), None, T([[0, 1, 2, 1]])).sequences == ((0, 0, 3), (0, 3, 4))
    # One-token sequences: every position restarts.
    assert read_sequences(T([[1, 1, 1]]), None, T([[0, 0, 0]])).sequences == ((0, 0, 1), (0, 1, 2), (0, 2, 3))


def test_positions_1xS_split_every_row():
    hb = read_sequences(T([[1, 2, 3, 4], [5, 6, 7, 8]]), None, T([[0, 1, 0, 1]]))
    assert hb.sequences == ((0, 0, 2), (0, 2, 4), (1, 0, 2), (1, 2, 4))


def test_padded_rows_of_packed_sequences():
    #   row 0: [1, 2, 3] [1, 2, 4] pad        (right padding)
    #   row 1: pad [6, 6, 8] [1, 2] pad       (both)
    #   row 2: pad pad pad pad pad pad        (no sequence)
    ids = T([[1, 2, 3, 1, 2, 4, 0], [0, 6, 6, 8, 1, 2, 0], [0] * 7])
    pos = T([[0, 1, 2, 0, 1, 2, 9], [4, 0, 1, 2, 0, 1, 0], [0] * 7])
    mask = T([[1, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 0], [0] * 7])
    hb = read_sequences(ids, mask, pos)
    assert hb.sequences == ((0, 0, 3), (0, 3, 6), (1, 1, 4), (1, 4, 6))


def test_positions_at_padding_are_ignored():
    # The first valid column starts a sequence whatever the padding's positions are;
    # a padding position that would continue the run does not join it.
    hb = read_sequences(T([[9, 1, 2, 9]]), T([[0, 1, 1, 0]]), T([[-1, 0, 1, 2]]))
    assert hb.sequences == ((0, 1, 3),)


def test_rows_of_padding_hold_no_sequence():
    hb = read_sequences(T([[1, 2], [0, 0], [3, 0]]), T([[1, 1], [0, 0], [1, 0]]))
    assert hb.sequences == ((0, 0, 2), (2, 0, 1))
    assert read_sequences(T([[0, 0]]), T([[0, 0]])).sequences == ()


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match=r"input_ids must be a 2-D tensor \[B, S\], got \[3\]"):
        read_sequences(torch.arange(3))
    with pytest.raises(ValueError, match=r"input_ids must hold integer token ids, got dtype torch.float32"):
        read_sequences(torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"attention_mask must have shape \[B, S\] = \[2, 3\], got \[3, 2\]"):
        read_sequences(IDS, MASK.t())
    with pytest.raises(ValueError, match=r"attention_mask must hold only 0 and 1"):
        read_sequences(IDS, MASK * 2)
    with pytest.raises(ValueError, match=r"attention_mask must mark one contiguous run.*rows \[0\]"):
        read_sequences(IDS, T([[1, 0, 1], [1, 1, 0]]))
    with pytest.raises(ValueError, match=r"position_ids must have shape \[B, S\] = \[2, 3\] or \[1, S\], got \[2, 2\]"):
        read_sequences(IDS, MASK, POS[:, :2])


def test_detect_checks_the_ids_range_when_given_a_vocabulary():
    from dualkv_compile import detect

    ids = torch.tensor([[7, 3, 4, 0], [7, 3, 5, 9]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    detect(ids, mask, vocab_size=10)  # every id, padding included, in range
    with pytest.raises(ValueError, match=r"in \[0, 9\) .* got 9 at row 1, column 3"):
        detect(ids, mask, vocab_size=9)
    ids[0, 3] = -5  # at padding
    with pytest.raises(ValueError, match="got -5 at row 0, column 3"):
        detect(ids, mask, vocab_size=10)
    detect(ids, mask)  # no vocabulary: no range check (the ids are keys only)
