"""``analysis.padding_neutral``: which recurrent layers provably read zeros (a zero state) from the padding before a
row's tokens, on ``TinyHybrid``'s graphs (tests/test_hybrid_forest.py) with each way of letting padding in."""

from __future__ import annotations

import pytest
import torch

from dualkv_compile.analysis.analyze import analyze
from dualkv_compile.normalize.causal_conv import fuse_causal_conv1d

from tests.helpers import capture
from tests.test_hybrid_forest import TinyHybrid, _forest_batch


def _neutrality(**switches):
    ids, mask = _forest_batch(2)
    inputs = []
    gm = fuse_causal_conv1d(capture(TinyHybrid(**switches), ids, mask, example_inputs=inputs))
    result = analyze(gm, inputs)
    assert result.refusal is None
    return [(kind, why) for _, kind, why in result.recurrent]


def test_masked_input_no_bias_is_neutral_for_both():
    assert _neutrality() == [("causal convolution", None), ("gated delta rule", None)]


def test_no_mask_neither_is():
    (conv, conv_why), (gdn, gdn_why) = _neutrality(mask=False)
    assert conv == "causal convolution" and "its input is not zero" in conv_why
    assert gdn == "gated delta rule" and "none of its k, v, beta" in gdn_why


def test_a_convolution_bias_reaches_the_recurrence():
    """The masked input is zero at padding, the convolution's output there is its bias: k and v are not."""
    (_, conv_why), (_, gdn_why) = _neutrality(conv_bias=True)
    assert conv_why is None and "none of its k, v, beta" in gdn_why
