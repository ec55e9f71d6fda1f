"""@policy_loss: parity with the undecorated loss, and no [B, S, V] tensor in the rewritten graph."""

from __future__ import annotations

import copy

import expecttest
import pytest
import torch
from torch.fx.passes.shape_prop import ShapeProp
from torch.testing import FileCheck

import dualkv_compile
from dualkv_compile.passes.packed_inputs import PackedInputs
from dualkv_compile.passes.fuse_linear_log_prob import fuse_linear_log_prob
from dualkv_compile.passes.pack_graph import pack_graph
from dualkv_compile.passes.packed_ops import unpack_tokens
from dualkv_compile.passes.token_axes import analyze_token_axes
from dualkv_compile.passes.token_inputs import find_token_inputs

from .test_backend import _hf_model, _rel, grpo_batch

VOCAB = 101


def make_batch(groups, seed=0, left_pad=2):
    ids, mask, _ = grpo_batch(groups, VOCAB, left_pad=left_pad, seed=seed)
    B, S = ids.shape
    g = torch.Generator().manual_seed(seed + 100)
    response = torch.zeros_like(mask)
    b = 0
    for P, rs in groups:
        for r in rs:
            cols = mask[b].nonzero().flatten()
            response[b, cols[P:]] = 1  # the row's tokens after its prompt
            b += 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "response_mask": response,
        "old_logp": torch.randn(B, S - 1, generator=g) * 0.1 - 4.6,
        "ref_logp": torch.randn(B, S - 1, generator=g) * 0.1 - 4.6,
        "advantages": torch.randn(B, generator=g),
    }


def token_logp_and_entropy(model, batch, temperature=0.7):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, :-1] / temperature
    logp = torch.log_softmax(logits.float(), dim=-1)
    token_logp = logp.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


def clipped_objective(batch, token_logp, eps=0.2):
    ratio = torch.exp(token_logp - batch["old_logp"])
    adv = batch["advantages"][:, None]
    return -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)


def grpo_token_mean(model, batch):
    logp, _ = token_logp_and_entropy(model, batch)
    m = batch["response_mask"][:, 1:].float()
    return (clipped_objective(batch, logp) * m).sum() / m.sum()


def dr_grpo_seq_mean_token_sum(model, batch):
    logp, _ = token_logp_and_entropy(model, batch)
    m = batch["response_mask"][:, 1:].float()
    return (clipped_objective(batch, logp) * m).sum(-1).mean()


def seq_mean_token_mean(model, batch):
    logp, _ = token_logp_and_entropy(model, batch)
    m = batch["response_mask"][:, 1:].float()
    return ((clipped_objective(batch, logp) * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()


def with_entropy_and_kl(model, batch, beta=0.04, ent_coef=0.01):
    logp, entropy = token_logp_and_entropy(model, batch)
    m = batch["response_mask"][:, 1:].float()
    delta = batch["ref_logp"] - logp
    kl = torch.exp(delta) - delta - 1  # the k3 estimator against reference log-probs
    per_token = clipped_objective(batch, logp) + beta * kl - ent_coef * entropy
    return (per_token * m).sum() / m.sum()


LOSSES = [grpo_token_mean, dr_grpo_seq_mean_token_sum, seq_mean_token_mean, with_entropy_and_kl]
GROUPS = [(6, [3, 4, 1, 5]), (4, [2, 5]), (7, [3])]


def assert_loss_and_grads_match(loss, ref, model, ref_model, tol=1e-5):
    """``loss`` equals ``ref`` and, after both backward passes, every parameter gradient of ``model`` equals ``ref_model``'s."""
    assert _rel(loss.detach(), ref.detach()) <= tol
    loss.backward()
    ref.backward()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert _rel(p.grad, q.grad) <= tol, name


@pytest.mark.parametrize("loss_fn", LOSSES, ids=lambda f: f.__name__)
def test_parity_with_undecorated_loss(loss_fn):
    torch._dynamo.reset()
    model = _hf_model("qwen3", "sdpa", layers=2)
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
    # The lm_head -> log_softmax -> gather is fused (chunked_log_probs) unless the entropy reads the log-probs whole.
    fused = 0 if loss_fn is with_entropy_and_kl else 1
    assert all(r.fused_log_probs == fused for r in new), [str(r) for r in new]


def test_decorator_with_options_and_bad_option():
    @dualkv_compile.policy_loss(group_size=4, min_rho=1.0, inner="aot_eager")
    def loss(model, batch):
        return grpo_token_mean(model, batch)

    torch._dynamo.reset()
    model = _hf_model("qwen3", "sdpa", layers=1)
    batch = make_batch([(6, [3, 4, 1, 5]), (4, [2, 5, 2, 2])])
    assert torch.isfinite(loss(model, batch))
    assert dualkv_compile.reports()[-1].last_stats.num_groups == 2
    with pytest.raises(ValueError, match="unknown dualkv option"):
        dualkv_compile.policy_loss(min_rh=2)


def _packed_loss_graph(loss_fn, model, batch, chunked_log_probs=True):
    """The packed graph the backend builds for ``loss_fn`` (attention backend "reference"), its shapes propagated."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(loss_fn, backend=capture, dynamic=False)(model, batch)
    gm, example_inputs = graphs[0]
    axes = analyze_token_axes(gm, find_token_inputs(gm.graph))
    packed = pack_graph(gm, axes, "reference")
    if chunked_log_probs:
        fuse_linear_log_prob(packed)
    layout = dualkv_compile.detect(batch["input_ids"], batch["attention_mask"])
    ShapeProp(packed).propagate(*example_inputs, *PackedInputs.of(layout))
    return packed, layout


@pytest.mark.parametrize("loss_fn", [grpo_token_mean, with_entropy_and_kl], ids=lambda f: f.__name__)
def test_no_batch_by_sequence_by_vocab_tensor(loss_fn):
    model = _hf_model("qwen3", "sdpa", layers=1)
    batch = make_batch(GROUPS)
    B, S = batch["input_ids"].shape
    packed, layout = _packed_loss_graph(loss_fn, model, batch, chunked_log_probs=False)  # pack_graph's own output
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
    from dualkv_compile.passes.packed_ops import previous_tokens

    shifted = [n.name for n in packed.graph.nodes if n.target is previous_tokens and shapes.get(n.name, ())[-1:] == (VOCAB,)]
    assert not shifted, shifted


def test_gather_previous_matches_shift_then_gather():
    """gather_previous == previous_tokens(x).gather(-1, index), values and gradients, on random inputs."""
    from dualkv_compile.passes.packed_ops import gather_previous, previous_tokens

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
        model = _hf_model("qwen3", "sdpa", layers=1)
        batch = make_batch(GROUPS)
        packed, _ = _packed_loss_graph(grpo_token_mean, model, batch)
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
