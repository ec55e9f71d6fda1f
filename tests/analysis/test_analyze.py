"""``analyze``: the one analysis entry, its frozen result, and refusals it reports rather than raises."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dualkv_compile.analysis.analyze import analyze
from dualkv_compile.analysis.node_info import Kind
from dualkv_compile.analysis.token_inputs import Role
from tests.helpers import capture
from tests.tiny_decoder import TinyDecoder


def _graph(**kw):
    torch.manual_seed(0)
    inputs = []
    gm = capture(TinyDecoder(**kw), torch.randint(1, 61, (3, 7)), torch.arange(7).expand(3, 7), example_inputs=inputs)
    return gm, inputs


def test_result_of_a_packable_graph():
    gm, inputs = _graph()
    result = analyze(gm, inputs)
    assert result.refusal is None
    assert [t.role for t in result.token_inputs] == [Role.INPUT_IDS, Role.POSITION_IDS]
    assert str(next(iter(result.token_inputs))) == "input_ids"
    (m,) = result.attention
    assert m.kind == "sdpa" and m.is_causal and m.mask is None
    assert result.axes.info[m.output].kind is Kind.TOKEN and result.axes.info[m.output].tags == ("b", None, "s", None)
    assert (result.axes.B, result.axes.S) == (3, 7)


def test_result_is_frozen():
    gm, inputs = _graph()
    result = analyze(gm, inputs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.refusal = "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.attention[0].scale = 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.axes.refusals = ()


@pytest.mark.parametrize(
    "coupling, why",
    [
        ("dropout", "dropout"),
        ("cumsum", "cumulative sum along the sequence axis"),
        ("bidirectional", "bidirectional attention"),
    ],
)
def test_refusal_is_in_the_result(coupling, why):
    gm, inputs = _graph(coupling=coupling)
    result = analyze(gm, inputs)
    assert result.refusal is not None and why in result.refusal
