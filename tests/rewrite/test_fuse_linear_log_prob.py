"""The fusion of lm_head -> log_softmax -> next-token gather (``rewrite.fuse_linear_log_prob``).

What it matches and what it leaves alone, on small hand-written graphs
(values and gradients against the unfused graph), an entropy of the same
log-probs in each spelling included; on a tiny Qwen3's packed loss graphs
(with an entropy bonus, and veRL's ``entropy_from_logits``), that no
vocabulary-sized value is left; through ``@policy_loss`` and the backend,
parity with the eager duplicated batch, and ``chunked_log_probs=False``
keeping the unfused graph.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import dualkv_compile
from dualkv_compile.backend import DualKVConfig, dualkv_backend
from dualkv_compile.rewrite.fuse_linear_log_prob import fuse_linear_log_prob
from dualkv_compile.layout.packed_ops import gather_previous

from tests.helpers import hf_model, rel
from tests.helpers import GROUPS, VOCAB, packed_loss_graph, assert_loss_and_grads_match, clipped_objective, grpo_token_mean, make_batch, token_logp_and_entropy, with_entropy_and_kl
from tests.helpers import entropy_from_logits, with_verl_entropy

T, H, V = 10, 6, 23
FUSED_OP = torch.ops.dualkv.linear_log_prob.default
ENTROPY_OP = torch.ops.dualkv.linear_log_prob_entropy.default


def _trace(fn) -> fx.GraphModule:
    """``fn`` as an FX graph with ``gather_previous`` kept as a call (as ``pack_graph`` emits it), and ``F.log_softmax``."""
    tracer = fx.Tracer(autowrap_functions=(gather_previous, F.log_softmax, F.softmax))
    return fx.GraphModule(torch.nn.Module(), tracer.trace(fn))


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(1, T, H, generator=g).to(dtype).requires_grad_()
    w = torch.randn(V, H, generator=g).to(dtype).requires_grad_()
    prev = torch.arange(T) - 1
    prev[0], prev[5:8] = 0, 4  # the first token reads itself; a shared token read by three
    ids = torch.randint(0, V, (1, T, 1), generator=g)
    return h, w, prev, ids


def _run(gm, h, w, prev, ids, *extra):
    out = gm(h, w, prev, ids, *extra)
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)
    return (out, *torch.autograd.grad((out.double() * weights).sum(), (h, w)))


def _fused_count(gm, op=FUSED_OP):
    return sum(1 for n in gm.graph.nodes if n.target is op)


# Graphs the pass fuses: each placement of the scalar op around the cast, each spelling.
FUSED = {
    "div_then_float": lambda h, w, prev, ids: gather_previous(
        torch.log_softmax((torch._C._nn.linear(h, w, None)[:, :] / 0.7).float(), dim=-1), prev, ids),
    "float_then_mul_method": lambda h, w, prev, ids: gather_previous(
        (F.linear(h, w).float() * 1.5).log_softmax(-1), prev, ids),
    "functional_dim2_number_times": lambda h, w, prev, ids: gather_previous(
        F.log_softmax(0.5 * F.linear(h, w).to(torch.float32), dim=2), prev, ids),
    "div_method_then_float_method": lambda h, w, prev, ids: gather_previous(
        F.linear(h, w).div(2.0).float().log_softmax(dim=-1), prev, ids),
    "no_scale_no_cast": lambda h, w, prev, ids: gather_previous(torch.log_softmax(F.linear(h, w), -1), prev, ids),
}


@pytest.mark.parametrize("name", list(FUSED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_matches_unfused(name, dtype):
    gm = _trace(FUSED[name])
    unfused = copy.deepcopy(gm)
    assert fuse_linear_log_prob(gm, chunk_bytes=3 * V * 4).count == 1
    assert _fused_count(gm) == 1
    left = {n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")}
    assert not left & {torch._C._nn.linear, torch.log_softmax, F.log_softmax, "log_softmax", gather_previous}, left
    args = _inputs(dtype)
    got, want = _run(gm, *args), _run(unfused, *args)
    assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape
    # bf16: the op is compared with the same bf16 graph; the log-softmax and gradients round differently.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for what, a, b in zip(("value", "d_hidden", "d_weight"), got, want):
        assert rel(a.double(), b.double()) <= tol, (what, rel(a.double(), b.double()))


def _two_users_of_logits(h, w, prev, ids):
    logits = F.linear(h, w)
    return gather_previous(torch.log_softmax(logits.float(), dim=-1), prev, ids).squeeze(-1) + logits.mean(-1)


def _entropy_and_kl(h, w, prev, ids, b):
    """The entropy beside a KL over the vocabulary: a third reader of the log-probs."""
    logp = torch.log_softmax(F.linear(h, w).float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    ref = torch.log_softmax(b, -1)
    kl = (ref.exp() * (ref - logp)).sum(-1)  # KL(ref || policy) over the vocabulary
    return gather_previous(logp, prev, ids).squeeze(-1) + entropy + kl


# Graphs the pass must leave unchanged, and the reason it logs.
UNFUSED = {
    "bias": (lambda h, w, prev, ids, b: gather_previous(torch.log_softmax(F.linear(h, w, b), -1), prev, ids), "bias"),
    "two_scalar_ops": (
        lambda h, w, prev, ids, b: gather_previous(torch.log_softmax((F.linear(h, w) / 0.7 * 2.0).float(), -1), prev, ids),
        "second multiply/divide"),
    "two_casts": (
        lambda h, w, prev, ids, b: gather_previous(torch.log_softmax(F.linear(h, w).float().float(), -1), prev, ids),
        "second cast"),
    "softcap": (
        lambda h, w, prev, ids, b: gather_previous(torch.log_softmax(torch.tanh(F.linear(h, w) / 30.0) * 30.0, -1), prev, ids),
        "tanh"),
    "tensor_temperature": (
        lambda h, w, prev, ids, b: gather_previous(torch.log_softmax(F.linear(h, w) / b.sum(), -1), prev, ids),
        "not a finite nonzero Python number"),
    "log_softmax_dtype": (
        lambda h, w, prev, ids, b: gather_previous(torch.log_softmax(F.linear(h, w), -1, dtype=torch.float32), prev, ids),
        "further arguments"),
    "log_softmax_dim1": (lambda h, w, prev, ids, b: gather_previous(torch.log_softmax(F.linear(h, w), 1), prev, ids), "dim 1"),
    "logits_read_twice": (lambda h, w, prev, ids, b: _two_users_of_logits(h, w, prev, ids), "has 2 users"),
    "entropy_beside_kl": (_entropy_and_kl, "read the log-probs too"),
    "entropy_as_a_mean": (
        lambda h, w, prev, ids, b: _with_entropy(lambda lp: -(lp.exp() * lp).mean(-1))(h, w, prev, ids),
        "not summed over the vocabulary"),
    "entropy_keepdim": (
        lambda h, w, prev, ids, b: _with_entropy(lambda lp: -(lp.exp() * lp).sum(-1, keepdim=True).squeeze(-1))(h, w, prev, ids),
        "not summed over the vocabulary"),
}


@pytest.mark.parametrize("name", list(UNFUSED))
def test_unfused_graph_unchanged(name, caplog):
    fn, reason = UNFUSED[name]
    gm = _trace(fn)
    code = gm.code
    with caplog.at_level(logging.DEBUG, logger="dualkv_compile"):
        assert fuse_linear_log_prob(gm).count == 0
    assert gm.code == code
    assert any("left unfused" in r.getMessage() and reason in r.getMessage() for r in caplog.records), caplog.text
    args = _inputs()
    gm(*args, torch.randn(V))  # still runs


def _with_entropy(entropy_of, ids_after=False):
    """Log-probs at temperature 0.7 after ``.float()``: their next-token gather and ``entropy_of(logp)``, as one
    output (both parts weighted in ``_run``'s loss)."""

    def fn(h, w, prev, ids):
        logp = torch.log_softmax((F.linear(h, w) / 0.7).float(), dim=-1)
        entropy = entropy_of(logp)
        if ids_after:
            ids = ids.clone()  # the next-token ids computed after the entropy
        return torch.cat([gather_previous(logp, prev, ids).reshape(-1), 0.3 * entropy.reshape(-1)])

    return fn


def _verl(h, w, prev, ids):
    logits = (F.linear(h, w) / 0.7).float()
    logp = torch.log_softmax(logits, dim=-1)
    return torch.cat([gather_previous(logp, prev, ids).reshape(-1), 0.3 * entropy_from_logits(logits).reshape(-1)])


def _entropy_alone(h, w, prev, ids):
    logp = torch.log_softmax(F.linear(h, w).float() * 1.5, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _verl_alone(h, w, prev, ids):
    return entropy_from_logits(F.linear(h, w).float())


# Graphs with an entropy the pass fuses (with the gather, or alone): each spelling, each place of the negation.
FUSED_ENTROPY = {
    "neg_after_sum": _with_entropy(lambda lp: -(lp.exp() * lp).sum(-1)),
    "torch_functions": _with_entropy(lambda lp: torch.neg(torch.sum(torch.exp(lp) * lp, dim=-1))),
    "neg_on_p": _with_entropy(lambda lp: (-lp.exp() * lp).sum(dim=-1)),
    "neg_on_p_swapped": _with_entropy(lambda lp: (lp * -torch.exp(lp)).sum(-1)),
    "neg_on_logp": _with_entropy(lambda lp: (lp.exp() * -lp).sum(-1)),
    "neg_on_product": _with_entropy(lambda lp: (-(lp.exp() * lp)).sum(-1)),
    "no_neg": _with_entropy(lambda lp: (lp.exp() * lp).sum(-1)),  # minus the entropy
    "ids_after_entropy": _with_entropy(lambda lp: -(lp.exp() * lp).sum(-1), ids_after=True),
    "verl": _verl,
    "entropy_alone": _entropy_alone,
    "verl_alone": _verl_alone,
}


@pytest.mark.parametrize("name", list(FUSED_ENTROPY))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_entropy_fused_matches_unfused(name, dtype):
    """Values and gradients equal the unfused graph's; the entropy of rows no gather reads (5, 6, 9) included."""
    gm = _trace(FUSED_ENTROPY[name])
    unfused = copy.deepcopy(gm)
    fused = fuse_linear_log_prob(gm, chunk_bytes=3 * V * 4)
    assert (fused.count, fused.entropy) == (1, 1)
    assert _fused_count(gm, ENTROPY_OP) == 1 and _fused_count(gm) == 0
    left = {getattr(n.target, "__name__", n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")}
    gone = {"linear", "log_softmax", "softmax", "logsumexp", "exp", "gather_previous", "sum"}
    assert not left & gone, left & gone
    args = _inputs(dtype)
    got, want = _run(gm, *args), _run(unfused, *args)
    assert got[0].dtype == want[0].dtype == torch.float32 and got[0].shape == want[0].shape
    # bf16: the same bf16 graph; the log-softmax and gradients round differently.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for what, a, b in zip(("value", "d_hidden", "d_weight"), got, want):
        assert rel(a.double(), b.double()) <= tol, (what, rel(a.double(), b.double()))


def test_entropy_needs_the_graph_dtype(caplog):
    """Without ``.float()`` the graph's entropy has the logits' dtype: fused for float32 logits, not for bf16 (the op
    computes it in float32), and not when no example value tells which."""

    def entropy_no_cast(h, w, prev, ids):
        logp = torch.log_softmax(F.linear(h, w), -1)
        return torch.cat([gather_previous(logp, prev, ids).reshape(-1), -(logp.exp() * logp).sum(-1).reshape(-1)])

    for example, reason in ((None, "dtype is unknown"), (torch.bfloat16, "in torch.bfloat16")):
        gm = _trace(entropy_no_cast)
        code = gm.code
        inputs = None if example is None else [t.to(example) if t.is_floating_point() else t for t in _inputs()]
        with caplog.at_level(logging.DEBUG, logger="dualkv_compile"):
            assert fuse_linear_log_prob(gm, example_inputs=inputs).count == 0
        assert reason in caplog.text and gm.code == code
    gm = _trace(entropy_no_cast)
    unfused = copy.deepcopy(gm)
    assert fuse_linear_log_prob(gm, chunk_bytes=3 * V * 4, example_inputs=_inputs()).entropy == 1
    got, want = _run(gm, *_inputs()), _run(unfused, *_inputs())
    for a, b in zip(got, want):
        assert rel(a.double(), b.double()) <= 1e-5


def test_entropy_fusion_off_keeps_the_graph(caplog):
    """``entropy=False`` (the backend under sequence parallelism): a gather with an entropy is left as it was."""
    gm = _trace(FUSED_ENTROPY["neg_after_sum"])
    code = gm.code
    with caplog.at_level(logging.DEBUG, logger="dualkv_compile"):
        assert fuse_linear_log_prob(gm, entropy=False).count == 0
    assert "entropy fusion is off" in caplog.text and gm.code == code
    gm = _trace(_entropy_alone)
    assert fuse_linear_log_prob(gm, entropy=False).count == 0 and not _fused_count(gm, ENTROPY_OP)


def test_entropy_read_before_the_next_token_ids_left_unfused(caplog):
    def fn(h, w, prev, ids):
        logp = torch.log_softmax(F.linear(h, w).float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        ids = ids + (entropy.sum() * 0).long()  # the ids read the entropy
        return gather_previous(logp, prev, ids)

    gm = _trace(fn)
    code = gm.code
    with caplog.at_level(logging.DEBUG, logger="dualkv_compile"):
        assert fuse_linear_log_prob(gm).count == 0
    assert "is read before the next-token ids" in caplog.text and gm.code == code


def _lifted_temperature(h, w, prev, ids, temperature):
    return gather_previous(torch.log_softmax(F.linear(h, w).float() / temperature.item(), -1), prev, ids)


def test_scale_read_from_an_input_is_baked_in_and_checked(caplog):
    """``dynamic=True`` lifts a float temperature as a 0-dim input read by ``.item()``: fused with the example's value."""
    gm = _trace(_lifted_temperature)
    temperature = torch.tensor(0.7, dtype=torch.float64)
    placeholder = list(gm.graph.find_nodes(op="placeholder"))[-1]
    placeholder.meta["example_value"] = temperature  # as Dynamo records it
    code, unfused = gm.code, copy.deepcopy(gm)
    with caplog.at_level(logging.DEBUG, logger="dualkv_compile"):
        assert fuse_linear_log_prob(copy.deepcopy(gm)).count == 0  # nothing to resolve it by
    assert "no example input resolves it" in caplog.text and gm.code == code
    args = _inputs()
    fused = fuse_linear_log_prob(gm, example_inputs=[*args, temperature])
    assert fused.count == 1 and _fused_count(gm) == 1
    ((index, value, what),) = fused.scalar_checks
    assert (index, value) == (4, 0.7) and "temperature" in what
    assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "item"]
    got, want = _run(gm, *args, temperature), _run(unfused, *args, temperature)
    for a, b in zip(got, want):
        assert rel(a.double(), b.double()) <= 1e-5


def test_autocast_left_unfused(caplog):
    gm = _trace(FUSED["div_then_float"])
    with caplog.at_level(logging.DEBUG, logger="dualkv_compile"), torch.autocast("cpu", dtype=torch.bfloat16):
        assert fuse_linear_log_prob(gm).count == 0
    assert "autocast" in caplog.text


@pytest.mark.parametrize("loss_fn, entropy", [(grpo_token_mean, 0), (with_entropy_and_kl, 1), (with_verl_entropy, 1)])
def test_packed_loss_graph_has_no_vocab_sized_value(loss_fn, entropy):
    """After the fusion the packed graph of a GRPO loss holds no [.., T, V] value: no logits, log-probs or their copies,
    with an entropy bonus (read from the log-probs, or veRL's from the logits) too."""
    model = hf_model("qwen3", "sdpa", layers=1)
    packed, layout = packed_loss_graph(loss_fn, model, make_batch(GROUPS))
    assert _fused_count(packed, ENTROPY_OP if entropy else FUSED_OP) == 1
    assert _fused_count(packed, FUSED_OP if entropy else ENTROPY_OP) == 0
    placeholders = {n.name for n in packed.graph.find_nodes(op="placeholder")}  # the lm_head and embedding weights

    def vocab_sized(gm):
        shapes = {
            n.name: tuple(n.meta["tensor_meta"].shape)
            for n in gm.graph.nodes
            if isinstance(n.meta.get("tensor_meta"), torch.fx.passes.shape_prop.TensorMetadata)
        }
        return {k: v for k, v in shapes.items() if len(v) >= 2 and v[-1] == VOCAB and k not in placeholders}

    assert not vocab_sized(packed), vocab_sized(packed)
    unfused, _ = packed_loss_graph(loss_fn, model, make_batch(GROUPS), chunked_log_probs=False)
    assert vocab_sized(unfused), "the unfused packed graph builds the [1, T, V] logits"
    # Only the entropy's own value changed hands: a [1, T] float32, as the graph had it.
    if entropy:
        (ent,) = [n for n in packed.graph.nodes if n.op == "call_method" and n.target == "unsqueeze" and n.args[0].name.startswith("entropy")]
        meta = ent.meta["tensor_meta"]
        assert tuple(meta.shape) == (1, layout.num_tokens) and meta.dtype == torch.float32


def _compile_capturing(loss_fn, **options):
    """``loss_fn`` compiled with the dualkv backend; also returns the runners it made (their ``packed_gm``)."""
    runners = []

    def backend(gm, example_inputs):
        runner = dualkv_backend(gm, example_inputs, options={"inner": "aot_eager", "attention_backend": "reference", **options})
        runners.append(runner)
        return runner

    torch._dynamo.reset()
    return torch.compile(loss_fn, backend=backend, dynamic=False), runners


@pytest.mark.parametrize("loss_fn, entropy", [(grpo_token_mean, 0), (with_entropy_and_kl, 1)], ids=["grpo", "with_entropy"])
def test_policy_loss_parity(loss_fn, entropy):
    """Loss and every parameter gradient equal the eager duplicated batch's, with the op in chunks of 8 tokens."""
    model = hf_model("qwen3", "sdpa", layers=1)
    ref_model = copy.deepcopy(model)
    compiled, runners = _compile_capturing(loss_fn, log_prob_chunk_bytes=8 * VOCAB * 4)
    batch = make_batch(GROUPS, seed=3)
    assert_loss_and_grads_match(compiled(model, batch), loss_fn(ref_model, batch), model, ref_model)
    (runner,) = runners
    report = runner.report
    assert report.packed_calls == 1 and report.fused_log_probs == 1 and report.fused_entropy == entropy, str(report)
    assert _fused_count(runner.packed_gm, ENTROPY_OP if entropy else FUSED_OP) == 1
    assert ("entropy fused into the chunked log-probs (1)" in str(report)) == bool(entropy)


def _grpo_at(model, batch, temperature):
    logp, _ = token_logp_and_entropy(model, batch, temperature)
    m = batch["response_mask"][:, 1:].float()
    return (clipped_objective(batch, logp) * m).sum() / m.sum()


def test_temperature_argument_under_dynamic_true():
    """A float argument becomes a graph input under ``dynamic=True``: still fused (its value baked in and checked
    per call, see test_scale_read_from_an_input_is_baked_in_and_checked), exact."""
    torch._dynamo.reset()
    model = hf_model("qwen3", "sdpa", layers=1)
    ref_model = copy.deepcopy(model)
    compiled = dualkv_compile.policy_loss(_grpo_at, inner="aot_eager", dynamic=True)
    start = len(dualkv_compile.reports())
    batch = make_batch(GROUPS, seed=4)
    assert_loss_and_grads_match(compiled(model, batch, 0.7), _grpo_at(ref_model, batch, 0.7), model, ref_model)
    (report,) = dualkv_compile.reports()[start:]
    assert report.fused_log_probs == 1 and report.packed_calls == 1, str(report)


def test_chunked_log_probs_false_keeps_the_unfused_graph():
    model = hf_model("qwen3", "sdpa", layers=1)
    batch = make_batch(GROUPS)
    compiled, runners = _compile_capturing(grpo_token_mean, chunked_log_probs=False)
    compiled(model, batch)
    (runner,) = runners
    assert runner.report.fused_log_probs == 0 and runner.report.packed_calls == 1
    unfused, _ = packed_loss_graph(grpo_token_mean, model, batch, chunked_log_probs=False)
    assert runner.packed_gm.code == unfused.code
    assert any(n.target is gather_previous for n in runner.packed_gm.graph.nodes)


@pytest.mark.parametrize(
    "options, match",
    [({"chunked_log_probs": "yes"}, "chunked_log_probs"), ({"log_prob_chunk_bytes": 0}, "log_prob_chunk_bytes"),
     ({"log_prob_chunk_bytes": 1.5}, "log_prob_chunk_bytes")],
)
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        DualKVConfig.from_options(options)
    with pytest.raises(ValueError, match=match):
        dualkv_compile.policy_loss(**options)
