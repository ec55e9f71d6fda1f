"""``rewrite.sequence_parallel``: the packed graph split over a group, read as a graph (no process group needed).

A graph-diff test on our tiny decoder (the whole sharded graph, as code), structural checks on a Hugging Face
loss graph, the refusals, and the per-call inputs (``runtime.sequence_parallel.shard_packed_inputs``) and token
weights each rank gets. The collectives themselves run in ``tests/test_sequence_parallel.py`` (gloo ranks).
"""

from __future__ import annotations

import expecttest
import pytest
import torch

import dualkv_compile
from dualkv_compile.graph import Refusal
from dualkv_compile.analysis.token_axes import analyze_token_axes
from dualkv_compile.analysis.token_inputs import find_token_inputs
from dualkv_compile.layout import tree_segments
from dualkv_compile.ops.sp_collectives import SPGroup
from dualkv_compile.ops.ulysses_attention import check_heads, kv_repeat
from dualkv_compile.rewrite.pack_graph import pack_graph
from dualkv_compile.rewrite.packed_inputs import PackedInputs
from dualkv_compile.layout.packed_ops import token_weights
from dualkv_compile.rewrite.sequence_parallel import local_token_weights, shard_packed_graph
from dualkv_compile.runtime.sequence_parallel import local_token_count, shard_packed_inputs

from tests.helpers import GROUPS, capture, grpo_token_mean, hf_model, make_batch, normalise, packed_loss_graph, with_entropy_and_kl
from tests.tiny_decoder import TinyDecoder

SP = SPGroup(world=2, rank=1, group_name="sp")


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


class TestShardedGraph(expecttest.TestCase):
    def test_tiny_decoder_sharded(self):
        torch.manual_seed(0)
        ids = torch.randint(1, 61, (3, 7))
        pos = torch.arange(7).expand(3, 7)
        gm = capture(TinyDecoder(), ids, pos)
        packed = pack_graph(gm, analyze_token_axes(gm, find_token_inputs(gm.graph)), "reference")
        sharded = shard_packed_graph(packed, SP)
        self.assertExpectedInline(normalise(sharded.code), """\
def forward(self, l_input_ids_ : torch.Tensor, embed.weight : torch.nn.parameter.Parameter, pos.weight : torch.nn.parameter.Parameter, l_position_ids_ : torch.Tensor, norm.weight : torch.nn.parameter.Parameter, l_self_modules_norm_parameters_bias_ : torch.nn.parameter.Parameter, qkv.weight : torch.nn.parameter.Parameter, out.weight : torch.nn.parameter.Parameter, head.weight : torch.nn.parameter.Parameter, pack_index, col_index, unpack_index, valid, prev_index, seg_start, seg_len, parent, prefix_len, subtree_end, max_seg_len, max_prefix_len):
    size_1 = pack_index.size(0)
    local_tokens = size_1 // 2
    pack_tokens = dualkv_compile_layout_packed_ops_pack_tokens(l_input_ids_, pack_index, 0, 1)
    mul = local_tokens * 1
    pack_tokens_chunk = pack_tokens.narrow(1, mul, local_tokens)
    pack_tokens_1 = dualkv_compile_layout_packed_ops_pack_tokens(l_position_ids_, pack_index, 0, 1)
    mul_1 = local_tokens * 1
    pack_tokens_1_chunk = pack_tokens_1.narrow(1, mul_1, local_tokens)
    embedding_packed = torch.nn.functional.embedding(pack_tokens_chunk, embed.weight, None, None, 2.0, False, False)
    embedding_1_packed = torch.nn.functional.embedding(pack_tokens_1_chunk, pos.weight, None, None, 2.0, False, False)
    h_packed = embedding_packed + embedding_1_packed
    layer_norm_packed = torch.nn.functional.layer_norm(h_packed, (16,), norm.weight, l_self_modules_norm_parameters_bias_, 1e-05)
    linear_packed = torch._C._nn.linear(layer_norm_packed, qkv.weight, None)
    view_packed = linear_packed.view(1, local_tokens, 3, 2, -1)
    permute_packed = view_packed.permute(2, 0, 3, 1, 4)
    q_packed = permute_packed[0]
    k_packed = permute_packed[1]
    v_packed = permute_packed[2]
    attention_fwd_default_ulysses = torch.ops.dualkv.sp_all_to_all.default(q_packed, 1, 2, 2, 'sp')
    attention_fwd_default_ulysses_1 = torch.ops.dualkv.sp_all_to_all.default(k_packed, 1, 2, 2, 'sp')
    attention_fwd_default_ulysses_2 = torch.ops.dualkv.sp_all_to_all.default(v_packed, 1, 2, 2, 'sp')
    attention_fwd_default_ulysses_3 = torch.ops.dualkv.attention_fwd.default(attention_fwd_default_ulysses, attention_fwd_default_ulysses_1, attention_fwd_default_ulysses_2, seg_start, seg_len, parent, prefix_len, subtree_end, max_seg_len, max_prefix_len, 0.35355339059327373, 0.0, 'reference')
    attention_fwd_default_ulysses_4 = attention_fwd_default_ulysses_3[0]
    attention_fwd_default_ulysses_5 = torch.ops.dualkv.sp_all_to_all.default(attention_fwd_default_ulysses_4, 2, 1, 2, 'sp')
    transpose_packed = attention_fwd_default_ulysses_5.transpose(1, 2)
    reshape_packed = transpose_packed.reshape(1, local_tokens, -1)
    linear_1_packed = torch._C._nn.linear(reshape_packed, out.weight, None)
    h_1_packed = h_packed + linear_1_packed
    linear_2_packed = torch._C._nn.linear(h_1_packed, head.weight, None)
    linear_2_packed_gathered = torch.ops.dualkv.sp_all_gather.default(linear_2_packed, 1, 2, 1, 'sp', 'slice')
    unpack_tokens = dualkv_compile_layout_packed_ops_unpack_tokens(linear_2_packed_gathered, unpack_index, valid, l_input_ids_, 0, 1, 0, False)
    return (unpack_tokens,)""")


