"""``runtime.recurrence_check``: the layouts a graph's recurrent layers may run packed on, and the reasons."""

from __future__ import annotations

import torch

import dualkv_compile
from dualkv_compile.runtime.recurrence_check import recurrence_mismatch

from tests.helpers import grpo_batch

NEUTRAL = (("causal convolution", None), ("gated delta rule", None))
LEAKY = (("causal convolution", "causal_conv1d: its input is not zero at the padding before a row's tokens"),)


def _left_padded():
    ids, mask, _ = grpo_batch([(5, [2, 3]), (3, [1, 4])], 41, left_pad=1)
    return dualkv_compile.detect(ids, mask), mask


def test_no_recurrent_layers_no_check():
    layout, _ = _left_padded()
    assert recurrence_mismatch((), layout, None) is None


def test_neutral_left_padding_with_the_mask_zero_there_packs():
    layout, mask = _left_padded()
    assert any(s.start > 0 for s in layout.sequences)
    assert recurrence_mismatch(NEUTRAL, layout, mask) is None


def test_left_padding_the_layer_reads_runs_unpacked():
    layout, mask = _left_padded()
    why = recurrence_mismatch(LEAKY, layout, mask)
    assert "padding before a row's tokens reaches" in why and "causal convolution: causal_conv1d" in why


def test_no_left_padding_needs_no_proof():
    ids, mask, _ = grpo_batch([(4, [2, 3]), (4, [1, 4])], 41, left_pad=0)
    layout = dualkv_compile.detect(ids, mask)
    assert all(s.start == 0 for s in layout.sequences)
    assert recurrence_mismatch(LEAKY, layout, mask) is None


def test_a_mask_nonzero_at_the_layouts_padding_runs_unpacked():
    layout, mask = _left_padded()
    other = mask.clone()
    other[0, 0] = 1  # the layout pads there; this mask would not zero it
    assert "not zero at every padding position" in recurrence_mismatch(NEUTRAL, layout, other)
    assert "no attention mask" in recurrence_mismatch(NEUTRAL, layout, None)


def test_a_row_holding_several_sequences_runs_unpacked():
    """One packed row of two sequences (position ids restart): the original's recurrence runs through both."""
    ids, mask, _ = grpo_batch([(4, [2, 3])], 41, left_pad=0, right_pad=0)
    row = torch.cat([ids[0, : int(mask[0].sum())], ids[1, : int(mask[1].sum())]])[None]
    pos = torch.cat([torch.arange(int(mask[0].sum())), torch.arange(int(mask[1].sum()))])[None]
    layout = dualkv_compile.detect(row, None, pos, same_columns=False)
    assert len(layout.sequences) == 2
    why = recurrence_mismatch(NEUTRAL, layout, None)
    assert "hold several sequences" in why and "gated delta rule" in why
