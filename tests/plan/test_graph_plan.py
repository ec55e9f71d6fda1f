"""The plan (dualkv_compile.plan): what a rewritten graph's runner reads is finished once, when the graph is compiled.

Each test records the ``GraphPlan`` the backend hands its runner (``backend.plan_graph``, wrapped) and checks what it
holds: the layout source's inputs, the padding reads with their factors, the compile route's static part.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import dualkv_compile
import dualkv_compile.backend as backend
from dualkv_compile.backend import dualkv_backend
from dualkv_compile.plan import GraphPlan

from tests.helpers import grpo_batch
from tests.tiny_decoder import TinyDecoder


@pytest.fixture
def plans(monkeypatch):
    """The plans ``dualkv_backend`` makes while the test runs, in order."""
    made = []
    real = backend.plan_graph

    def record(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(backend, "plan_graph", record)
    torch._dynamo.reset()
    return made


def _compiled(fn, **options):
    return torch.compile(fn, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager", **options}))


def test_the_plan_is_made_once_per_graph_and_holds_the_layout_inputs(plans):
    model = TinyDecoder()
    compiled = _compiled(model)
    before = len(dualkv_compile.reports())
    for seed in (61, 62):
        ids, _, pos = grpo_batch([(5, [3, 2, 4])], 61, left_pad=0, seed=seed)  # right-padded: no mask needed
        torch.testing.assert_close(compiled(ids, pos), model(ids, pos))
    (report,) = dualkv_compile.reports()[before:]
    assert report.packed_calls == 2, str(report)
    (plan,) = plans  # two calls, one plan
    assert isinstance(plan, GraphPlan)
    inputs = plan.inputs
    assert "input_ids" in plan.input_names[inputs.input_ids] and "position_ids" in plan.input_names[inputs.position_ids]
    assert inputs.attention_mask is None and inputs.carried == () and inputs.has_attention
    assert inputs.vocab_size == 61 and inputs.mask_gm is None  # causal attention without a mask: nothing to evaluate
    assert plan.why_not_direct is None and not plan.padding.reads
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.why_not_direct = "changed"


@pytest.mark.parametrize(
    "options, why",
    [({"inner": "eager"}, "inner compiler 'eager' compiles no symbolic sizes"),
     ({"packed_compile": "nested"}, "options['packed_compile'] is 'nested'")],
    ids=["eager", "nested"],
)
def test_the_compile_route_is_decided_at_compile_time(plans, options, why, caplog):
    model = TinyDecoder()
    ids, _, pos = grpo_batch([(5, [3, 2, 4])], 61, left_pad=0)
    with caplog.at_level("INFO", logger="dualkv_compile"):
        torch.testing.assert_close(_compiled(model, **options)(ids, pos), model(ids, pos))
    (plan,) = plans
    assert plan.why_not_direct == why
    assert any(f"compiled through a nested torch.compile: {why}" in r.getMessage() for r in caplog.records)


def test_padding_reads_and_their_factors_are_found_at_compile_time(plans):
    model = TinyDecoder()

    def loss(model, ids, pos, response_mask):
        logp = torch.log_softmax(model(ids, pos)[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return (logp * response_mask[:, 1:]).sum() / response_mask.sum()

    ids, mask, pos = grpo_batch([(5, [3, 2, 4])], 61, left_pad=0)
    response = mask.clone()
    response[:, :5] = 0  # the prompt's tokens and its first (whose log-prob reads the column before it) are masked
    before = len(dualkv_compile.reports())
    got = _compiled(loss, chunked_log_probs=False)(model, ids, pos, response)
    torch.testing.assert_close(got, loss(model, ids, pos, response))
    (report,) = dualkv_compile.reports()[before:]
    assert report.packed_calls == 1, str(report)
    (plan,) = plans
    assert plan.padding.reads and all(read.factors for read in plan.padding.reads)
    factors = {node for gm in plan.padding.factor_gms for node in gm.factor_nodes}
    assert {node for read in plan.padding.reads for node, _, _ in read.factors} <= factors
    assert not plan.padding.unknown