def test_loss_graph_structure():
    """A Qwen3 GRPO loss: attention through Ulysses on every layer, the fused log-prob reads the gathered hidden
    states (backward "sum"), the per-token log-probs leave through a "slice" gather, no [T, V] tensor."""
    model = hf_model("qwen3", "sdpa")
    batch = make_batch(GROUPS)
    packed, _ = packed_loss_graph(grpo_token_mean, model, batch)
    sharded = shard_packed_graph(packed, SP)
    # Each layer's attention: q, k, v exchanged, the kernel over the whole forest, the output exchanged back.
    assert len(_calls(sharded, torch.ops.dualkv.attention_fwd.default)) == 2
    assert len(_calls(sharded, torch.ops.dualkv.sp_all_to_all.default)) == 8
    for att in _calls(sharded, torch.ops.dualkv.attention_fwd.default):
        assert all(a.target is torch.ops.dualkv.sp_all_to_all.default for a in att.args[:3])
        (out,) = att.users
        assert [u.target for u in out.users] == [torch.ops.dualkv.sp_all_to_all.default]
    gathers = _calls(sharded, torch.ops.dualkv.sp_all_gather.default)
    modes = sorted(n.args[5] for n in gathers)
    assert modes == ["slice", "sum"], modes  # the lm_head's hidden rows; the token log-probs' unpack
    (fused,) = _calls(sharded, torch.ops.dualkv.linear_log_prob.default)
    assert fused.args[0].target is torch.ops.dualkv.sp_all_gather.default and fused.args[0].args[5] == "sum"
    # The token ids enter as this rank's chunk of the whole padded stream (a plain slice: no gradient).
    chunks = [n for n in sharded.graph.nodes if n.name.endswith("_chunk")]
    assert chunks and all(n.target == "narrow" for n in chunks)
    # The original graph is untouched.
    assert _calls(packed, torch.ops.dualkv.attention_fwd.default) and not _calls(packed, torch.ops.dualkv.sp_all_to_all.default)


def test_heads_the_degree_does_not_divide_are_refused():
    model = hf_model("qwen3", "sdpa")
    batch = make_batch(GROUPS)
    packed, _ = packed_loss_graph(grpo_token_mean, model, batch)
    with pytest.raises(Refusal, match="sequence-parallel degree 8 does not divide the 4 query heads"):
        shard_packed_graph(packed, SPGroup(8, 0, "sp"))


def test_fused_entropy_is_refused():
    """The entropy op's entropy covers every hidden row it reads (the gathered stream under sequence parallelism):
    the backend does not fuse an entropy there (``entropy=False``); a graph that has one is refused, not split."""
    model = hf_model("qwen3", "sdpa", layers=1)
    packed, _ = packed_loss_graph(with_entropy_and_kl, model, make_batch(GROUPS))
    assert _calls(packed, torch.ops.dualkv.linear_log_prob_entropy.default)
    with pytest.raises(Refusal, match="the fused entropy is not split over the group"):
        shard_packed_graph(packed, SP)


