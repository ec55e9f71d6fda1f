"""Attention matching (analysis/attention_match.py) for Gemma 2: the logit softcap and sliding-window masks.

Gemma 2's eager attention scales the scores, caps them (``/ c``, ``tanh``,
``* c``), adds the mask and takes an fp32 softmax; its layers alternate a
sliding-window mask (``kv > q - w``) with a full causal one. The matcher must
find both attentions with their cap, and refuse the sliding one only when the
window can bind at the graph's sequence length (the first call's mask check
cannot see a window that its batch does not reach).
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from dualkv_compile.analysis.attention_match import find_attention, mask_window, resolve_scalar_inputs
from tests.helpers import capture, grpo_batch, time_limit

transformers = pytest.importorskip("transformers")


def gemma2(softcap=50.0, sliding_window=4096, layers=2):
    cfg = transformers.Gemma2Config(
        vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, use_cache=False,
        attn_logit_softcapping=softcap, sliding_window=sliding_window,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(cfg).train()


def _matches(model):
    ids, mask, _ = grpo_batch([(7, [3, 5, 4]), (5, [2, 6])], 101)  # S = 16
    return find_attention(capture(model, input_ids=ids, attention_mask=mask).graph)


@pytest.mark.parametrize("softcap", [50.0, 1.0])
def test_gemma2_eager_attention_with_softcap(softcap):
    sliding, full = _matches(gemma2(softcap))
    for m in (sliding, full):
        assert m.kind == "eager" and m.refusal is None and m.mask is not None
        assert m.softcap == softcap and m.scale == pytest.approx(256**-0.5)  # query_pre_attn_scalar
        assert {n.target for n in m.nodes} >= {torch.tanh, operator.truediv, operator.mul}
    assert mask_window(sliding.mask) == 4096 and mask_window(full.mask) is None


def test_binding_sliding_window_is_read_exactly():
    """Gemma 2's ``kv > q - w`` (w = 6) is a window of 6 keys: read into the match, not refused; the full layer none."""
    sliding, full = _matches(gemma2(sliding_window=6))
    assert full.refusal is None and (full.window, full.chunk) == (0, 0)
    assert sliding.refusal is None and (sliding.window, sliding.chunk) == (6, 0)
    sliding, _ = _matches(gemma2(sliding_window=16))
    assert sliding.refusal is None and sliding.window == 16


def test_no_softcap_is_zero():
    for m in _matches(gemma2(softcap=None)):
        assert m.softcap == 0.0 and m.refusal is None


class _Capped(nn.Module):
    def __init__(self, cap=30.0, cap_mul=None):
        super().__init__()
        self.cap, self.cap_mul, self.scaling = cap, cap_mul, 0.5

    def forward(self, q, k, v, mask):
        s = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        s = torch.tanh(s / self.cap) * (self.cap if self.cap_mul is None else self.cap_mul)
        p = F.softmax(s + mask, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(F.dropout(p, p=0.0, training=self.training), v)


def _capture(module, dynamic):
    graphs, inputs = [], []

    def backend(gm, example_inputs):
        graphs.append(gm)
        inputs.extend(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(2, 4, 6, 8)
    torch.compile(module, backend=backend, dynamic=dynamic)(x, x, x, torch.zeros(2, 1, 6, 6))
    return graphs[0], inputs


def test_softcap_lifted_to_an_input_under_dynamic_shapes():
    gm, inputs = _capture(_Capped(), dynamic=True)
    (m,) = find_attention(gm.graph)
    assert "softcap" in m.scalar_inputs and m.refusal is None
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    (resolved,), checks, refusals = resolve_scalar_inputs([m], placeholders, inputs)
    assert resolved.softcap == 30.0 and resolved.scale == 0.5 and not refusals
    assert any(what.endswith(".softcap") and value == 30.0 for _, value, what in checks)


def test_different_divisor_and_factor_is_not_a_softcap():
    gm, _ = _capture(_Capped(cap=30.0, cap_mul=20.0), dynamic=False)
    assert find_attention(gm.graph) == []


def _window_graph(build):
    g = fx.Graph()
    q, kv = g.placeholder("q"), g.placeholder("kv")
    g.output(build(g, q, kv))
    return g.find_nodes(op="output")[0].args[0]


@pytest.mark.parametrize("build, window", [
    (lambda g, q, kv: g.call_function(operator.gt, (kv, g.call_function(operator.sub, (q, 7)))), 7),  # sliding
    (lambda g, q, kv: g.call_function(operator.lt, (g.call_function(operator.sub, (q, kv)), 5)), 5),  # distance
    (lambda g, q, kv: g.call_function(operator.eq, (g.call_function(operator.floordiv, (q, 8)),
                                                    g.call_function(operator.floordiv, (kv, 8)))), 8),  # chunks
    (lambda g, q, kv: g.call_function(operator.le, (kv, g.call_function(operator.add, (q, 0)))), None),  # causal
])
def test_mask_window_forms(build, window):
    assert mask_window(_window_graph(build)) == window


def test_scores_through_a_chain_of_shared_products_are_read_in_linear_time():
    """``s = s * s`` 60 times between the scores' matmul and the softmax: the match's walk back to the matmul visits
    each node once (it followed both operands of every product, 2**60 paths). Not an attention's scale: no match."""
    g = fx.Graph()
    q, k, v, mask = (g.placeholder(n) for n in ("q", "k", "v", "mask"))
    s = g.call_function(torch.matmul, (q, g.call_method("transpose", (k, 2, 3))))
    for _ in range(60):
        s = g.call_function(operator.mul, (s, s))
    p = g.call_function(torch.softmax, (g.call_function(operator.add, (s, mask)),), {"dim": -1})
    g.output(g.call_function(torch.matmul, (p, v)))
    with time_limit(20):
        assert find_attention(g) == []
