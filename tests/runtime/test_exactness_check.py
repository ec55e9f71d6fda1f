"""Option ``check_exact``: the original program run beside the packed one on chosen calls, outputs and gradients
compared; a packed program that differs raises ``ExactnessError`` naming what differs.

The packed programs that differ are made by wrapping the real packed graph's compiled function (the rewrite
itself is right): one changes an output's value, one keeps the values and halves a gradient.
"""

from __future__ import annotations

import functools

import pytest
import torch

import dualkv_compile
import dualkv_compile.runtime.runner as runner
from dualkv_compile.backend import dualkv_backend
from dualkv_compile.runtime.exactness_check import due

from tests.helpers import GROUPS, grpo_token_mean, hf_model, make_batch

pytestmark = pytest.mark.usefixtures("one_thread")


def _loss(check_exact):
    return dualkv_compile.policy_loss(grpo_token_mean, inner="aot_eager", check_exact=check_exact)


def _reports_since(before):
    return [r for r in dualkv_compile.reports()[before:] if r.rewritten]


def test_first_call_is_checked_and_reported():
    torch._dynamo.reset()
    model = hf_model("qwen3", "sdpa")
    batch = make_batch(GROUPS)
    before = len(dualkv_compile.reports())
    loss_fn = _loss("first")
    loss = loss_fn(model, batch)
    loss.backward()  # the check kept the graph: the caller's backward runs
    assert all(p.grad is not None for p in model.parameters())
    loss_fn(model, batch)  # the second call is not checked
    (report,) = _reports_since(before)
    assert report.packed_calls == 2 and len(report.exactness_checks) == 1, report.exactness_checks
    summary = report.exactness_checks[0]
    assert "parameter gradients" in summary and "against the original program" in summary, summary
    assert "checked exact on call 1" in str(report)


def _perturbed(monkeypatch, change):
    """The packed graph's compiled function, on either route (direct_compile, or nested_compile), made wrong."""
    for owner, name in ((runner, "nested_compile"), (runner.direct_compile, "DirectCompile")):
        real = getattr(owner, name)

        def wrapped(*args, real=real, **kwargs):
            fn = real(*args, **kwargs)
            return lambda *a: change(fn(*a))

        monkeypatch.setattr(owner, name, wrapped)


def test_a_wrong_value_raises_naming_the_output(monkeypatch):
    _perturbed(monkeypatch, lambda out: (out[0] * 1.01, *out[1:]))
    torch._dynamo.reset()
    with pytest.raises(dualkv_compile.ExactnessError, match=r"output 0 .* differs from the original program's by 1\.00e-02"):
        _loss("first")(hf_model("qwen3", "sdpa"), make_batch(GROUPS))


def test_a_wrong_gradient_raises_naming_the_input(monkeypatch):
    # Same values, half the gradient: only the gradient comparison sees it.
    _perturbed(monkeypatch, lambda out: (out[0].detach() + 0.5 * (out[0] - out[0].detach()), *out[1:]))
    torch._dynamo.reset()
    with pytest.raises(dualkv_compile.ExactnessError, match=r"the gradient of parameter \S+ .* differs .* by 5\.00e-01"):
        _loss("first")(hf_model("qwen3", "sdpa"), make_batch(GROUPS))


def test_off_by_default_and_every_nth_call():
    torch._dynamo.reset()
    model = hf_model("qwen3", "sdpa")
    batch = make_batch(GROUPS)
    before = len(dualkv_compile.reports())
    compiled = torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    with torch.no_grad():
        compiled(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    (report,) = _reports_since(before)
    assert report.packed_calls == 1 and not report.exactness_checks
    assert [due(3, k) for k in range(7)] == [True, False, False, True, False, False, True]
    assert [due("first", k) for k in range(3)] == [True, False, False] and not due(None, 0)


@pytest.mark.parametrize("bad", [0, -2, "always", 1.5, True])
def test_bad_setting_is_named(bad):
    with pytest.raises(ValueError, match="check_exact"):
        dualkv_compile.DualKVConfig.from_options({"check_exact": bad})


def test_moe_split_in_two_graphs_checks_clean():
    """Qwen3-MoE with router logits: the decoder graph, then the lm_head and loss graph that packs hidden states
    carried from it. That graph's gradient for the hidden states sits on the copies it keeps (exact once the
    decoder's unpack sums the copies), so only parameter gradients are compared: no false alarm (the first
    version compared every input's gradient and raised here), and the router logits [B * S, E] are compared
    at non-padding rows only."""
    from tests.test_sequence_parallel import forest_batch, grpo_loss, tiny_model

    torch._dynamo.reset()
    model = tiny_model("qwen3_moe")
    ids, mask, _ = forest_batch(seed=20)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    adv = torch.randn(ids.shape[0], generator=torch.Generator().manual_seed(3))
    before = len(dualkv_compile.reports())
    dualkv_compile.policy_loss(grpo_loss, inner="aot_eager", check_exact="first")(model, ids, mask, pos, adv).backward()
    checked = [r for r in _reports_since(before) if r.packed_calls]
    assert len(checked) >= 2 and all(len(r.exactness_checks) == 1 for r in checked), [str(r) for r in checked]
    assert any("parameter gradients" in r.exactness_checks[0] for r in checked)
