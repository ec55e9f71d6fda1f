"""Graph-diff tests: the Dynamo graph before the rewrite and the packed graph after it.

The graphs are printed as FX code, normalised (Dynamo's input re-bindings and
the ``; x = None`` frees dropped) so they stay stable across runs.
"""

from __future__ import annotations

import copy

import expecttest
import pytest
import torch
from torch.testing import FileCheck

import dualkv_compile
from dualkv_compile.rewrite.packed_inputs import PackedInputs
from dualkv_compile.layout.packed_ops import unpack_tokens

from dualkv_compile.rewrite.pack_graph import pack_graph
from dualkv_compile.analysis.node_info import Kind
from dualkv_compile.analysis.token_axes import analyze_token_axes
from dualkv_compile.analysis.token_inputs import find_token_inputs

from tests.helpers import (
    assert_loss_and_grads_match, assert_packed_structure, capture, grpo_token_mean, hf_model, make_batch, normalise,
)

from tests.tiny_decoder import TinyDecoder


class TestGraphDiff(expecttest.TestCase):
    def test_tiny_decoder_before_and_after(self):
        torch.manual_seed(0)
        model = TinyDecoder()
        ids = torch.randint(1, 61, (3, 7))
        pos = torch.arange(7).expand(3, 7)
        gm = capture(model, ids, pos)
        self.assertExpectedInline(normalise(gm.code), """\
def forward(self, L_input_ids_ : torch.Tensor, embed.weight : torch.nn.parameter.Parameter, pos.weight : torch.nn.parameter.Parameter, L_position_ids_ : torch.Tensor, norm.weight : torch.nn.parameter.Parameter, L_self_modules_norm_parameters_bias_ : torch.nn.parameter.Parameter, qkv.weight : torch.nn.parameter.Parameter, out.weight : torch.nn.parameter.Parameter, head.weight : torch.nn.parameter.Parameter):
    embedding = torch.nn.functional.embedding(l_input_ids_, embed.weight, None, None, 2.0, False, False)
    embedding_1 = torch.nn.functional.embedding(l_position_ids_, pos.weight, None, None, 2.0, False, False)
    h = embedding + embedding_1
    layer_norm = torch.nn.functional.layer_norm(h, (16,), norm.weight, l_self_modules_norm_parameters_bias_, 1e-05)
    linear = torch._C._nn.linear(layer_norm, qkv.weight, None)
    view = linear.view(3, 7, 3, 2, -1)
    permute = view.permute(2, 0, 3, 1, 4)
    q = permute[0]
    k = permute[1]
    v = permute[2]
    a = torch._C._nn.scaled_dot_product_attention(q, k, v, dropout_p = 0.0, is_causal = True)
    transpose = a.transpose(1, 2)
    reshape = transpose.reshape(3, 7, -1)
    linear_1 = torch._C._nn.linear(reshape, out.weight, None)
    h_1 = h + linear_1
    linear_2 = torch._C._nn.linear(h_1, head.weight, None)
    return (linear_2,)""")
        axes = analyze_token_axes(gm, find_token_inputs(gm.graph))
        packed = pack_graph(gm, axes, "reference")
        self.assertExpectedInline(normalise(packed.code), """\
def forward(self, l_input_ids_ : torch.Tensor, embed.weight : torch.nn.parameter.Parameter, pos.weight : torch.nn.parameter.Parameter, l_position_ids_ : torch.Tensor, norm.weight : torch.nn.parameter.Parameter, l_self_modules_norm_parameters_bias_ : torch.nn.parameter.Parameter, qkv.weight : torch.nn.parameter.Parameter, out.weight : torch.nn.parameter.Parameter, head.weight : torch.nn.parameter.Parameter, pack_index, col_index, unpack_index, valid, prev_index, seg_start, seg_len, parent, prefix_len, subtree_end, max_seg_len, max_prefix_len):
    size = pack_index.size(0)
    pack_tokens = dualkv_compile_layout_packed_ops_pack_tokens(l_input_ids_, pack_index, 0, 1)
    pack_tokens_1 = dualkv_compile_layout_packed_ops_pack_tokens(l_position_ids_, pack_index, 0, 1)
    embedding_packed = torch.nn.functional.embedding(pack_tokens, embed.weight, None, None, 2.0, False, False)
    embedding_1_packed = torch.nn.functional.embedding(pack_tokens_1, pos.weight, None, None, 2.0, False, False)
    h_packed = embedding_packed + embedding_1_packed
    layer_norm_packed = torch.nn.functional.layer_norm(h_packed, (16,), norm.weight, l_self_modules_norm_parameters_bias_, 1e-05)
    linear_packed = torch._C._nn.linear(layer_norm_packed, qkv.weight, None)
    view_packed = linear_packed.view(1, size, 3, 2, -1)
    permute_packed = view_packed.permute(2, 0, 3, 1, 4)
    q_packed = permute_packed[0]
    k_packed = permute_packed[1]
    v_packed = permute_packed[2]
    attention_fwd_default = torch.ops.dualkv.attention_fwd.default(q_packed, k_packed, v_packed, seg_start, seg_len, parent, prefix_len, subtree_end, max_seg_len, max_prefix_len, 0.35355339059327373, 0.0, 'reference')
    a_packed = attention_fwd_default[0]
    transpose_packed = a_packed.transpose(1, 2)
    reshape_packed = transpose_packed.reshape(1, size, -1)
    linear_1_packed = torch._C._nn.linear(reshape_packed, out.weight, None)
    h_1_packed = h_packed + linear_1_packed
    linear_2_packed = torch._C._nn.linear(h_1_packed, head.weight, None)
    unpack_tokens = dualkv_compile_layout_packed_ops_unpack_tokens(linear_2_packed, unpack_index, valid, l_input_ids_, 0, 1, 0, False)
    return (unpack_tokens,)""")

    def test_hf_qwen3_attention_block_after(self):
        """The packed Qwen3 graph, checked for structure (not the names a transformers release generates):
        one shared-prompt attention and no SDPA, the mask built from the attention mask gone, and no value
        laid out [B, S, ...] between the pack and the unpack."""
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(
            vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, max_position_embeddings=32, use_cache=False,
        )
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg)
        B, S = 3, 7
        ids = torch.randint(1, 61, (1, S)).expand(B, S).clone()
        ids[1:, 4:] = torch.randint(1, 61, (B - 1, S - 4))  # rows share 4 tokens: T = 4 + 3 * 3 = 13 != B * S
        mask = torch.ones(B, S, dtype=torch.long)
        inputs = []
        gm = capture(model, input_ids=ids, attention_mask=mask, example_inputs=inputs)
        FileCheck().check_count("scaled_dot_product_attention", 1, exactly=True).run(gm.code)
        sdpa = [n for n in gm.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
        self.assertIsNotNone(sdpa[0].kwargs.get("attn_mask"), "the HF graph passes a mask built from attention_mask")

        axes = analyze_token_axes(gm, find_token_inputs(gm.graph))
        packed = pack_graph(gm, axes, "reference")
        layout = dualkv_compile.detect(ids, mask)
        self.assertEqual(layout.num_tokens, 13)
        assert_packed_structure(self, packed, inputs, layout)
        self.assertEqual(len(packed.graph.find_nodes(op="call_function", target=unpack_tokens)), 1)
        out = packed(*inputs, *PackedInputs.of(layout))[0]
        ref = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)




