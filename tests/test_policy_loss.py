"""@policy_loss: parity with the undecorated loss, and no [B, S, V] tensor in the rewritten graph."""

from __future__ import annotations

import copy

import expecttest
import pytest
import torch
from torch.testing import FileCheck

import dualkv_compile
from dualkv_compile.layout.packed_ops import unpack_tokens

from tests.helpers import (
    GROUPS, LOSSES, VOCAB, assert_loss_and_grads_match, grpo_token_mean, hf_model, make_batch,
    packed_loss_graph, with_entropy_and_kl, with_verl_entropy,
)


# Two forms in `make test` (the suite's time), every one in `make test-slow`.
@pytest.mark.parametrize("loss_fn", [grpo_token_mean, with_verl_entropy] + [
    pytest.param(f, marks=pytest.mark.slow) for f in LOSSES if f is not grpo_token_mean], ids=lambda f: f.__name__)
def test_parity_with_undecorated_loss(loss_fn):
    torch._dynamo.reset()
    model = hf_model("qwen3", "sdpa", layers=2)
    ref_model = copy.deepcopy(model)
    decorated = dualkv_compile.policy_loss(loss_fn, inner="aot_eager")
    start = len(dualkv_compile.reports())
    for seed, groups in enumerate([GROUPS, [(5, [2, 6, 3])]]):
        batch = make_batch(groups, seed=seed)
        assert_loss_and_grads_match(decorated(model, batch), loss_fn(ref_model, batch), model, ref_model)
        model.zero_grad(set_to_none=True)
        ref_model.zero_grad(set_to_none=True)
    # Two batch shapes: a static graph, then Dynamo's dynamic-shape one; both must run packed.
    new = dualkv_compile.reports()[start:]
    assert len(new) == 2 and all(r.rewritten and r.packed_calls == 1 for r in new), [str(r) for r in new]
    # The lm_head -> log_softmax -> gather is fused (chunked_log_probs), with the entropy where the loss has one
    # (read from the log-probs, or veRL's entropy_from_logits from the same logits).
    entropy = 1 if loss_fn in (with_entropy_and_kl, with_verl_entropy) else 0
    assert all(r.fused_log_probs == 1 and r.fused_entropy == entropy for r in new), [str(r) for r in new]

def test_decorator_with_options_and_bad_option():
    @dualkv_compile.policy_loss(group_size=4, min_rho=1.0, inner="aot_eager")
    def loss(model, batch):
        return grpo_token_mean(model, batch)

    torch._dynamo.reset()
    model = hf_model("qwen3", "sdpa", layers=1)
    batch = make_batch([(6, [3, 4, 1, 5]), (4, [2, 5, 2, 2])])
    assert torch.isfinite(loss(model, batch))
    assert dualkv_compile.reports()[-1].last_stats.num_groups == 2
    with pytest.raises(ValueError, match="unknown dualkv option"):
        dualkv_compile.policy_loss(min_rh=2)

@pytest.mark.parametrize("loss_fn", [grpo_token_mean, with_entropy_and_kl], ids=lambda f: f.__name__)
def test_no_batch_by_sequence_by_vocab_tensor(loss_fn):
    model = hf_model("qwen3", "sdpa", layers=1)
    batch = make_batch(GROUPS)
    B, S = batch["input_ids"].shape
    packed, layout = packed_loss_graph(loss_fn, model, batch, chunked_log_probs=False)  # pack_graph's own output
    shapes = {
        n.name: tuple(n.meta["tensor_meta"].shape)
        for n in packed.graph.nodes
        if isinstance(n.meta.get("tensor_meta"), torch.fx.passes.shape_prop.TensorMetadata)
    }
    vocab_sized = {k: v for k, v in shapes.items() if v and v[-1] == VOCAB}
    assert vocab_sized, "the lm_head output should be in the graph"
    T = layout.num_tokens
    assert all(v[:-1] == (1, T) for v in vocab_sized.values()), vocab_sized
    assert not any(len(v) >= 3 and v[0] == B and v[-1] == VOCAB for v in shapes.values())
    # The next-token gather reads each token's predecessor row in place: no shifted [1, T, V] copy.
    from dualkv_compile.layout.packed_ops import previous_tokens

    shifted = [n.name for n in packed.graph.nodes if n.target is previous_tokens and shapes.get(n.name, ())[-1:] == (VOCAB,)]
    assert not shifted, shifted

