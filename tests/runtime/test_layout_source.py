"""A model split into several graphs: the layout carried from graph to graph (dualkv_compile.layout.carried).

The split mirrors FSDP2 ``fully_shard`` per decoder layer: a forward pre-hook
run under ``torch._dynamo.disable`` on every layer, a graph break at each
layer boundary. No graph then holds the token ids with the attention: the
per-layer graph takes hidden states, cos/sin and a 4-D mask, and the last
graphs (final norm, lm_head) have no attention at all.
"""

from __future__ import annotations

import copy
import functools

import expecttest
import pytest
import torch

import dualkv_compile
from dualkv_compile.layout import carried as active_layout
from dualkv_compile.backend import dualkv_backend

from tests.helpers import BATCHES, check_model, hf_model, rel, grpo_batch

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


# eager attention's per-layer graphs under `make test-slow` (the suite's time budget; eager is matched by the same
# code as in the whole-model graphs, tested there).
@pytest.mark.parametrize("impl", ["sdpa", pytest.param("eager", marks=pytest.mark.slow)])
def test_per_layer_graphs_packed_and_exact(one_thread, impl):
    torch._dynamo.reset()
    active_layout.clear()
    model = _split_per_layer(hf_model("qwen3", impl, layers=3))
    batches = [grpo_batch(BATCHES[k], 101, seed=i) for i, k in enumerate(BATCHES)]
    start = len(dualkv_compile.reports())
    check_model(model, batches)
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
    model = _split_per_layer(hf_model("qwen3", "sdpa", layers=2))
    ids, mask, pos = grpo_batch([(6, [4, 4, 4])], 101, left_pad=0, right_pad=0)
    assert bool(mask.all())
    start = len(dualkv_compile.reports())
    check_model(model, [(ids, mask, pos)])
    new = dualkv_compile.reports()[start:]
    layer = next(r for r in new if r.num_attention == 1)
    assert layer.packed_calls == 2, str(layer)
    assert layer.last_stats.tokens_after == 6 + 12


def test_stale_layout_not_used(one_thread):
    """A current layout of another batch: its (B, S) differ, or its shared copies differ: not used."""
    torch._dynamo.reset()
    active_layout.clear()
    model = _split_per_layer(hf_model("qwen3", "sdpa", layers=2))
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
    assert rel(out[keep], ref[keep]) <= 1e-5
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


