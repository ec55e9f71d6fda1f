"""dynamic=True edge cases: a [1, 1] batch, and HF "eager" attention (its scale and dropout lifted to graph inputs)."""

from __future__ import annotations

import copy

import pytest
import torch

import dualkv_compile

from tests.helpers import BATCHES, hf_model, rel, grpo_batch
from tests.helpers import assert_loss_and_grads_match, dr_grpo_seq_mean_token_sum, grpo_steps_match, grpo_token_mean, make_batch

transformers = pytest.importorskip("transformers")


def _single_token_batch():
    return {
        "input_ids": torch.tensor([[7]]),
        "attention_mask": torch.ones(1, 1, dtype=torch.long),
        "response_mask": torch.ones(1, 1, dtype=torch.long),
        "old_logp": torch.zeros(1, 0),
        "ref_logp": torch.zeros(1, 0),
        "advantages": torch.tensor([0.5]),
    }


# Qwen3 under `make test-slow` (the suite's time budget): the path does not depend on the family.
@pytest.mark.parametrize("family", [pytest.param("qwen3", marks=pytest.mark.slow), "llama"])
def test_single_token_batch_runs_unpacked_then_normal_batch_packs(family, one_thread):
    # Dynamo specialises the [1, 1] graph's sizes of 1, so it has static shapes, yet under dynamic=True it reads
    # module floats as `placeholder.item()`: its fallback used to be compiled outside Dynamo from its example
    # inputs and failed with DataDependentOutputException (aten._local_scalar_dense).
    torch._dynamo.reset()
    model = hf_model(family, "sdpa", layers=1)
    ref_model = copy.deepcopy(model)
    loss_fn = dr_grpo_seq_mean_token_sum
    decorated = dualkv_compile.policy_loss(loss_fn, dynamic=True, inner="aot_eager")
    start = len(dualkv_compile.reports())
    for batch in (_single_token_batch(), make_batch([(6, [3, 4, 1, 5]), (4, [2, 5])], seed=1)):
        assert_loss_and_grads_match(decorated(model, batch), loss_fn(ref_model, batch), model, ref_model)
        model.zero_grad(set_to_none=True)
        ref_model.zero_grad(set_to_none=True)
    single, normal = dualkv_compile.reports()[start:]
    assert not single.rewritten and "[1, 1] batch" in single.reason, str(single)
    assert normal.rewritten and normal.packed_calls == 1, str(normal)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_eager_attention_packs_under_policy_loss_dynamic(family, one_thread):
    # Under dynamic=True the eager pattern's scale is `matmul * scaling.item()` and its dropout
    # `dropout(p=attention_dropout.item())`: module floats lifted to inputs, not constants.
    torch._dynamo.reset()
    model = hf_model(family, "eager", layers=1)
    ref_model = copy.deepcopy(model)
    decorated = dualkv_compile.policy_loss(grpo_token_mean, dynamic=True, inner="aot_eager")
    new = grpo_steps_match(decorated, model, ref_model)
    assert new and all(r.rewritten and r.reason is None and r.num_attention == 1 for r in new), [str(r) for r in new]
    assert sum(r.packed_calls for r in new) == 2 and not any(r.fallback_reasons for r in new), [str(r) for r in new]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_eager_attention_packs_under_torch_compile_dynamic(family, one_thread):
    torch._dynamo.reset()
    model = hf_model(family, "eager", layers=1)
    ref_model = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dualkv", dynamic=True, options={"inner": "aot_eager"})
    start = len(dualkv_compile.reports())
    for seed, key in enumerate(["one_group", "three_groups"]):
        ids, mask, _ = grpo_batch(BATCHES[key], 101, seed=seed)
        out = compiled(input_ids=ids, attention_mask=mask).logits
        ref = ref_model(input_ids=ids, attention_mask=mask).logits
        valid = mask.bool()
        assert rel(out[valid], ref[valid]) <= 1e-5
        out[valid].logsumexp(-1).sum().backward()
        ref[valid].logsumexp(-1).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            assert rel(p.grad, q.grad) <= 1e-5, name
        model.zero_grad(set_to_none=True)
        ref_model.zero_grad(set_to_none=True)
    new = dualkv_compile.reports()[start:]
    assert new and all(r.rewritten and r.reason is None for r in new), [str(r) for r in new]
    assert sum(r.packed_calls for r in new) == 2, [str(r) for r in new]
