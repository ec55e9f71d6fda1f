"""Unmodified Hugging Face MoE models (Qwen3-MoE, Qwen2-MoE, Mixtral) on GRPO batches: packed and exact.

Tiny configs (hidden 32, 2 layers, 4 experts, top-2, float32, sdpa) with the
default experts implementation (``grouped_mm``: sort by expert, grouped
matmuls, inverse permutation; analysis/moe_rules.py). With
``output_router_logits=True`` transformers records the router logits with
hooks, which split the forward in two graphs: the decoder (packed; the
router logits leave it unpacked, ``[B*S, E]``, zeros at padding) and the
lm_head with the load-balancing loss (packed too: the loss reads the router
logits and the attention mask, computed in the original layout from the
inputs). Later layouts compile one graph, whose loss sums over tokens are
weighted by multiplicity on the packed stream. Logits at valid positions, the
``aux_loss`` and every parameter gradient are compared with the unmodified
model on the same batch (1e-5).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import dualkv_compile
from dualkv_compile.backend import dualkv_backend

from .helpers import grpo_batch, rel

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 101
GROUPS = [(6, [3, 5, 2]), (4, [4, 1])]


def moe_model(family: str, router_logits: bool = True):
    common = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, use_cache=False, output_router_logits=router_logits, intermediate_size=48,
    )
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=8, moe_intermediate_size=24, num_experts=4,
                                          num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**common, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                          num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
        model = transformers.Qwen2MoeForCausalLM
    else:
        cfg = transformers.MixtralConfig(**common, head_dim=8, num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return model(cfg).train()


@pytest.fixture(scope="module", autouse=True)
def _traceable_expert_fallback():
    """On CPU in float32 the experts run transformers' grouped-mm fallback op. Before its backward became an op
    of its own (transformers 5.17 has a Python loop over ``offs.tolist()``), the packed graph's dynamic re-trace
    fails on it (a data-dependent guard) and the graph runs unpacked. ``torch._grouped_mm`` (bf16 on a GPU) is
    unaffected: ``benchmarks/results/model_moe/h200-2026-11-25/model_moe_h200.md`` ran packed with transformers 5.17."""
    import transformers.integrations.moe  # noqa: F401 - registers the transformers:: ops

    if not hasattr(torch.ops.transformers, "grouped_mm_fallback_backward"):
        pytest.skip(f"transformers {transformers.__version__}: the grouped-mm fallback's backward loops over "
                    "offs.tolist() (not traceable with dynamic sizes)")


def _run_and_compare(model, ref, compiled, groups, seed=0):
    ids, mask, _ = grpo_batch(groups, VOCAB, seed=seed)
    out = compiled(input_ids=ids, attention_mask=mask)
    want = ref(input_ids=ids, attention_mask=mask)
    valid = mask.bool()
    assert rel(out.logits[valid], want.logits[valid]) <= 1e-5
    proj = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1))
    loss, ref_loss = (out.logits[valid] @ proj).sum(), (want.logits[valid] @ proj).sum()
    if want.aux_loss is not None:
        assert rel(out.aux_loss.detach(), want.aux_loss.detach()) <= 1e-5
        loss, ref_loss = loss + out.aux_loss, ref_loss + want.aux_loss
    loss.backward()
    ref_loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel(p.grad, q.grad) <= 1e-5, name
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_family_packs_exactly(family):
    torch._dynamo.reset()
    model = moe_model(family)
    assert model.config._experts_implementation == "grouped_mm"
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    before = len(dualkv_compile.reports())
    _run_and_compare(model, ref, compiled, GROUPS)
    decoder, tail = dualkv_compile.reports()[before:]
    assert decoder.num_attention == 2 and decoder.rewritten and decoder.packed_calls == 1, decoder.reason
    stats = decoder.last_stats
    # Prompts 6 and 4 once, responses 3+5+2 and 4+1: 25 packed tokens of 41.
    assert (stats.tokens_before, stats.tokens_after) == (41, 25)
    # The lm_head and the load-balancing loss: the lm_head packed on the carried layout, the loss from the
    # router-logit inputs (zeros at padding) and the attention mask, an input, in the original layout.
    assert tail.num_attention == 0 and tail.calls == 1 and tail.packed_calls == 1, tail.fallback_reasons


def test_moe_without_router_logits_is_one_packed_graph():
    torch._dynamo.reset()
    model = moe_model("qwen2_moe", router_logits=False)  # a shared expert beside the routed ones
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    before = len(dualkv_compile.reports())
    _run_and_compare(model, ref, compiled, GROUPS)
    (whole,) = dualkv_compile.reports()[before:]
    assert whole.rewritten and whole.packed_calls == 1 and whole.last_stats.tokens_after == 25, whole.reason


def test_moe_one_packed_row_packs_the_loss_too():
    """veRL's remove-padding layout: one row, position ids restarting per sequence, no mask. No padding, so
    the lm_head graph (with the load-balancing loss, which counts every row) runs packed as well."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(2)
    rows = []
    for P, Rs in GROUPS:
        prompt = torch.randint(1, VOCAB, (P,), generator=g)
        rows += [torch.cat([prompt, torch.randint(1, VOCAB, (R,), generator=g)]) for R in Rs]
    rows = [rows[i] for i in (3, 0, 4, 1, 2)]  # the two groups' rows interleaved
    batch = {"input_ids": torch.cat(rows)[None], "position_ids": torch.cat([torch.arange(len(r)) for r in rows])[None]}
    model = moe_model("mixtral")
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    before = len(dualkv_compile.reports())
    out, want = compiled(**batch), ref(**batch)
    assert rel(out.logits, want.logits) <= 1e-5 and rel(out.aux_loss.detach(), want.aux_loss.detach()) <= 1e-5
    proj = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1))
    ((out.logits[0] @ proj).sum() + out.aux_loss).backward()
    ((want.logits[0] @ proj).sum() + want.aux_loss).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel(p.grad, q.grad) <= 1e-5, name
    reports = dualkv_compile.reports()[before:]
    assert [(r.rewritten, r.packed_calls, r.last_stats.tokens_after) for r in reports] == [(True, 1, 25)] * 2


