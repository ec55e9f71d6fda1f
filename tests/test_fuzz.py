"""Random batches through the backend and ``@policy_loss``, float64, against the unmodified model.

Each example draws a model (tiny Llama or Qwen3, sdpa or eager), a path (``torch.compile(model,
backend="dualkv")`` comparing logits at valid positions and every parameter gradient, or a GRPO
loss under ``@policy_loss`` comparing loss and gradients, with a random chain of in-place statements
on the logits), and a batch: 1-3 groups of 1-4 rows, prompts of 0-5 tokens, responses of 0-4
tokens (at least one token per row), responses that share their first tokens, identical rows, B = 1, left and right padding.
Compiled functions are cached per (model, path, statements) with dynamic shapes, so the examples
exercise the no-recompile path too. ``make test`` runs 14 examples (derandomized: the same 14 each run);
``make test-slow`` 1,000.

Left padding is drawn for sdpa only: Hugging Face's eager attention turns a fully masked float64
row into NaN that reaches valid positions through ``0 * NaN`` (docs/supported.md).
Tolerance: HF computes norms and rotary tables in float32 even for a float64 model, so packed and
padded shapes round differently at about 1e-7; 1e-6 relative.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dualkv_compile
from dualkv_compile.backend import dualkv_backend

from tests.helpers import hf_model, rel

transformers = pytest.importorskip("transformers")

VOCAB = 101
TOL = 1e-6
# Two compiled losses per model (compiles dominate the run): none, and every statement, with coefficients
# drawn per example (a coefficient of 1 or 0 makes a statement the identity, the others change the loss).
STATEMENTS = {"none": (), "in-place": ("div_", "mul_", "sub_", "copy_")}

_models: dict = {}
_compiled: dict = {}
_ran = {"examples": 0, "packed": 0}  # examples run, and those with at least one packed call


def _model(family, impl):
    if (family, impl) not in _models:
        _models[(family, impl)] = hf_model(family, impl).double()
    return _models[(family, impl)]


def _apply(logits, statements, coef):
    for s in statements:
        if s == "div_":
            logits.div_(coef[0])
        elif s == "mul_":
            logits.mul_(coef[1])
        elif s == "sub_":
            logits.sub_(logits.detach().abs() * coef[2])
        elif s == "copy_":
            logits.copy_(logits * coef[1])


def _grpo_loss(model, batch, statements=()):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    _apply(logits, statements, batch["coef"])
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    ratio = torch.exp(logp - batch["old_logp"])
    adv = batch["advantages"][:, None]
    pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    m = batch["response_mask"][:, 1:]
    return (pg * m).sum() / m.sum().clamp(min=1)


@st.composite
def batches(draw, left_pad_allowed):
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        P = draw(st.integers(0, 5))
        identical = draw(st.booleans())
        n = draw(st.integers(1, 4))
        low = 1 if P == 0 else 0  # no row of padding alone: eager attention makes NaN of a fully masked row
        rs = [draw(st.integers(low, 4))] * n if identical else [draw(st.integers(low, 4)) for _ in range(n)]
        groups.append((P, rs, identical, draw(st.integers(0, 2))))
    left = draw(st.integers(0, 2)) if left_pad_allowed else 0
    right = draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    rows = [(P, r) for P, rs, _, _ in groups for r in rs]
    maxP = max(P for P, _ in rows)
    S = max(left + maxP + max(r for _, r in rows) + right, 2)
    B = len(rows)
    ids = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.long)
    response = torch.zeros(B, S, dtype=torch.float64)
    b = 0
    for P, rs, identical, shared in groups:
        prompt = torch.randint(1, VOCAB, (P,), generator=g)
        lead = torch.randint(1, VOCAB, (shared,), generator=g)
        same = torch.randint(1, VOCAB, (max(rs),), generator=g)
        lp = (left + maxP - P) if left_pad_allowed else 0
        for r in rs:
            resp = same[:r].clone() if identical else torch.randint(1, VOCAB, (r,), generator=g)
            k = min(r, shared)
            resp[:k] = lead[:k]
            ids[b, lp : lp + P], ids[b, lp + P : lp + P + r] = prompt, resp
            mask[b, lp : lp + P + r] = 1
            response[b, lp + P : lp + P + r] = 1
            b += 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "response_mask": response,
        "old_logp": torch.randn(B, S - 1, generator=g, dtype=torch.float64) * 0.1 - 4.6,
        "advantages": torch.randn(B, generator=g, dtype=torch.float64),
        "coef": torch.tensor(
            [draw(st.sampled_from([1.0, 0.7, 1.5])), draw(st.sampled_from([1.0, 1.3, 0.5])), draw(st.sampled_from([0.0, 0.25]))],
            dtype=torch.float64,
        ),
    }


def _grads(model):
    grads = {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_grads(got, want):
    # A gradient that is zero in exact arithmetic (q_proj's when every query sees one key) comes out as
    # float64 rounding noise on either side: compare each against the model's largest gradient at
    # float64 precision, as well as relative to itself.
    floor = 1e-12 * max((w.norm().item() for w in want.values() if w is not None), default=0.0)
    for name, w in want.items():
        g = got[name]
        if w is None or g is None:
            assert (w is None or w.abs().max() == 0) and (g is None or g.abs().max() == 0), name
        else:
            err = (g - w).norm().item()
            assert err <= TOL * w.norm().item() or err <= floor, (name, rel(g, w), err, floor)


def _check_backend(model, batch):
    key = ("backend", id(model))
    if key not in _compiled:
        _compiled[key] = torch.compile(
            model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager", "min_rho": 1.0}), dynamic=True
        )
    ids, mask = batch["input_ids"], batch["attention_mask"]
    out = _compiled[key](input_ids=ids, attention_mask=mask).logits
    ref = model(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    assert rel(out[valid], ref[valid]) <= TOL
    proj = torch.randn(out.shape[-1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    (out[valid] @ proj).sum().backward()
    got = _grads(model)
    (ref[valid] @ proj).sum().backward()
    _assert_grads(got, _grads(model))


def _check_policy_loss(model, batch, statements):
    key = ("loss", id(model), statements)
    if key not in _compiled:
        fn = functools.partial(_grpo_loss, statements=STATEMENTS[statements])
        _compiled[key] = dualkv_compile.policy_loss(fn, dynamic=True, inner="aot_eager", min_rho=1.0)
    got_loss = _compiled[key](model, batch)
    want_loss = _grpo_loss(model, batch, STATEMENTS[statements])
    assert abs(got_loss.item() - want_loss.item()) <= TOL * max(1.0, abs(want_loss.item())), (got_loss.item(), want_loss.item())
    got_loss.backward()
    got = _grads(model)
    want_loss.backward()
    _assert_grads(got, _grads(model))


def _packed_calls() -> int:
    return sum(r.packed_calls for r in dualkv_compile.reports())


def _example(data):
    before = _packed_calls()
    family = data.draw(st.sampled_from(["llama", "qwen3"]), label="family")
    impl = data.draw(st.sampled_from(["sdpa", "eager"]), label="impl")
    batch = data.draw(batches(left_pad_allowed=impl == "sdpa"), label="batch")
    model = _model(family, impl)
    if data.draw(st.booleans(), label="through @policy_loss"):
        _check_policy_loss(model, batch, data.draw(st.sampled_from(sorted(STATEMENTS)), label="statements"))
    else:
        _check_backend(model, batch)
    _ran["examples"] += 1
    _ran["packed"] += _packed_calls() > before


@pytest.fixture(scope="module", autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(cache_size_limit=64, accumulated_cache_size_limit=512):
        yield
    _compiled.clear()
    torch._dynamo.reset()


_SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=6, **_SETTINGS)  # `make test-slow` runs 1,000
@given(data=st.data())
def test_fuzz_exact(data, one_thread):
    _example(data)


@pytest.mark.slow
@settings(max_examples=1000, **_SETTINGS)
@given(data=st.data())
def test_fuzz_exact_1000(data, one_thread):
    _example(data)


def test_fuzz_packs_a_fair_share():
    """The fuzz above is not vacuous: a fair share of its examples ran packed (runs after it, in file order)."""
    assert _ran["examples"] >= 6
    assert _ran["packed"] >= _ran["examples"] // 4, _ran
