"""Activation checkpointing (torch.utils.checkpoint per decoder layer) with the dualkv backend.

Dynamo turns each checkpoint region into a ``tag_activation_checkpoint``
call whose subgraph holds the layer, attention included. The backend inlines
the regions (``normalize.inline_checkpoint``), tagging their nodes for
recomputation, packs the flat graph, and the packed nodes of a region (the
shared-prompt attention op included) keep the tags, so AOTAutograd's
partitioner recomputes them in the backward instead of saving them.
"""

from __future__ import annotations

import copy
import functools

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import dualkv_compile
import dualkv_compile.runtime.nested_compile as nested_compile_module
from dualkv_compile.backend import dualkv_backend
from dualkv_compile.normalize.inline_checkpoint import checkpoint_regions, inline_checkpoint_regions
from dualkv_compile.rewrite.pack_graph import pack_graph
from dualkv_compile.analysis.token_axes import analyze_token_axes
from dualkv_compile.analysis.token_inputs import find_token_inputs

from tests.helpers import check_model, hf_model, grpo_batch
from tests.helpers import capture, normalise

pytest.importorskip("transformers")

BATCH = [(7, [3, 5, 4, 2])]


class CheckpointedDecoder(nn.Module):
    """Pre-norm attention layers, each run through ``torch.utils.checkpoint.checkpoint`` (non-reentrant)."""

    def __init__(self, vocab=61, dim=16, heads=2, layers=2, context_fn=None):
        super().__init__()
        self.heads, self.context_fn = heads, context_fn
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(64, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.qkvs = nn.ModuleList(nn.Linear(dim, 3 * dim, bias=False) for _ in range(layers))
        self.outs = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def layer(self, i, h):
        B, S, _ = h.shape
        q, k, v = self.qkvs[i](self.norms[i](h)).view(B, S, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return h + self.outs[i](a.transpose(1, 2).reshape(B, S, -1))

    def forward(self, input_ids, position_ids):
        h = self.embed(input_ids) + self.pos(position_ids)
        extra = {} if self.context_fn is None else {"context_fn": self.context_fn}
        for i in range(len(self.qkvs)):
            h = checkpoint(self.layer, i, h, use_reentrant=False, **extra)
        return self.head(h)


def _new_reports(start):
    return dualkv_compile.reports()[start:]


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_hf_gradient_checkpointing_packed_and_exact(one_thread, inner):
    torch._dynamo.reset()
    model = hf_model("qwen3", "sdpa", layers=2)
    # Hugging Face's per-layer checkpointing (torch.utils.checkpoint, non-reentrant); the name works in 5.17 and 5.23.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    start = len(dualkv_compile.reports())
    batches = [grpo_batch(BATCH, 101)]
    if inner == "aot_eager":
        batches.append(grpo_batch([(6, [3, 4]), (4, [2, 5, 1])], 101, seed=3))
    check_model(model, batches, inner=inner)
    new = _new_reports(start)
    assert any(r.rewritten for r in new), [str(r) for r in new]
    assert sum(r.packed_calls for r in new) >= len(batches), [str(r) for r in new]


def test_torch_checkpoint_per_layer_packed_and_exact(one_thread):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = CheckpointedDecoder().train()
    ids, mask, pos = grpo_batch(BATCH, 61)
    start = len(dualkv_compile.reports())
    check_model(model, [(ids, mask, pos)], forward=lambda m, ids, mask, pos: m(ids, pos))
    new = _new_reports(start)
    assert len(new) == 1 and new[0].rewritten and new[0].packed_calls == 1, [str(r) for r in new]
    assert new[0].num_attention == 2


def test_selective_checkpointing_refused_and_exact(one_thread):
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = CheckpointedDecoder(context_fn=functools.partial(create_selective_checkpoint_contexts, policy)).train()
    ids, mask, pos = grpo_batch(BATCH, 61)
    start = len(dualkv_compile.reports())
    check_model(model, [(ids, mask, pos)], forward=lambda m, ids, mask, pos: m(ids, pos))
    new = _new_reports(start)
    assert new and not any(r.rewritten for r in new)
    assert any("selective activation checkpointing" in (r.reason or "") for r in new), [r.reason for r in new]


class _Recorder:
    """An inner compiler for the dualkv backend: AOTAutograd with the min-cut partitioner, recording its graphs."""

    def __init__(self):
        self.forward: list[torch.fx.GraphModule] = []
        self.backward: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs, cfg, mode):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        def fw(g, _):
            self.forward.append(g)
            return make_boxed_func(g.forward)

        def bw(g, _):
            self.backward.append(g)
            return make_boxed_func(g.forward)

        return aot_autograd(fw_compiler=fw, bw_compiler=bw, partition_fn=min_cut_rematerialization_partition)(gm, example_inputs)


def _attention_calls(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and "dualkv.attention_fwd" in str(n.target))


def _packed_step(monkeypatch, checkpointing: bool) -> _Recorder:
    recorder = _Recorder()
    monkeypatch.setattr(nested_compile_module, "inner_compile", recorder)
    torch._dynamo.reset()
    model = hf_model("qwen3", "sdpa", layers=2)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, mask, _ = grpo_batch(BATCH, 101)
    start = len(dualkv_compile.reports())
    compiled = torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    compiled(input_ids=ids, attention_mask=mask).logits.sum().backward()
    new = _new_reports(start)
    assert len(new) == 1 and new[0].packed_calls == 1, [str(r) for r in new]
    # The fallback never ran, so the recorded graphs are the packed graph's alone.
    assert len(recorder.forward) == 1 and len(recorder.backward) == 1
    return recorder


def test_checkpointing_keeps_recomputation_in_packed_graph(one_thread, monkeypatch):
    """The packed forward saves fewer values with checkpointing, and the backward recomputes the attention."""
    with_ckpt = _packed_step(monkeypatch, checkpointing=True)
    without = _packed_step(monkeypatch, checkpointing=False)
    fw_ckpt, fw_plain = with_ckpt.forward[0], without.forward[0]
    assert _attention_calls(fw_ckpt) == _attention_calls(fw_plain) == 2
    # Forward outputs = the logits + the values saved for the backward (the same logits in both).
    saved_ckpt = len(fw_ckpt.graph.output_node().args[0])
    saved_plain = len(fw_plain.graph.output_node().args[0])
    assert saved_ckpt < saved_plain, (saved_ckpt, saved_plain)
    # Each layer's shared-prompt attention runs again in the backward (recomputed, not saved) ...
    assert _attention_calls(with_ckpt.backward[0]) == 2
    # ... and only there: without checkpointing its output and log-sum-exp are saved instead.
    assert _attention_calls(without.backward[0]) == 0


def _tagged(gm: torch.fx.GraphModule) -> str:
    """The checkpoint tags of ``gm``'s nodes, one line per region: ``<ac_graph_id> <policy>: node names``."""
    regions: dict = {}
    for n in gm.graph.nodes:
        if "ac_graph_id" in n.meta:
            regions.setdefault((n.meta["ac_graph_id"], n.meta["recompute"].name), []).append(n.name)
    return "\n".join(f"{rid} {policy}: {' '.join(names)}" for (rid, policy), names in regions.items())


class TestInlineCheckpointGraphDiff(expecttest.TestCase):
    def test_inline_two_regions(self):
        torch.manual_seed(0)
        model = CheckpointedDecoder(dim=8, layers=2)
        ids = torch.randint(1, 61, (3, 5))
        gm = capture(model, ids, torch.arange(5).expand(3, 5))
        body = gm.get_submodule(checkpoint_regions(gm)[0].args[0].target)
        self.assertExpectedInline(normalise(gm.code) + "\n# wrap_body_0\n" + normalise(body.code), """\
def forward(self, embed.weight : torch.nn.parameter.Parameter, L_input_ids_ : torch.Tensor, pos.weight : torch.nn.parameter.Parameter, L_position_ids_ : torch.Tensor, norms_modules_0.weight : torch.nn.parameter.Parameter, L_self_modules_norms_modules_0_parameters_bias_ : torch.nn.parameter.Parameter, qkvs_modules_0.weight : torch.nn.parameter.Parameter, outs_modules_0.weight : torch.nn.parameter.Parameter, norms_modules_1.weight : torch.nn.parameter.Parameter, L_self_modules_norms_modules_1_parameters_bias_ : torch.nn.parameter.Parameter, qkvs_modules_1.weight : torch.nn.parameter.Parameter, outs_modules_1.weight : torch.nn.parameter.Parameter, head.weight : torch.nn.parameter.Parameter):
    embedding = torch.nn.functional.embedding(l_input_ids_, embed.weight, None, None, 2.0, False, False)
    embedding_1 = torch.nn.functional.embedding(l_position_ids_, pos.weight, None, None, 2.0, False, False)
    h = embedding + embedding_1
    wrap_body_0 = self.wrap_body_0
    tag_activation_checkpoint = torch.ops.higher_order.tag_activation_checkpoint(wrap_body_0, h, norms_modules_0.weight, l_self_modules_norms_modules_0_parameters_bias_, qkvs_modules_0.weight, outs_modules_0.weight, use_reentrant = False)
    h_1 = tag_activation_checkpoint[0]
    wrap_body_1 = self.wrap_body_1
    tag_activation_checkpoint_1 = torch.ops.higher_order.tag_activation_checkpoint(wrap_body_1, h_1, norms_modules_1.weight, l_self_modules_norms_modules_1_parameters_bias_, qkvs_modules_1.weight, outs_modules_1.weight, use_reentrant = False)
    h_2 = tag_activation_checkpoint_1[0]
    linear = torch._C._nn.linear(h_2, head.weight, None)
    return (linear,)
# wrap_body_0
def forward(self, h : torch._subclasses.fake_tensor.FakeTensor, norms_modules_0.weight : torch._subclasses.fake_tensor.FakeTensor, l_self_modules_norms_modules_0_parameters_bias_ : torch._subclasses.fake_tensor.FakeTensor, qkvs_modules_0.weight : torch._subclasses.fake_tensor.FakeTensor, outs_modules_0.weight : torch._subclasses.fake_tensor.FakeTensor):
    layer_norm = torch.nn.functional.layer_norm(h, (8,), norms_modules_0.weight, l_self_modules_norms_modules_0_parameters_bias_, 1e-05)
    linear = torch._C._nn.linear(layer_norm, qkvs_modules_0.weight, None)
    view = linear.view(3, 5, 3, 2, -1)
    permute = view.permute(2, 0, 3, 1, 4)
    q = permute[0]
    k = permute[1]
    v = permute[2]
    a = torch._C._nn.scaled_dot_product_attention(q, k, v, is_causal = True)
    transpose = a.transpose(1, 2)
    reshape = transpose.reshape(3, 5, -1)
    linear_1 = torch._C._nn.linear(reshape, outs_modules_0.weight, None)
    add = h + linear_1
    return (add,)""")
        inlined = inline_checkpoint_regions(gm)
        self.assertExpectedInline(normalise(inlined.code) + "\n# tags\n" + _tagged(inlined), """\
def forward(self, embed.weight : torch.nn.parameter.Parameter, L_input_ids_ : torch.Tensor, pos.weight : torch.nn.parameter.Parameter, L_position_ids_ : torch.Tensor, norms_modules_0.weight : torch.nn.parameter.Parameter, L_self_modules_norms_modules_0_parameters_bias_ : torch.nn.parameter.Parameter, qkvs_modules_0.weight : torch.nn.parameter.Parameter, outs_modules_0.weight : torch.nn.parameter.Parameter, norms_modules_1.weight : torch.nn.parameter.Parameter, L_self_modules_norms_modules_1_parameters_bias_ : torch.nn.parameter.Parameter, qkvs_modules_1.weight : torch.nn.parameter.Parameter, outs_modules_1.weight : torch.nn.parameter.Parameter, head.weight : torch.nn.parameter.Parameter):
    embedding = torch.nn.functional.embedding(l_input_ids_, embed.weight, None, None, 2.0, False, False)
    embedding_1 = torch.nn.functional.embedding(l_position_ids_, pos.weight, None, None, 2.0, False, False)
    h = embedding + embedding_1
    layer_norm = torch.nn.functional.layer_norm(h, (8,), norms_modules_0.weight, l_self_modules_norms_modules_0_parameters_bias_, 1e-05)
    linear_1 = torch._C._nn.linear(layer_norm, qkvs_modules_0.weight, None)
    view = linear_1.view(3, 5, 3, 2, -1)
    permute = view.permute(2, 0, 3, 1, 4)
    q = permute[0]
    k = permute[1]
    v = permute[2]
    a = torch._C._nn.scaled_dot_product_attention(q, k, v, is_causal = True)
    transpose = a.transpose(1, 2)
    reshape = transpose.reshape(3, 5, -1)
    linear_2 = torch._C._nn.linear(reshape, outs_modules_0.weight, None)
    add = h + linear_2
    layer_norm_1 = torch.nn.functional.layer_norm(add, (8,), norms_modules_1.weight, l_self_modules_norms_modules_1_parameters_bias_, 1e-05)
    linear_3 = torch._C._nn.linear(layer_norm_1, qkvs_modules_1.weight, None)
    view_1 = linear_3.view(3, 5, 3, 2, -1)
    permute_1 = view_1.permute(2, 0, 3, 1, 4)
    q_1 = permute_1[0]
    k_1 = permute_1[1]
    v_1 = permute_1[2]
    a_1 = torch._C._nn.scaled_dot_product_attention(q_1, k_1, v_1, is_causal = True)
    transpose_1 = a_1.transpose(1, 2)
    reshape_1 = transpose_1.reshape(3, 5, -1)
    linear_4 = torch._C._nn.linear(reshape_1, outs_modules_1.weight, None)
    add_1 = add + linear_4
    linear = torch._C._nn.linear(add_1, head.weight, None)
    return (linear,)
# tags
1 PREFER_RECOMPUTE: layer_norm linear_1 view permute q k v a transpose reshape linear_2 add
2 PREFER_RECOMPUTE: layer_norm_1 linear_3 view_1 permute_1 q_1 k_1 v_1 a_1 transpose_1 reshape_1 linear_4 add_1""")
        # The original graph (the fallback) is left as it was.
        self.assertIsNot(inlined, gm)
        self.assertEqual(len(checkpoint_regions(gm)), 2)
        self.assertEqual(checkpoint_regions(inlined), [])
        # The packed graph keeps the tags on what replaces each region's nodes, the attention op included.
        packed = pack_graph(inlined, analyze_token_axes(inlined, find_token_inputs(inlined.graph)), "reference")
        attention = [n for n in packed.graph.nodes if n.target is torch.ops.dualkv.attention_fwd.default]
        self.assertEqual([n.meta.get("ac_graph_id") for n in attention], [1, 2])
        self.assertExpectedInline(_tagged(packed), """\
1 PREFER_RECOMPUTE: layer_norm_packed linear_1_packed view_packed permute_packed q_packed k_packed v_packed attention_fwd_default a_packed transpose_packed reshape_packed linear_2_packed add_packed
2 PREFER_RECOMPUTE: layer_norm_1_packed linear_3_packed view_1_packed permute_1_packed q_1_packed k_1_packed v_1_packed attention_fwd_default_1 a_1_packed transpose_1_packed reshape_1_packed linear_4_packed add_1_packed""")