class _BreakAfterEmbedding(torch.nn.Module):
    """An embedding, a graph break, then one causal attention block whose mask is built from the attention mask
    and the batch's sizes (as transformers builds its sdpa mask): the graph after the break has no token ids."""

    def __init__(self, vocab=101, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids)
        torch._dynamo.graph_break()
        B, S = attention_mask.shape
        causal = torch.ones(S, S, dtype=torch.bool, device=h.device).tril()
        mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
        q, k, v = self.qkv(h).view(B, S, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(h + a.transpose(1, 2).reshape(B, S, -1))


def test_graph_break_after_the_embedding_across_sequence_lengths(one_thread):
    """LoRA under gradient checkpointing (TRL's defaults with ``peft_config``) breaks the graph after the
    embedding (PEFT's frozen embedding, ``enable_input_require_grads``'s hook). The graph after the break builds
    its mask from the attention mask and the batch's sizes; Dynamo recompiles it for a second sequence length
    with symbolic sizes, which the mask then reads as ints among the graph's inputs."""
    torch._dynamo.reset()
    active_layout.clear()
    torch.manual_seed(0)
    batches = [grpo_batch(BATCHES[k], 101, seed=i) for i, k in enumerate(["one_group", "three_groups"])]
    assert len({ids.shape[1] for ids, _, _ in batches}) == len(batches)  # a new S each call
    start = len(dualkv_compile.reports())
    check_model(_BreakAfterEmbedding(), batches, forward=lambda m, ids, mask, pos: m(ids, mask))
    new = dualkv_compile.reports()[start:]
    with_attention = [r for r in new if r.num_attention]
    assert sum(r.packed_calls for r in with_attention) == len(batches), [str(r) for r in new]
    assert all(r.layout_source.startswith("detected from its hidden states and mask") for r in with_attention)
    assert len(with_attention) == 2  # the first S, then the graph with symbolic sizes


class TestPerLayerGraphDiff(expecttest.TestCase):
    def test_qwen3_decoder_layer_before_and_after(self):
        """A decoder layer's own graph (hidden states, cos/sin, 4-D mask in): packed, the mask dropped."""
        from transformers import Qwen3Config, Qwen3ForCausalLM

        from dualkv_compile.analysis.analyze import analyze
        from dualkv_compile.rewrite.pack_graph import pack_graph

        from dualkv_compile.rewrite.packed_inputs import PackedInputs

        from tests.helpers import assert_packed_structure, capture, normalise

        cfg = Qwen3Config(
            vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, max_position_embeddings=32, use_cache=False,
        )
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg)
        B, S = 3, 7
        h = torch.randn(B, S, 16)
        cos, sin = model.model.rotary_emb(h, torch.arange(S)[None])
        mask = torch.ones(S, S, dtype=torch.bool).tril()[None, None].expand(B, 1, S, S)
        inputs = []
        gm = capture(model.model.layers[0], h, attention_mask=mask, position_embeddings=(cos, sin), example_inputs=inputs)
        before = normalise(gm.code)
        self.assertIn("attn_mask = l_kwargs_attention_mask_", before)
        axes = analyze(gm, inputs).axes
        self.assertEqual(sorted(str(t) for t in axes.token_inputs), ["carried:l_args_0_", "column:l_kwargs_position_embeddings_0_", "column:l_kwargs_position_embeddings_1_"])
        packed = pack_graph(gm, axes, "reference")
        # Structure, not the names a transformers release generates (the 4-D mask input is checked, then dropped).
        rows = torch.randn(1, S, 16).expand(B, S, 16).clone()
        rows[1:, 4:] = torch.randn(B - 1, S - 4, 16)  # rows share 4 columns: T = 13 != B * S
        layout = active_layout.detect_from_values([rows], torch.ones(B, S, dtype=torch.bool))
        self.assertEqual(layout.num_tokens, 13)
        args = [rows if i == 0 else x for i, x in enumerate(inputs)]
        assert_packed_structure(self, packed, args, layout)
        out = packed(*args, *PackedInputs.of(layout))[0]
        ref = model.model.layers[0](rows, attention_mask=mask, position_embeddings=(cos, sin))
        ref = ref[0] if isinstance(ref, tuple) else ref
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_chain_of_layers_reads_inputs_once_and_catches_in_place_changes(one_thread):
    """Later layers get unpacked outputs (equal copies by construction) and the same cos/sin: no re-reading.

    A hidden state changed in place between two layers (its version counter
    moves) is read again, found to differ, and not packed on the carried
    layout; the result stays exact.
    """
    torch._dynamo.reset()
    active_layout.clear()
    model = _split_per_layer(hf_model("qwen3", "sdpa", layers=4))
    compiled = _compile(model)
    ids, mask, _ = grpo_batch(BATCHES["one_group"], 101)
    keep = mask.bool()
    with torch.no_grad():
        compiled(input_ids=ids, attention_mask=mask)  # compiles; the next call is the one counted
        active_layout.clear()
        out = compiled(input_ids=ids, attention_mask=mask).logits
        cur = active_layout.current()
        # 4 layers + norm + lm_head carried: the hidden states are read once at most (the first layer detects the
        # layout from them), cos/sin once; every later call trusts what it checked or what a packed graph made.
        assert cur is not None and cur.share_reads <= 1, cur.share_reads
        assert rel(out[keep], model(input_ids=ids, attention_mask=mask).logits[keep]) <= 1e-5

        def bump(module, args, kwargs):
            args[0][1, -2:] += 1.0  # row 1's last columns: its response, and (left padded) none of the prompt
            args[0][1, :, 0] += 0.5  # every column of row 1, the shared prompt included
            return None

        handle = model.model.layers[2].register_forward_pre_hook(torch._dynamo.disable(bump), with_kwargs=True)
        try:
            out = compiled(input_ids=ids, attention_mask=mask).logits
            ref = model(input_ids=ids, attention_mask=mask).logits
        finally:
            handle.remove()
    assert rel(out[keep], ref[keep]) <= 1e-5
    layer = [r for r in dualkv_compile.reports() if r.num_attention == 1]
    assert any("differ across the rows of a group" in w for r in layer for w in r.not_carried), [str(r) for r in layer]


def test_out_of_memory_on_the_first_packed_call_is_raised(one_thread, monkeypatch):
    """A first packed call that runs out of memory raises it: running the original program instead (what other
    first-call failures do) needs more memory still and hid the error (the 2 x H200 run of 2026-11-26)."""
    import dualkv_compile.runtime.runner as runner

    def out_of_memory(*args, **kwargs):
        def run(*a):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 153.01 GiB")
        return run

    monkeypatch.setattr(runner, "nested_compile", out_of_memory)
    monkeypatch.setattr(runner.direct_compile, "DirectCompile", out_of_memory)  # either route
    torch._dynamo.reset()
    from tests.tiny_decoder import TinyDecoder

    model = TinyDecoder()
    ids, _, pos = grpo_batch([(5, [3, 2, 4])], 61, left_pad=0)  # right-padded: causal attention needs no mask
    compiled = torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    before = len(dualkv_compile.reports())
    with pytest.raises(torch.OutOfMemoryError, match="153.01 GiB"):
        compiled(ids, pos)
    report = dualkv_compile.reports()[before]
    assert report.rewritten and report.packed_calls == 0, str(report)