class SizeReadingDecoder(torch.nn.Module):
    """Reads its sizes off a model value, as Hugging Face's attention reads ``hidden_states.shape[:-1]``, and
    divides by S. With ``positions``, adds an embedding of ``arange(positions)``: broadcasting against it makes a
    symbolic S that constant after the sizes were read (what a static input does in a recompiled graph)."""

    def __init__(self, vocab=61, dim=16, heads=2, positions=None):
        super().__init__()
        self.heads, self.positions = heads, positions
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(64, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        shape = h.shape
        if self.positions is not None:
            h = h + self.pos(torch.arange(self.positions))
        q, k, v = self.qkv(h).view(*shape[:-1], 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(h + self.out(a.transpose(1, 2).reshape(shape)) / shape[1])


def _capture_dynamic(model, ids, inputs):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        inputs.extend(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, dynamic=True)(ids)
    assert len(graphs) == 1
    # The sizes Dynamo passes as symbols (s0, s1), as the ints of this call, to run the graphs eagerly.
    inputs[:] = [int(x.node.hint) if isinstance(x, torch.SymInt) else x for x in inputs]
    return graphs[0]


@pytest.mark.parametrize("positions", [None, 7], ids=["symbolic", "specialised"])
def test_sizes_read_off_token_values(positions):
    """``h.size()`` of a token value in a dynamic graph: whole (``reshape(size)``, symbolic entries) and, once a
    guard made S a constant, one entry (``size[1]``) shaping a view and read as a number (``/ S``). The packed
    graph reads the original sizes as numbers, re-derives the token axes of the shapes, does not unpack ``h``
    to read its sizes, and equals the model."""
    torch.manual_seed(0)
    model = SizeReadingDecoder(positions=positions)
    B, S = 3, 7
    ids = torch.randint(1, 61, (1, S)).expand(B, S).clone()
    ids[1:, 4:] = torch.randint(1, 61, (B - 1, S - 4))  # rows share 4 tokens: T = 13 != B * S
    inputs = []
    gm = _capture_dynamic(model, ids, inputs)
    sizes = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "size"]
    assert sizes, "the graph reads a size off a model value"
    axes = analyze_token_axes(gm, find_token_inputs(gm.graph))
    assert axes.refusals == () and all(axes.info[n].kind is Kind.NONE for n in sizes)
    packed = pack_graph(gm, axes, "reference")
    assert len(packed.graph.find_nodes(op="call_function", target=unpack_tokens)) == 1  # the logits only
    layout = dualkv_compile.detect(ids)
    assert layout.num_tokens == 13
    out = packed(*inputs, *PackedInputs.of(layout))[0]
    torch.testing.assert_close(out, model(ids), rtol=1e-5, atol=1e-5)


def test_batch_as_long_as_its_sequence_packs():
    """A static-shape graph of a [B, S] batch with B == S (TRL's first scoring call was [16, 16]): Hugging Face's
    ``arange(S)`` (the cache positions the rotary tables are built from) has the batch's length too, and was left a
    constant, which refused the graph (``combines a constant of length S with the s axis``). Packed, with the loss
    and every gradient equal to the undecorated loss's."""
    torch._dynamo.reset()
    model = hf_model("qwen3", "sdpa", layers=1)
    ref_model = copy.deepcopy(model)
    batch = make_batch([(5, [3, 4, 2, 1]), (5, [2, 4, 3, 1]), (4, [2, 4, 3, 1])])
    B, S = batch["input_ids"].shape
    assert B == S == 12
    start = len(dualkv_compile.reports())
    loss = dualkv_compile.policy_loss(grpo_token_mean, inner="aot_eager")(model, batch)
    report, = dualkv_compile.reports()[start:]
    assert report.rewritten and report.packed_calls == 1, str(report)
    assert report.last_stats.num_groups == 3
    assert_loss_and_grads_match(loss, grpo_token_mean(ref_model, batch), model, ref_model)
