"""Compiling a graph's fallback (runtime.nested_compile): a graph with data-dependent sizes compiles while Dynamo's
tracing context (its shape environment) is current, so that its fallback runs when called later."""

from __future__ import annotations

import pytest
import torch

from dualkv_compile.config import DualKVConfig
from dualkv_compile.runtime.nested_compile import LazyCompile, has_unbacked_sizes


def _unpad(input_ids, attention_mask):
    indices = torch.nonzero(attention_mask.flatten()).flatten()
    return input_ids.flatten()[indices] * 2


def _plain(input_ids, attention_mask):
    return input_ids * attention_mask


@pytest.mark.parametrize("f, unbacked", [(_unpad, True), (_plain, False)])
def test_fallback_of_a_graph_with_unbacked_sizes_runs_outside_the_backend_call(f, unbacked):
    """As for a rewritten graph whose call runs unpacked: the fallback is called after the backend returned."""
    fallbacks = []

    def backend(gm, example_inputs):
        lazy = LazyCompile(gm, example_inputs, DualKVConfig(inner="aot_eager"), None)
        fallbacks.append((has_unbacked_sizes(gm), lazy, gm, list(example_inputs)))
        return gm.forward

    ids = torch.arange(12).view(2, 6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch.compile(f, backend=backend)(ids, mask)
    [(found, fallback, gm, inputs)] = fallbacks
    assert found is unbacked
    assert torch.equal(fallback(*inputs)[0], gm(*inputs)[0])
