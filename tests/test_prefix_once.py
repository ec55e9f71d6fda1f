"""``schedule.prefix_once_step``: one group's step over micro-batches of its responses equals the unsplit step.

Tiny Qwen3 and Qwen3-MoE (float32, random weights, train mode): a prompt of 9 tokens and 8 responses of 2-7 tokens
in 4 micro-batches of 2; the loss a GRPO-style token sum over the group's response tokens. The reference is the
unsplit batch of [prompt | response] rows (right-padded) in one call; loss and every parameter gradient agree
within 1e-5, and the embedding sees the prompt's tokens once (a hook counts every token through it).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dualkv_compile.schedule import last_stats, prefix_once_step  # noqa: E402

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, attn_implementation="sdpa")
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1, norm_topk_prob=True)


def _model(kind):
    torch.manual_seed(0)
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY)).train()
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**TINY, **MOE)).train()


def _group(seed=0, P=9, lengths=(5, 2, 7, 3, 6, 4, 7, 2)):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 97, (P,), generator=g)
    responses = [torch.randint(1, 97, (n,), generator=g) for n in lengths]
    advantages = torch.randn(len(lengths), generator=g)
    return prompt, responses, advantages


def _padded(responses):
    R = max(len(r) for r in responses)
    ids, mask = torch.zeros(len(responses), R, dtype=torch.long), torch.zeros(len(responses), R, dtype=torch.long)
    for b, r in enumerate(responses):
        ids[b, :len(r)], mask[b, :len(r)] = r, 1
    return ids, mask


def _loss(logits, batch):
    """sum over response tokens of -A * logp, over the group's token count (as a token-mean over micro-batches)."""
    logp = torch.log_softmax(logits.float(), -1).gather(-1, batch["responses"][..., None])[..., 0]
    return -(logp * batch["advantages"][:, None] * batch["response_mask"]).sum() / batch["group_tokens"]


def _counting(model):
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    return seen


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_prefix_once_step_equals_the_unsplit_step(kind):
    prompt, responses, adv = _group()
    total = sum(len(r) for r in responses)
    ref_model, model = _model(kind), _model(kind)
    # The unsplit step: every row [prompt | response], the logits that predict each response token.
    ids, mask = _padded(responses)
    P, B, R = len(prompt), len(responses), ids.shape[1]
    rows = torch.cat([prompt.expand(B, P), ids], dim=1)
    attention = torch.cat([torch.ones(B, P, dtype=torch.long), mask], dim=1)
    seen_ref = _counting(ref_model)
    logits = ref_model(input_ids=rows, attention_mask=attention).logits[:, P - 1:P - 1 + R]
    want = _loss(logits, dict(responses=ids, response_mask=mask, advantages=adv, group_tokens=total))
    want.backward()
    # The schedule: 4 micro-batches of 2 responses.
    seen = _counting(model)
    parts = []
    for i in range(0, B, 2):
        r, m = _padded(responses[i:i + 2])
        parts.append(dict(responses=r, response_mask=m, advantages=adv[i:i + 2], group_tokens=total))
    losses = prefix_once_step(model, prompt, parts, _loss)
    assert float(sum(losses)) == pytest.approx(float(want.detach()), rel=1e-5, abs=1e-7)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert q.grad is not None and p.grad is not None, name
        err = (p.grad - q.grad).norm() / q.grad.norm().clamp(min=1e-30)
        assert err <= 1e-5, (name, float(err))
    # The prompt's tokens through the embedding once: P - 1 of them, plus each row's last prompt token and response.
    assert seen == [P - 1] + [p["responses"].numel() + len(p["responses"]) for p in parts]
    assert sum(seen) < sum(seen_ref) == B * (P + R)
    assert last_stats().prefix_tokens == P - 1 and last_stats().micro_batches == 4


def test_prefix_once_step_refuses_what_it_does_not_cover():
    prompt, responses, adv = _group()
    r, m = _padded(responses[:2])
    with pytest.raises(ValueError, match="micro_batches\\[0\\]: expected 'responses' and 'response_mask'"):
        prefix_once_step(_model("qwen3"), prompt, [dict(responses=r, response_mask=m[:, :1])], _loss)
    with pytest.raises(ValueError, match="prompt: expected a 1-D int64"):
        prefix_once_step(_model("qwen3"), prompt[None], [dict(responses=r, response_mask=m)], _loss)
    windowed = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, use_sliding_window=True,
                                                                      sliding_window=4, max_window_layers=0))
    with pytest.raises(ValueError, match="model: expected a causal LM of full-attention layers only"):
        prefix_once_step(windowed, prompt, [dict(responses=r, response_mask=m)], _loss)