def test_moe_next_batch_with_the_loss_in_the_graph():
    """A second layout: Dynamo recompiles with dynamic sizes and no graph break, so the load-balancing loss
    is in the decoder's graph. Its statistics (expert counts by ``scatter_add`` of the mask over top-k ids,
    router probabilities summed over tokens) are weighted sums on the packed stream; the padded batch's
    mask zeroes the terms packing does not compute, so the call packs (it ran unpacked before)."""
    torch._dynamo.reset()
    model = moe_model("mixtral")
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    _run_and_compare(model, ref, compiled, GROUPS)
    before = len(dualkv_compile.reports())
    _run_and_compare(model, ref, compiled, [(5, [2, 6, 1, 3]), (7, [2, 2])], seed=1)
    (whole,) = dualkv_compile.reports()[before:]
    assert whole.num_attention == 2 and whole.rewritten, whole.reason
    # The load-balancing loss's sums over tokens are taken on the packed stream, each token weighted by its
    # multiplicity (the attention mask zeroes padding's terms): the whole forward runs packed.
    assert whole.packed_calls == 1 and whole.last_stats.tokens_after == 27, whole.fallback_reasons


def deepseek_v3_model():
    """Tiny DeepSeek-V3: multi-head latent attention (q/k head dim 24, v head dim 8, key states assembled in a
    ``new_empty`` buffer by two slice ``copy_``s), one dense layer then an MoE layer with a shared expert and
    group-limited routing (8 experts in 4 groups, top-2 groups, sigmoid scores plus a correction bias, drawn
    at random so the groups differ per token)."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, kv_lora_rank=16, q_lora_rank=12,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8, max_position_embeddings=128, use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).train()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_()
    return model


def test_deepseek_v3_packs_exactly():
    """It was refused ("no token-axis rule for new_empty", then the key-state slice copies touched a packed
    value); now the buffer is a token value and its slice writes are made out of place as slice_scatter."""
    torch._dynamo.reset()
    model = deepseek_v3_model()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    before = len(dualkv_compile.reports())
    _run_and_compare(model, ref, compiled, GROUPS)
    (whole,) = dualkv_compile.reports()[before:]
    assert whole.num_attention == 2 and whole.rewritten and whole.packed_calls == 1, (whole.reason, whole.fallback_reasons)
    assert whole.last_stats.tokens_after == 25


def test_grpo_loss_with_aux_loss_under_policy_loss_packs_exactly():
    """``@policy_loss`` on a GRPO token-mean plus the router's load-balancing loss, padded batch: every graph of the
    step runs packed (the aux loss's sums over tokens weighted by multiplicity), loss and gradients exact."""
    from .helpers import assert_loss_and_grads_match, make_batch

    def loss_fn(model, batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        m = batch["response_mask"][:, 1:].float()
        return -(logp * batch["advantages"][:, None] * m).sum() / m.sum() + 0.01 * out.aux_loss

    torch._dynamo.reset()
    model = moe_model("qwen3_moe")
    ref = copy.deepcopy(model)
    batch = make_batch(GROUPS)
    before = len(dualkv_compile.reports())
    got = dualkv_compile.policy_loss(loss_fn)(model, batch)
    assert_loss_and_grads_match(got, loss_fn(ref, batch), model, ref)
    reports = dualkv_compile.reports()[before:]
    assert reports and all(r.rewritten and r.packed_calls == r.calls == 1 for r in reports), [str(r) for r in reports]
