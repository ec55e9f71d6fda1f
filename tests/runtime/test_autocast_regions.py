"""``autocast_regions_as_with_blocks``: Dynamo's enter/exit autocast calls as ``with`` blocks (re-traceable by
Dynamo before torch 2.12, which failed with "Global autocast state changed while dynamo tracing" on the
packed graph of any model run under ``torch.autocast``: seen on torch 2.11)."""

from __future__ import annotations

import torch

from dualkv_compile.runtime.autocast_regions import (
    autocast_regions_as_with_blocks, has_autocast_calls, run_autocast_region,
)
from tests.helpers import capture


def f(x, w):
    y = x @ w  # bf16 under the caller's autocast
    with torch.autocast("cpu", enabled=False):
        z = (y.float() @ w).sin()  # float32, as HF's rotary embedding computes cos/sin
        with torch.autocast("cpu", dtype=torch.bfloat16):
            u = z @ w  # nested: bf16 again
        v = u.float() + z
    return y, v @ w, z


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g)


def test_regions_become_with_blocks_and_compute_the_same():
    x, w = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gm = capture(f, x, w)
        assert has_autocast_calls(gm)
        out = autocast_regions_as_with_blocks(gm)
        assert not has_autocast_calls(out)  # at the top level: each region is a run_autocast_region call
        assert sum(n.target is run_autocast_region for n in out.graph.nodes) == 1
        expected, got = gm(x, w), out(x, w)
    for a, b in zip(expected, got):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_dynamo_traces_the_result_in_one_graph():
    x, w = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gm = autocast_regions_as_with_blocks(capture(f, x, w))
        graphs = []

        def backend(g, inputs):
            graphs.append(g)
            return g.forward

        torch._dynamo.reset()
        got = torch.compile(lambda *a: gm(*a), backend=backend, fullgraph=True)(x, w)
        expected = f(x, w)
    assert len(graphs) == 1
    for a, b in zip(expected, got):
        assert a.dtype == b.dtype and torch.allclose(a.float(), b.float())


def test_a_graph_without_autocast_is_returned_unchanged():
    x, w = _inputs()
    gm = capture(lambda x, w: (x @ w).sin(), x, w)
    assert autocast_regions_as_with_blocks(gm) is gm