def test_gather_previous_matches_shift_then_gather():
    """gather_previous == previous_tokens(x).gather(-1, index), values and gradients, on random inputs."""
    from dualkv_compile.layout.packed_ops import gather_previous, previous_tokens

    g = torch.Generator().manual_seed(0)
    T, V, K = 13, 11, 2
    prev = torch.randint(0, T, (T,), generator=g)  # a shared token is the predecessor of several tokens
    prev[3:6] = 2
    index = torch.randint(0, V, (1, T, K), generator=g)
    x = torch.randn(1, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, T, K, generator=g, dtype=torch.float64)
    want = previous_tokens(x, prev, 1).gather(-1, index)
    (grad_want,) = torch.autograd.grad((want * w).sum(), x)
    got = gather_previous(x, prev, index)
    (grad_got,) = torch.autograd.grad((got * w).sum(), x)
    assert torch.equal(got, want)
    assert torch.allclose(grad_got, grad_want, rtol=0, atol=1e-12)

class TestLossGraph(expecttest.TestCase):
    def test_loss_graph_tail_after_rewrite(self):
        """The loss part: the lm_head, log_softmax and next-token gather fused into one chunked op on the
        packed stream, then one unpack of [B, S-1] next-token values."""
        model = hf_model("qwen3", "sdpa", layers=1)
        batch = make_batch(GROUPS)
        packed, _ = packed_loss_graph(grpo_token_mean, model, batch)
        # Structure, not the names a transformers release generates.
        (
            FileCheck()
            .check_count("torch.ops.dualkv.linear_log_prob.default(", 1, exactly=True)
            .check("unpack_tokens")
            .check("torch.exp")
            .check("torch.minimum")
            .check_not("log_softmax")
            .check_not("torch._C._nn.linear")
            .run(packed.code.split("linear_log_prob = ", 1)[1])
        )
        self.assertNotIn("log_softmax", packed.code)
        fused = packed.graph.find_nodes(op="call_function", target=torch.ops.dualkv.linear_log_prob.default)
        self.assertEqual(len(fused), 1)
        self.assertEqual((fused[0].kwargs["scale"], fused[0].kwargs["divide"]), (0.7, True))  # logits / temperature
        unpacks = packed.graph.find_nodes(op="call_function", target=unpack_tokens)
        self.assertEqual(len(unpacks), 1, "only the [B, S-1] token log-probs leave the packed stream")
        self.assertEqual(unpacks[0].args[6:8], (1, False), "next-token values: shift 1")
        source = unpacks[0].args[0]
        while source.op != "call_function" or source.target is not torch.ops.dualkv.linear_log_prob.default:
            source = source.args[0]  # getitem / unsqueeze / squeeze back to the fused op


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda b: b.update(attention_mask=b["attention_mask"][:-1]), r"attention_mask must have the shape of input_ids"),
        (lambda b: b.update(attention_mask=b["attention_mask"][:, None]), r"attention_mask must .* got \[\d+, 1, \d+\]"),
        (lambda b: b.update(input_ids=b["input_ids"][None]), r"input_ids must be a 2-D tensor"),
    ],
    ids=["mask_row_short", "mask_3d", "ids_3d"],
)
def test_bad_token_inputs_are_named_at_the_call(change, match):
    """Issue 35, defect 4: a mask of the wrong shape failed deep inside Dynamo or the model without naming it."""
    from tests.helpers import GROUPS, grpo_token_mean, hf_model, make_batch

    batch = make_batch(GROUPS)
    change(batch)
    with pytest.raises(ValueError, match=match):
        dualkv_compile.policy_loss(grpo_token_mean, inner="aot_eager")(hf_model("qwen3", "sdpa"), batch)


def test_the_original_programs_error_says_why_it_ran():
    """torch.compile(model): a mask with a row too few runs the original program (the layout names the mask), whose
    IndexError now carries that reason as a note."""
    import functools

    from dualkv_compile.backend import dualkv_backend
    from tests.helpers import grpo_batch, hf_model

    model = hf_model("qwen3", "sdpa")
    ids, mask, _ = grpo_batch([(5, [3, 4, 2])], 101)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    with pytest.raises(IndexError) as info:
        compiled(input_ids=ids, attention_mask=mask[:-1])
    assert any("attention_mask must have shape [B, S] = [3, 12], got [2, 12]" in n for n in info.value.__notes__)