@pytest.mark.parametrize(
    "hq, hkv, world, why",
    [(4, 2, 2, None), (4, 1, 2, None), (8, 2, 4, None), (6, 3, 2, None), (4, 4, 3, "does not divide the 4 query"),
     (6, 3, 6, None), (12, 3, 4, None), (6, 2, 3, None), (6, 3, 4, "does not divide the 6 query")],
)
def test_check_heads(hq, hkv, world, why):
    got = check_heads(hq, hkv, world)
    if why is None:
        assert got is None
        assert (hkv * kv_repeat(hkv, world)) % world == 0 and hq % (hkv * kv_repeat(hkv, world)) == 0
    else:
        assert got is not None and why in got


def test_each_rank_gets_its_chunk_of_a_padded_stream():
    """31 packed tokens over 2 ranks: 16 each, the last a padding token (a copy of the first packed token, its own
    predecessor, a root segment of its own); every rank gets the whole padded pack_index and the same segments."""
    ids = torch.tensor([[5, 6, 7, 8, 1, 2, 0], [5, 6, 7, 8, 3, 0, 0], [9, 9, 9, 9, 9, 9, 9]])
    mask = (ids > 0).long()
    mask[2] = 1
    layout = dualkv_compile.detect(ids, mask)
    T = layout.num_tokens
    full = PackedInputs.of(layout)
    world = 3
    n = local_token_count(T, world)
    pad = n * world - T
    assert pad > 0, (T, world)
    parts = [shard_packed_inputs(full, T, SPGroup(world, r, "sp")) for r in range(world)]
    for name in ("col_index", "prev_index"):
        joined = torch.cat([getattr(p, name) for p in parts])
        assert joined.shape == (n * world,)
        torch.testing.assert_close(joined[:T], getattr(full, name))
    torch.testing.assert_close(torch.cat([p.prev_index for p in parts])[T:], torch.arange(T, T + pad))
    for p in parts:
        assert torch.equal(p.pack_index[:T], full.pack_index) and torch.equal(p.pack_index[T:], full.pack_index[:1].expand(pad))
        assert torch.equal(p.seg_len, torch.cat([full.seg_len, torch.tensor([pad], dtype=torch.int32)]))
        assert p.parent[-1] == -1 and p.subtree_end[-1] == T + pad and p.seg_start[-1] == T
        assert p.max_seg_len == max(full.max_seg_len, pad)
        assert torch.equal(p.unpack_index, full.unpack_index) and torch.equal(p.valid, full.valid)
    # The segments still describe a forest in pre-order over the padded stream.
    rows = parts[0]
    tree_segments(rows.seg_len.tolist(), rows.parent.tolist())


def test_local_token_weights_are_chunks_of_the_whole_streams():
    ids = torch.tensor([[5, 6, 7, 8, 1, 2], [5, 6, 7, 8, 3, 0]])
    layout = dualkv_compile.detect(ids, (ids > 0).long())
    T, world = layout.num_tokens, 4
    n = local_token_count(T, world)
    whole = token_weights(T, layout.unpack_index, layout.valid, ids)
    chunks = torch.cat([local_token_weights(n, layout.unpack_index, layout.valid, ids, 0, False, world, r) for r in range(world)])
    assert torch.equal(chunks[:T], whole)
    assert not chunks[T:].any()  # padding tokens count for nothing


def test_kv_heads_are_repeated_before_the_exchange_in_the_checkpoint_region():
    """2 key/value heads over 4 ranks: each is repeated twice (``kv_repeat``) before the all-to-all, as the eager
    ``ulysses_attention`` does; every node emitted for an attention carries that attention's checkpoint tags, so
    activation checkpointing recomputes the exchange instead of saving it."""
    from torch.utils.checkpoint import CheckpointPolicy

    model = hf_model("qwen3", "sdpa")
    packed, _ = packed_loss_graph(grpo_token_mean, model, make_batch(GROUPS))
    atts = _calls(packed, torch.ops.dualkv.attention_fwd.default)
    for i, att in enumerate(atts):  # as inline_checkpoint tags a region's nodes
        att.meta.update(recompute=CheckpointPolicy.PREFER_RECOMPUTE, ac_graph_id=i + 1)
    sharded = shard_packed_graph(packed, SPGroup(4, 0, "sp"))
    repeats = _calls(sharded, torch.repeat_interleave)
    assert len(repeats) == 4 and all(n.args[1:] == (2, 1) for n in repeats)  # k and v of 2 layers, twice each, on heads
    emitted = [n for n in sharded.graph.nodes if n.name.startswith("attention_fwd")]
    assert len(emitted) == 2 * 8  # per layer: 2 repeats, 3 exchanges, the kernel, its output, the exchange back
    assert sorted({n.meta.get("ac_graph_id") for n in emitted}) == [1, 2]
    assert all(n.meta.get("recompute") == CheckpointPolicy.PREFER_RECOMPUTE for n in emitted)
