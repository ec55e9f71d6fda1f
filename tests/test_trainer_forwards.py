"""The forwards trainers call, beyond ``model(input_ids, attention_mask).logits``: exact (or as exact as
the unmodified model) and packed.

* ``logits_to_keep=k`` (TRL before 1.16, and transformers' own ``generate``-style scoring): the lm_head
  runs on ``hidden[:, -k:]`` in the original layout; the loss multiplies the log-probs by the response
  mask, so the padding positions in that window are masked and the call packs.
* mixed precision (``torch.autocast``, as TRL's ``accelerator.autocast()`` and veRL's FSDP mixed
  precision run the model): SDPA casts q, k, v to the autocast dtype; the packed attention must too
  (HF's float32 RMSNorm and rotary leave q, k in float32 and v in bfloat16).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import dualkv_compile
from dualkv_compile.backend import dualkv_backend

from .helpers import grpo_batch, hf_model, rel

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH = [(6, [3, 4, 2]), (5, [2, 3])]


def _compiled(model):
    torch._dynamo.reset()
    return torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))


def _last_report():
    report = dualkv_compile.reports()[-1]
    assert report.rewritten and report.packed_calls == report.calls == 1, (report.reason, report.fallback_reasons)
    return report


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_logits_to_keep_packs_and_is_exact(impl):
    model = hf_model("qwen3", impl)
    ref = copy.deepcopy(model)
    ids, mask, _ = grpo_batch(BATCH, 101)
    K = 6  # the response block and one column before it

    def loss(m, input_ids, attention_mask):
        logits = m(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=K).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, input_ids[:, -K + 1 :, None]).squeeze(-1)
        return (logp * attention_mask[:, -K + 1 :]).sum() / attention_mask[:, -K + 1 :].sum()

    out = _compiled(functools.partial(loss, model))(input_ids=ids, attention_mask=mask)
    expected = loss(ref, ids, mask)
    assert rel(out, expected) <= 1e-6
    out.backward()
    expected.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel(p.grad, q.grad) <= 1e-5, name
    assert _last_report().last_stats.tokens_after < _last_report().last_stats.tokens_before


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_autocast_bfloat16_packs_with_the_plain_models_error(impl):
    model = hf_model("qwen3", impl)
    plain, full = copy.deepcopy(model), copy.deepcopy(model)
    ids, mask, _ = grpo_batch(BATCH, 101)
    valid = mask.bool()
    compiled = _compiled(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(input_ids=ids, attention_mask=mask).logits
        bf16 = plain(input_ids=ids, attention_mask=mask).logits
    fp32 = full(input_ids=ids, attention_mask=mask).logits
    assert out.dtype == bf16.dtype
    _last_report()
    # bfloat16 keeps 8 bits: the packed program's error against float32 is the plain model's, within a factor.
    err, plain_err = rel(out[valid].float(), fp32[valid]), rel(bf16[valid].float(), fp32[valid])
    assert 0 < plain_err < 0.05 and err <= 2 * plain_err, (err, plain_err)
    proj = torch.randn(101, generator=torch.Generator().manual_seed(1))
    for logits, m in ((out, model), (bf16, plain), (fp32, full)):
        (logits[valid].float() @ proj).sum().backward()
    for (name, p), q, r in zip(model.named_parameters(), plain.parameters(), full.parameters()):
        assert rel(p.grad, r.grad) <= 2 * rel(q.grad, r.grad) + 1e-3, name


@pytest.mark.parametrize("cut", ["head", "tail", "none"])
def test_hidden_states_leave_with_merged_token_axes(cut):
    """TRL's fused lm_head flattens ``last_hidden_state[:, :-1]`` to ``[B * (S - 1), H]`` before its
    own (untraceable) chunked log-prob function: the graph's output has a merged token axis of
    ``B * (S - 1)`` (``x[:, 1:]``: the next-token-aligned columns, ``B * S``: no slice)."""
    model = hf_model("qwen3", "sdpa")
    ref = copy.deepcopy(model)
    ids, mask, _ = grpo_batch(BATCH, 101)
    cols = {"head": slice(None, -1), "tail": slice(1, None), "none": slice(None)}[cut]

    def hidden(m, input_ids, attention_mask):
        h = m.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return h[:, cols].reshape(-1, h.shape[-1])

    out = _compiled(functools.partial(hidden, model))(input_ids=ids, attention_mask=mask)
    expected = hidden(ref, ids, mask)
    # Packing computes no padding position, and a next-token column whose predecessor is padding: zeros there.
    keep = mask[:, cols].bool() & (mask[:, :-1].bool() if cut == "tail" else True)
    keep = keep.reshape(-1)
    assert out.shape == expected.shape
    assert rel(out[keep], expected[keep]) <= 1e-5 and not out[~keep].any()
    proj = torch.randn(out.shape[-1], generator=torch.Generator().manual_seed(2))
    (out[keep] @ proj).square().sum().backward()
    (expected[keep] @ proj).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert rel(p.grad, q.grad) <= 1e-5, name
    _last_report()


def _autocast_step_is_fused_with_the_plain_models_error(model) -> None:
    """One decorated ``with_entropy_and_kl`` step under bfloat16 autocast: the log-probs and the entropy fused, and
    the loss and the gradients within twice the plain model's bfloat16 error of its float32 step."""
    from .helpers import make_batch, with_entropy_and_kl

    plain, full = copy.deepcopy(model), copy.deepcopy(model)
    batch = make_batch([(6, [3, 4, 2]), (5, [2, 3])], seed=3)
    torch._dynamo.reset()
    decorated = dualkv_compile.policy_loss(with_entropy_and_kl, inner="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = decorated(model, batch)
        bf16 = with_entropy_and_kl(plain, batch)
    fp32 = with_entropy_and_kl(full, batch)
    report = _last_report()
    assert report.rewritten and report.packed_calls == 1, str(report)
    assert report.fused_log_probs == 1 and report.fused_entropy == 1, str(report)
    err, plain_err = rel(out.float(), fp32), rel(bf16.float(), fp32)
    assert err <= 2 * plain_err + 1e-3, (err, plain_err)
    for loss in (out, bf16, fp32):
        loss.backward()
    for (name, p), q, r in zip(model.named_parameters(), plain.parameters(), full.parameters()):
        assert rel(p.grad, r.grad) <= 2 * rel(q.grad, r.grad) + 1e-3, name


def test_autocast_bfloat16_fuses_the_log_probs_and_entropy_with_the_plain_models_error():
    """Under autocast (TRL's ``accelerator.autocast()``, veRL's engine) the lm_head runs in bfloat16: the chunked op
    gets its operands cast as autocast casts them, so the log-probs and the entropy are still fused (no [T, V])."""
    _autocast_step_is_fused_with_the_plain_models_error(hf_model("qwen3", "sdpa"))


def test_an_autocast_region_elsewhere_in_the_graph_leaves_the_log_probs_fused():
    """transformers 5.17's rotary embedding turns autocast off around its cos/sin: an autocast region inside the
    graph, away from the lm_head. The log-probs and the entropy are fused all the same (before: the whole graph was
    left unfused, and TRL's and veRL's autocast steps on transformers 5.17 built the [T, V] logits)."""
    model = hf_model("qwen3", "sdpa")
    rotary = model.model.rotary_emb
    rotary_forward = rotary.forward

    def forward_without_autocast(*args, **kwargs):
        with torch.autocast("cpu", enabled=False):
            return rotary_forward(*args, **kwargs)

    rotary.forward = forward_without_autocast
    _autocast_step_is_fused_with_the_plain_models_error(model)


def test_log_probs_inside_an_autocast_region_of_the_graph_are_left_unfused():
    """A loss that enters autocast itself, around the model and the log-probs: the chain runs inside the graph's
    own autocast region, whose dtype policy the fused op would not replay, so it stays unfused, and exact."""
    from .helpers import make_batch, with_entropy_and_kl

    def loss_under_autocast(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return with_entropy_and_kl(model, batch)

    model = hf_model("qwen3", "sdpa")
    plain = copy.deepcopy(model)
    batch = make_batch([(6, [3, 4, 2]), (5, [2, 3])], seed=3)
    torch._dynamo.reset()
    out = dualkv_compile.policy_loss(loss_under_autocast, inner="aot_eager")(model, batch)
    want = loss_under_autocast(plain, batch)
    report = _last_report()
    assert report.rewritten and report.packed_calls == 1, str(report)
    assert report.fused_log_probs == 0 and report.fused_entropy == 0, str(report)
    assert rel(out.float(), want.float()) <= 2e-2, (out, want)
