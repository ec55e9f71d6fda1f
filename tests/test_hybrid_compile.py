"""Hybrids' gated delta-rule (GDN) layers under torch.compile (issue 51, first bullet).

The torch bug: ``aten.softplus_backward``'s decomposition (``torch/_decomp/decompositions.py``, a ``torch.where``
led by ``self``), which fake tensors run, lays its result out like ``self``, where eager's TensorIterator lays it
out like ``grad_output``. A transposed gradient reaching it (transformers' GDN fallback transposes g to
``[B, H, T]``) makes AOTAutograd's backward graph hold a ``view`` that is valid for the fake strides only. Two
strict xfails pin it (they fail the suite when torch fixes it). No exact upstream report found; related:
pytorch/pytorch#120035 (this error from aot_eager, open, no repro), #100067 (a decomposition's view mismatch),
#196766 (view -> reshape in an aot_eager backward, open). The fix on our side: ``ops.recurrent``'s opaque
``dualkv::gated_delta_rule``, which ``integrations.hf_hybrids`` routes transformers' fallback to.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import dualkv_compile
from dualkv_compile.ops.recurrent import gated_delta_rule, gated_delta_rule_fwd
from tests.family_sweep import PACKED, REFUSED, batch_kwargs, run_family, tiny_model
from tests.helpers import capture

TORCH_BUG = ("torch bug: aten.softplus_backward's decomposition (run by fake tensors) lays its result out like self, "
             "eager like grad_output; AOTAutograd's backward graph then holds a view that fails eagerly")


def _softplus_backward(grad, x):
    return torch.ops.aten.softplus_backward(grad, x, 1.0, 20.0)


@pytest.mark.xfail(strict=True, reason=TORCH_BUG)
def test_softplus_backward_fake_strides_are_eager_strides():
    grad = torch.randn(2, 4, 3).transpose(1, 2)  # [2, 3, 4], strides (12, 1, 3)
    x = torch.randn(2, 3, 4)
    with FakeTensorMode() as mode:
        fake = _softplus_backward(mode.from_tensor(grad), mode.from_tensor(x)).stride()
    assert fake == _softplus_backward(grad, x).stride()  # eager (12, 1, 3), fake (12, 4, 1)


def _softplus_then_transpose(x, w, c):
    return (F.softplus(x @ w).transpose(1, 2).contiguous() * c).sum()


def _repro_args():
    torch.manual_seed(0)
    return torch.randn(2, 3, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True), torch.randn(2, 5, 3)


def test_the_repro_runs_eagerly():
    _softplus_then_transpose(*_repro_args()).backward()


@pytest.mark.xfail(strict=True, reason=TORCH_BUG, raises=RuntimeError)
def test_aot_eager_backward_of_softplus_then_transpose():
    """Eager runs it; under aot_eager the backward's ``view(softplus_backward, [6, 5])`` (the matmul's) raises
    "view size is not compatible with input tensor's size and stride"."""
    torch._dynamo.reset()
    torch.compile(_softplus_then_transpose, backend="aot_eager")(*_repro_args()).backward()


def _fallback():
    from transformers.models.qwen3_next import modeling_qwen3_next

    return modeling_qwen3_next.torch_chunk_gated_delta_rule.__wrapped__


IMPL = "transformers.models.qwen3_next.modeling_qwen3_next.torch_chunk_gated_delta_rule"


def _gdn_inputs(with_state: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    B, T, Hk, Hv, D = 2, 10, 2, 4, 8  # T not a multiple of the chunk (4): padding and three chunks; GQA 2 -> 4
    q, k = (torch.randn(B, T, Hk, D, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, Hv, D, generator=g, dtype=dtype)
    decay = -F.softplus(torch.randn(B, T, Hv, generator=g, dtype=dtype))
    beta = torch.rand(B, T, Hv, generator=g, dtype=dtype)
    state = torch.randn(B, Hv, D, D, generator=g, dtype=torch.float32) if with_state else None
    return [q, k, v, decay, beta], state


@pytest.mark.parametrize("with_state", [False, True], ids=["no_state", "initial_and_final_state"])
def test_op_is_the_fallback_and_its_autograd(with_state):
    fallback = _fallback()
    inputs, state = _gdn_inputs(with_state)
    results = []
    for run in ("fallback", "op"):
        xs = [x.clone().requires_grad_() for x in inputs]
        s0 = state.clone().requires_grad_() if with_state else None
        kw = dict(chunk_size=4, initial_state=s0, output_final_state=with_state)
        if run == "fallback":
            out, s1 = fallback(*xs, use_qk_l2norm_in_kernel=True, **kw)
        else:
            out, s1 = gated_delta_rule(*xs, impl=IMPL, use_qk_l2norm=True, **kw)
        loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() + (s1.square().sum() if with_state else 0)
        loss.backward()
        results.append([out, s1] + [x.grad for x in xs] + ([s0.grad] if with_state else []))
    assert results[1][1] is None if not with_state else results[1][1].is_contiguous()
    for a, b in zip(*results):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
            assert b.is_contiguous()


def test_op_fake_and_autograd_registrations():
    """torch.library.opcheck: schema, fake implementation (shapes, dtypes, strides), autograd, AOT dispatch."""
    inputs, _ = _gdn_inputs(False)
    inputs = [x.requires_grad_() for x in inputs]
    torch.library.opcheck(gated_delta_rule_fwd, (*inputs, None, 4, False, True, IMPL))


def test_hf_gdn_layer_compiles_as_one_op():
    """The polyfill puts one op per GDN layer in Dynamo's graph, none of the fallback's scan."""
    model = tiny_model("qwen3_next")
    kwargs, _ = batch_kwargs(model)
    targets = [str(n.target) for n in capture(model, **kwargs).graph.nodes if n.op == "call_function"]
    layers = model.config.layer_types.count("linear_attention")
    assert layers >= 1 and targets.count("dualkv.gated_delta_rule.default") == layers
    assert not any("solve_triangular" in t for t in targets)


# Packed: the forest takes every layer (Qwen3.5 once its rotary's setitems are out of place: normalize.functionalize).
EXPECTED = {"qwen3_next": PACKED, "olmo_hybrid": PACKED, "qwen3_5_text": PACKED, "qwen3_5_moe_text": PACKED}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_hybrid_compiles_under_dualkv_and_is_exact(family, one_thread):
    """Forward and backward under ``backend="dualkv"`` (inner aot_eager) against the eager model, as the family
    sweep compares them (logits and every gradient within 1e-5): packed on the forest, or refused, never inexact."""
    outcome = run_family(family)
    assert (outcome.outcome, family) == (EXPECTED[family], family), outcome.detail
