"""Graph-diff tests: the Dynamo graph before the rewrite and the packed graph after it.

The graphs are printed as FX code, normalised (Dynamo's input re-bindings and
the ``; x = None`` frees dropped) so they stay stable across runs.
"""

from __future__ import annotations

import re

import expecttest
import torch

from dualkv_compile.passes.pack_graph import pack_graph
from dualkv_compile.passes.token_axes import analyze_token_axes, find_token_inputs

from .tiny_decoder import TinyDecoder


def capture(model, *args, **kwargs) -> torch.fx.GraphModule:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, dynamic=False)(*args, **kwargs)
    assert len(graphs) == 1
    return graphs[0]


def normalise(code: str) -> str:
    lines = []
    for line in code.strip().splitlines():
        line = line.split(";")[0].rstrip()
        if not line.strip() or re.fullmatch(r"\s*\w+ = L_\w+", line):
            continue
        line = re.sub(r"L_self_modules_(\w+?)_parameters_weight_", r"\1.weight", line)
        line = re.sub(r"l_self_modules_(\w+?)_parameters_weight_", r"\1.weight", line)
        lines.append(line)
    return "\n".join(lines)


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
def forward(self, l_input_ids_ : torch.Tensor, embed.weight : torch.nn.parameter.Parameter, pos.weight : torch.nn.parameter.Parameter, l_position_ids_ : torch.Tensor, norm.weight : torch.nn.parameter.Parameter, l_self_modules_norm_parameters_bias_ : torch.nn.parameter.Parameter, qkv.weight : torch.nn.parameter.Parameter, out.weight : torch.nn.parameter.Parameter, head.weight : torch.nn.parameter.Parameter, pack_index, col_index, unpack_index, valid, prev_index, seg_start, seg_len, prefix_start, prefix_len, max_seg_len, max_prefix_len):
    size = pack_index.size(0)
    pack_tokens = dualkv_compile_passes_packed_ops_pack_tokens(l_input_ids_, pack_index, 0, 1)
    pack_tokens_1 = dualkv_compile_passes_packed_ops_pack_tokens(l_position_ids_, pack_index, 0, 1)
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
    attention_fwd_default = torch.ops.dualkv.attention_fwd.default(q_packed, k_packed, v_packed, seg_start, seg_len, prefix_start, prefix_len, max_seg_len, max_prefix_len, 0.35355339059327373, 'reference')
    a_packed = attention_fwd_default[0]
    transpose_packed = a_packed.transpose(1, 2)
    reshape_packed = transpose_packed.reshape(1, size, -1)
    linear_1_packed = torch._C._nn.linear(reshape_packed, out.weight, None)
    h_1_packed = h_packed + linear_1_packed
    linear_2_packed = torch._C._nn.linear(h_1_packed, head.weight, None)
    unpack_tokens = dualkv_compile_passes_packed_ops_unpack_tokens(linear_2_packed, unpack_index, valid, l_input_ids_, 0, 1, 0, False)
    return (unpack_tokens,)""")

    def test_hf_qwen3_attention_block_after(self):
        """The packed Qwen3 graph: no [B, S] tensor until the outputs, attention on the packed stream, masks gone."""
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(
            vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, max_position_embeddings=32, use_cache=False,
        )
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg)
        ids = torch.randint(1, 61, (3, 7))
        gm = capture(model, input_ids=ids, attention_mask=torch.ones(3, 7, dtype=torch.long))
        before = normalise(gm.code)
        self.assertIn("scaled_dot_product_attention", before)
        self.assertIn("attn_mask = attention_mask_1", before)
        axes = analyze_token_axes(gm, find_token_inputs(gm.graph))
        packed = pack_graph(gm, axes, "reference")
        self.assertExpectedInline(normalise(packed.code), """\
