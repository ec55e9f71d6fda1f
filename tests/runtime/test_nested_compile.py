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


def test_a_fallback_never_compiled_keeps_no_input_alive():
    """The fallback of a rewritten graph may never run: it must not keep the backend call's example inputs
    (the model's weights, the batch) alive meanwhile. It did, and a benchmark that built a second model in
    the same process measured the first model's weights (3.8 GB) into every later peak."""
    import gc
    import weakref

    fallbacks, refs = [], []

    def backend(gm, example_inputs):
        fallbacks.append(LazyCompile(gm, example_inputs, DualKVConfig(inner="aot_eager"), None))
        refs.extend(weakref.ref(t) for t in example_inputs if isinstance(t, torch.Tensor))
        return gm.forward

    weight, x = torch.randn(4, 4), torch.randn(2, 4)
    torch._dynamo.reset()
    torch.compile(lambda a, w: torch.relu(a @ w), backend=backend)(x, weight)
    torch._dynamo.reset()
    assert len(fallbacks) == 1 and len(refs) == 2
    del weight, x
    gc.collect()
    assert all(r() is None for r in refs), "the fallback kept an example input alive"
    # Called later, it compiles for the inputs of that call.
    w2, x2 = torch.randn(4, 4), torch.randn(2, 4)
    assert torch.equal(fallbacks[0](x2, w2)[0], torch.relu(x2 @ w2))


@pytest.mark.parametrize("dynamic", [True, False])
def test_inductor_coalescing_analysis_is_off_for_symbolic_sizes_where_it_breaks(monkeypatch, dynamic):
    """On torch < 2.12 Inductor's coalescing analysis fails an assertion on some dynamic-shape graphs (an H100,
    torch 2.11, 2026-11-27): the inner compile turns it off for graphs with symbolic sizes there, and only there."""
    import torch._inductor.compile_fx as compile_fx_module

    from dualkv_compile.runtime import nested_compile as nc

    seen = []
    real = compile_fx_module.compile_fx

    def spy(gm, example_inputs, config_patches=None, **kw):
        seen.append(dict(config_patches or {}))
        return real(gm, example_inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    monkeypatch.setattr(nc, "_COALESCE_ANALYSIS_BREAKS_DYNAMIC", True)  # as on torch 2.11, on any torch here
    gm = torch.fx.symbolic_trace(lambda x: (x * 2).sum(-1))
    x = torch.randn(3, 5)
    torch._dynamo.reset()
    if dynamic:
        run = nc.nested_compile(gm, DualKVConfig(inner="inductor"), None, dynamic=True)
    else:
        run = nc.LazyCompile(gm, [x], DualKVConfig(inner="inductor"), None)
    torch.testing.assert_close(run(x), (x * 2).sum(-1))
    assert seen, "Inductor was not called"
    # seen[0] is our call; compile_fx calls itself again inside the patch, with none.
    assert seen[0].get("triton.coalesce_tiling_analysis") is (False if dynamic else None), seen


def test_a_refused_graph_that_assigns_through_a_boolean_mask_compiles():
    """Qwen3-VL's deepstack merge, ``h[mask, :] = x`` on a graph input: no value has an unbacked size, but its
    AOTAutograd trace calls ``nonzero``, so the fallback compiles while Dynamo's shape environment is current (compiled
    on its first call instead, it raised DynamicOutputShapeException)."""

    def merge(h, mask, e, s):
        h[mask, :] = s + e
        return h

    def run(fn):
        torch.manual_seed(0)
        w = torch.randn(6, 4, requires_grad=True)
        e = torch.randn(3, 4, requires_grad=True)
        mask = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.bool)
        out = fn(w * 1, mask, e, torch.randn(3, 4))
        out.pow(2).sum().backward()
        return out.detach(), w.grad, e.grad

    torch._dynamo.reset()
    got, want = run(torch.compile(merge, backend="dualkv")), run(merge)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
