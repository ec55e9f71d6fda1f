"""A model split into several graphs: the layout carried from graph to graph (dualkv_compile.active_layout).

The split mirrors FSDP2 ``fully_shard`` per decoder layer: a forward pre-hook
run under ``torch._dynamo.disable`` on every layer, a graph break at each
layer boundary. No graph then holds the token ids with the attention: the
per-layer graph takes hidden states, cos/sin and a 4-D mask, and the last
graphs (final norm, lm_head) have no attention at all.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import dualkv_compile
from dualkv_compile import active_layout
from dualkv_compile.backend import dualkv_backend

from .test_backend import BATCHES, _check_model, _hf_model, _rel, grpo_batch

pytest.importorskip("transformers")


@torch._dynamo.disable
def _outside_dynamo(module, args, kwargs):
    return None


def _split_per_layer(model):
    """A graph break around every decoder layer, as FSDP2 per-layer hooks make."""
    for layer in model.model.layers:
        layer.register_forward_pre_hook(_outside_dynamo, with_kwargs=True)
    return model


def _compile(model):
    return torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_per_layer_graphs_packed_and_exact(one_thread, impl):
    torch._dynamo.reset()
    active_layout.clear()
    model = _split_per_layer(_hf_model("qwen3", impl, layers=3))
    batches = [grpo_batch(BATCHES[k], 101, seed=i) for i, k in enumerate(BATCHES)]
    start = len(dualkv_compile.reports())
    _check_model(model, batches)
    new = dualkv_compile.reports()[start:]
    # One graph serves all three layers (Dynamo recompiles it once, dynamic, for the second batch's S).
    layer = [r for r in new if r.num_attention == 1]
    assert 1 <= len(layer) <= 2 and all(r.rewritten for r in layer), [str(r) for r in new]
    # Every layer call of every batch ran packed: the first of each forward on a layout detected from its
    # hidden states and mask, the other two on that layout, carried.
    assert sum(r.packed_calls for r in layer) == 3 * len(batches), [str(r) for r in layer]
    assert all(r.layout_source.startswith(f"carried from graph {r.graph_id} (detected from its hidden states and mask)") for r in layer)
    # The final norm and the lm_head (no attention) ran packed on the carried layout too.
    tail = [r for r in new if r.num_attention == 0 and r.rewritten]
    assert sum(r.packed_calls for r in tail) == 2 * len(batches), [str(r) for r in new]
    assert all(r.layout_source.startswith("carried from graph") for r in tail)


def test_per_layer_without_padding_and_first_call_sources(one_thread):
    """No padding: HF passes no mask (causal); the layout is detected from the hidden states alone."""
    torch._dynamo.reset()
    active_layout.clear()
    model = _split_per_layer(_hf_model("qwen3", "sdpa", layers=2))
    ids, mask, pos = grpo_batch([(6, [4, 4, 4])], 101, left_pad=0, right_pad=0)
    assert bool(mask.all())
    start = len(dualkv_compile.reports())
    _check_model(model, [(ids, mask, pos)])
    new = dualkv_compile.reports()[start:]
    layer = next(r for r in new if r.num_attention == 1)
    assert layer.packed_calls == 2, str(layer)
    assert layer.last_stats.tokens_after == 6 + 12


def test_stale_layout_not_used(one_thread):
    """A current layout of another batch: its (B, S) differ, or its shared copies differ: not used."""
    torch._dynamo.reset()
    active_layout.clear()
    model = _split_per_layer(_hf_model("qwen3", "sdpa", layers=2))
    compiled = _compile(model)
    ids, mask, _ = grpo_batch(BATCHES["one_group"], 101)
    compiled(input_ids=ids, attention_mask=mask)
    cur = active_layout.current()
    assert cur is not None and cur.layout.batch_size == 4

    # The final norm alone, on hidden states of the right shape whose prompt copies differ: unpacked, exact, reason.
    norm = model.model.norm
    compiled_norm = _compile(norm)
    h = torch.randn(4, ids.shape[1], 32)
    start = len(dualkv_compile.reports())
    out = compiled_norm(h)
    assert torch.equal(out, norm(h))
    report = norm_report = dualkv_compile.reports()[start]
    assert report.rewritten and report.packed_calls == 0
    assert "no input of this call was produced" in report.fallback_reasons[-1], report.fallback_reasons

    # A layer called directly with hidden states whose prompt copies differ: the carried layout fails its
    # sharing check, and the detection from the inputs finds nothing shared (rho 1): unpacked, exact.
    layer = model.model.layers[0]
    ref_layer = copy.deepcopy(layer)
    compiled_layer = _compile(layer)
    S = ids.shape[1]
    cos, sin = model.model.rotary_emb(h, torch.arange(S)[None])
    keep = mask.bool()
    amask = (keep[:, None, None, :] & torch.ones(S, S, dtype=torch.bool).tril()[None, None])
    start = len(dualkv_compile.reports())
    out = compiled_layer(h, attention_mask=amask, position_embeddings=(cos, sin))
    ref = ref_layer(h, attention_mask=amask, position_embeddings=(cos, sin))
    out, ref = (x[0] if isinstance(x, tuple) else x for x in (out, ref))
    assert _rel(out[keep], ref[keep]) <= 1e-5
    report = dualkv_compile.reports()[start]
    assert report.packed_calls == 0, str(report)
    assert "differ across the rows of a group" in report.not_carried[-1], report.not_carried
    assert "rho 1.00" in report.fallback_reasons[-1], report.fallback_reasons
    assert "layout not carried: the layout of graph" in str(report)

    # A current layout of another (B, S): not used.
    other_ids, other_mask, _ = grpo_batch([(5, [2, 3, 1])], 101)
    active_layout.publish(dualkv_compile.detect(other_ids, other_mask), graph_id=-1, how="input_ids")
    out = compiled_norm(h)
    assert torch.equal(out, norm(h))
    assert norm_report.packed_calls == 0 and norm_report.calls == 2
    assert f"is for [3, {other_ids.shape[1]}] on cpu, this call is [4, {S}]" in norm_report.fallback_reasons[-1], str(norm_report)
    active_layout.clear()