def forward(self, l_kwargs_input_ids_ : torch.Tensor, model_modules_embed_tokens.weight : torch.nn.parameter.Parameter, l_kwargs_attention_mask_ : torch.Tensor, l_self_modules_model_modules_rotary_emb_buffers_inv_freq_ : torch.Tensor, model_modules_layers_modules_0_modules_input_layernorm.weight : torch.nn.parameter.Parameter, model_modules_layers_modules_0_modules_self_attn_modules_q_proj.weight : torch.nn.parameter.Parameter, model_modules_layers_modules_0_modules_self_attn_modules_q_norm.weight : torch.nn.parameter.Parameter, model_modules_layers_modules_0_modules_self_attn_modules_k_proj.weight : torch.nn.parameter.Parameter, model_modules_layers_modules_0_modules_self_attn_modules_k_norm.weight : torch.nn.parameter.Parameter, model_modules_layers_modules_0_modules_self_attn_modules_v_proj.weight : torch.nn.parameter.Parameter, model_modules_layers_modules_0_modules_self_attn_modules_o_proj.weight : torch.nn.parameter.Parameter, model_modules_layers_modules_0_modules_post_attention_layernorm.weight : torch.nn.parameter.Parameter, model_modules_layers_modules_0_modules_mlp_modules_gate_proj.weight : torch.nn.parameter.Parameter, model_modules_layers_modules_0_modules_mlp_modules_up_proj.weight : torch.nn.parameter.Parameter, model_modules_layers_modules_0_modules_mlp_modules_down_proj.weight : torch.nn.parameter.Parameter, model_modules_norm.weight : torch.nn.parameter.Parameter, lm_head.weight : torch.nn.parameter.Parameter, pack_index, col_index, unpack_index, valid, prev_index, seg_start, seg_len, prefix_start, prefix_len, max_seg_len, max_prefix_len):
    size = pack_index.size(0)
    pack_tokens = dualkv_compile_passes_packed_ops_pack_tokens(l_kwargs_input_ids_, pack_index, 0, 1)
    inputs_embeds_packed = torch.nn.functional.embedding(pack_tokens, model_modules_embed_tokens.weight, None, None, 2.0, False, False)
    arange = torch.arange(7, device = device(type='cpu'))
    position_ids = arange + 0
    position_ids_1 = position_ids.unsqueeze(0)
    _set_grad_enabled = torch._C._set_grad_enabled(False)
    getitem_5 = position_ids_1[(Ellipsis, None)]
    float_1 = getitem_5.float()
    to_3 = l_self_modules_model_modules_rotary_emb_buffers_inv_freq_.to(device = device(type='cpu'), dtype = torch.float32)
    freqs = float_1 * to_3
    emb = torch.cat((freqs, freqs), dim = -1)
    cos = emb.cos()
    cos_1 = cos * 1.0
    sin = emb.sin()
    sin_1 = sin * 1.0
    cos_2 = cos_1.to(dtype = torch.float32)
    sin_2 = sin_1.to(dtype = torch.float32)
    _set_grad_enabled_1 = torch._C._set_grad_enabled(True)
    hidden_states_packed = inputs_embeds_packed.to(torch.float32)
    pow_1_packed = hidden_states_packed.pow(2)
    variance_packed = pow_1_packed.mean(-1, keepdim = True)
    add_3_packed = variance_packed + 1e-06
    rsqrt_packed = torch.rsqrt(add_3_packed)
    hidden_states_1_packed = hidden_states_packed * rsqrt_packed
    to_7_packed = hidden_states_1_packed.to(torch.float32)
    hidden_states_2_packed = model_modules_layers_modules_0_modules_input_layernorm.weight * to_7_packed
    linear_packed = torch._C._nn.linear(hidden_states_2_packed, model_modules_layers_modules_0_modules_self_attn_modules_q_proj.weight, None)
    view_packed = linear_packed.view((1, size, -1, 8))
    hidden_states_3_packed = view_packed.to(torch.float32)
    pow_2_packed = hidden_states_3_packed.pow(2)
    variance_1_packed = pow_2_packed.mean(-1, keepdim = True)
    add_4_packed = variance_1_packed + 1e-06
    rsqrt_1_packed = torch.rsqrt(add_4_packed)
    hidden_states_4_packed = hidden_states_3_packed * rsqrt_1_packed
    to_9_packed = hidden_states_4_packed.to(torch.float32)
    mul_6_packed = model_modules_layers_modules_0_modules_self_attn_modules_q_norm.weight * to_9_packed
    query_states_packed = mul_6_packed.transpose(1, 2)
    linear_1_packed = torch._C._nn.linear(hidden_states_2_packed, model_modules_layers_modules_0_modules_self_attn_modules_k_proj.weight, None)
    view_1_packed = linear_1_packed.view((1, size, -1, 8))
    hidden_states_5_packed = view_1_packed.to(torch.float32)
    pow_3_packed = hidden_states_5_packed.pow(2)
    variance_2_packed = pow_3_packed.mean(-1, keepdim = True)
    add_5_packed = variance_2_packed + 1e-06
    rsqrt_2_packed = torch.rsqrt(add_5_packed)
    hidden_states_6_packed = hidden_states_5_packed * rsqrt_2_packed
    to_11_packed = hidden_states_6_packed.to(torch.float32)
    mul_8_packed = model_modules_layers_modules_0_modules_self_attn_modules_k_norm.weight * to_11_packed
    key_states_packed = mul_8_packed.transpose(1, 2)
    linear_2_packed = torch._C._nn.linear(hidden_states_2_packed, model_modules_layers_modules_0_modules_self_attn_modules_v_proj.weight, None)
    view_2_packed = linear_2_packed.view((1, size, -1, 8))
    value_states_packed = view_2_packed.transpose(1, 2)
    cos_3 = cos_2.unsqueeze(1)
    sin_3 = sin_2.unsqueeze(1)
    gather_columns = dualkv_compile_passes_packed_ops_gather_columns(cos_3, col_index, 2)
    mul_9_packed = query_states_packed * gather_columns
    x1_packed = query_states_packed[(Ellipsis, slice(None, 4, None))]
    x2_packed = query_states_packed[(Ellipsis, slice(4, None, None))]
    neg_packed = -x2_packed
    cat_1_packed = torch.cat((neg_packed, x1_packed), dim = -1)
    gather_columns_1 = dualkv_compile_passes_packed_ops_gather_columns(sin_3, col_index, 2)
    mul_10_packed = cat_1_packed * gather_columns_1
    q_embed_packed = mul_9_packed + mul_10_packed
    mul_11_packed = key_states_packed * gather_columns
    x1_1_packed = key_states_packed[(Ellipsis, slice(None, 4, None))]
    x2_1_packed = key_states_packed[(Ellipsis, slice(4, None, None))]
    neg_1_packed = -x2_1_packed
    cat_2_packed = torch.cat((neg_1_packed, x1_1_packed), dim = -1)
    mul_12_packed = cat_2_packed * gather_columns_1
    k_embed_packed = mul_11_packed + mul_12_packed
    attention_fwd_default = torch.ops.dualkv.attention_fwd.default(q_embed_packed, k_embed_packed, value_states_packed, seg_start, seg_len, prefix_start, prefix_len, max_seg_len, max_prefix_len, 0.3535533905932738, 'reference')
    attn_output_packed = attention_fwd_default[0]
    attn_output_1_packed = attn_output_packed.reshape(1, -1, size, 8)
    transpose_3_packed = attn_output_1_packed.transpose(1, 2)
    attn_output_2_packed = transpose_3_packed.contiguous()
    reshape_3_packed = attn_output_2_packed.reshape(1, size, -1)
    attn_output_3_packed = reshape_3_packed.contiguous()
    attn_output_4_packed = torch._C._nn.linear(attn_output_3_packed, model_modules_layers_modules_0_modules_self_attn_modules_o_proj.weight, None)
    hidden_states_9_packed = inputs_embeds_packed + attn_output_4_packed
    hidden_states_10_packed = hidden_states_9_packed.to(torch.float32)
    pow_4_packed = hidden_states_10_packed.pow(2)
    variance_3_packed = pow_4_packed.mean(-1, keepdim = True)
    add_9_packed = variance_3_packed + 1e-06
    rsqrt_3_packed = torch.rsqrt(add_9_packed)
    hidden_states_11_packed = hidden_states_10_packed * rsqrt_3_packed
    to_13_packed = hidden_states_11_packed.to(torch.float32)
    hidden_states_12_packed = model_modules_layers_modules_0_modules_post_attention_layernorm.weight * to_13_packed
    linear_4_packed = torch._C._nn.linear(hidden_states_12_packed, model_modules_layers_modules_0_modules_mlp_modules_gate_proj.weight, None)
    silu_packed = torch.nn.functional.silu(linear_4_packed)
    linear_5_packed = torch._C._nn.linear(hidden_states_12_packed, model_modules_layers_modules_0_modules_mlp_modules_up_proj.weight, None)
    mul_15_packed = silu_packed * linear_5_packed
    down_proj_packed = torch._C._nn.linear(mul_15_packed, model_modules_layers_modules_0_modules_mlp_modules_down_proj.weight, None)
    hidden_states_13_packed = hidden_states_9_packed + down_proj_packed
    hidden_states_14_packed = hidden_states_13_packed.to(torch.float32)
    pow_5_packed = hidden_states_14_packed.pow(2)
    variance_4_packed = pow_5_packed.mean(-1, keepdim = True)
    add_11_packed = variance_4_packed + 1e-06
    rsqrt_4_packed = torch.rsqrt(add_11_packed)
    hidden_states_15_packed = hidden_states_14_packed * rsqrt_4_packed
    to_15_packed = hidden_states_15_packed.to(torch.float32)
    hidden_states_16_packed = model_modules_norm.weight * to_15_packed
    hidden_states_17_packed = hidden_states_16_packed[(slice(None, None, None), slice(None, None, None), slice(None, None, None))]
    logits_packed = torch._C._nn.linear(hidden_states_17_packed, lm_head.weight, None)
    unpack_tokens_1 = dualkv_compile_passes_packed_ops_unpack_tokens(logits_packed, unpack_index, valid, l_kwargs_input_ids_, 0, 1, 0, False)
    return (unpack_tokens_1,)""")
