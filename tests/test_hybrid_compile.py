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
from dualkv_compile.analysis.recurrent_math import math_agrees
from dualkv_compile.analysis.recurrent_rules import GATED_DELTA_IMPLS, KDA_IMPLS, MAMBA1_IMPLS, MAMBA2_IMPLS
from dualkv_compile.ops.recurrent import gated_delta_rule, gated_delta_rule_fwd, mamba2_chunk_scan_fwd
from dualkv_compile.ops.recurrent import mamba2_chunk_scan as mamba2_op, mamba_selective_scan, mamba_selective_scan_fwd
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


def test_polyfills_route_to_the_op_unless_torch_export_is_tracing(monkeypatch):
    """torch 2.11's Dynamo folds ``torch.compiler.is_exporting()`` to True under every compile: the polyfill must
    read export's flag itself, or every compiled GDN call traces the fallback (issue 51, found on the H200)."""
    from dualkv_compile.integrations import hf_hybrids

    calls = []
    monkeypatch.setattr(hf_hybrids, "gated_delta_rule", lambda *a, **k: calls.append("op") or ("op", None))
    def fallback(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, **kwargs):
        calls.append("fallback")
        return "fallback", None

    polyfill = hf_hybrids.gdn_polyfill(fallback, IMPL)
    inputs, _ = _gdn_inputs(False)
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)  # what 2.11's Dynamo sees under compile
    assert polyfill(*inputs)[0] == "op"
    monkeypatch.setattr(torch.compiler, "_is_exporting_flag", True)  # torch.export tracing: as the wrapper
    assert polyfill(*inputs)[0] == "fallback"
    assert calls == ["op", "fallback"]


def test_registration_reads_a_module_namespace_not_its_lazy_getattr():
    """A transformers package is a lazy module: getattr of a name it lacks imports its submodules (and raised
    ModuleNotFoundError for a missing optional dependency, out of ``import dualkv_compile``) and returns a
    re-exported wrapper under the package's name, marking it looked at before its modeling module registers it."""
    import types

    from dualkv_compile.integrations import hf_hybrids

    class Lazy(types.ModuleType):
        def __getattr__(self, name):
            raise ModuleNotFoundError("No module named 'torchvision'")

    assert hf_hybrids.register_module("transformers.models.fake_lazy", Lazy("transformers.models.fake_lazy")) == 0


MAMBA2_IMPL = "transformers.models.mamba2.modeling_mamba2.mamba2_chunk_scan"


def _mamba2_inputs(with_d: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    B, T, H, P, G, N = 2, 10, 4, 3, 2, 4  # T not a multiple of the chunk (4); two heads per group
    x = torch.randn(B, T, H, P, generator=g, dtype=dtype)
    dt = torch.randn(B, T, H, generator=g, dtype=dtype)
    A = -torch.rand(H, generator=g) - 0.5
    Bm, Cm = (torch.randn(B, T, G, N, generator=g, dtype=dtype) for _ in range(2))
    D, bias = (torch.randn(H, generator=g) if with_d else None for _ in range(2))
    return [x, dt, A, Bm, Cm, D, bias]


@pytest.mark.parametrize("with_d", [True, False], ids=["D_and_dt_bias", "neither"])
def test_mamba2_op_is_the_fallback_and_its_autograd(with_d):
    from transformers.models.mamba2 import modeling_mamba2

    fallback = modeling_mamba2.mamba2_chunk_scan.__wrapped__
    results = []
    for run in ("fallback", "op"):
        xs = [t if t is None else t.clone().requires_grad_() for t in _mamba2_inputs(with_d)]
        x, dt, A, Bm, Cm, D, bias = xs
        kw = dict(D=D, dt_bias=bias, dt_softplus=True, dt_limit=(0.0, 2.0))
        out = (fallback(x, dt, A, Bm, Cm, 4, **kw) if run == "fallback"
               else mamba2_op(x, dt, A, Bm, Cm, impl=MAMBA2_IMPL, chunk_size=4, **kw))
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out] + [t.grad for t in xs if t is not None])
    for a, b in zip(*results):
        assert a.dtype == b.dtype
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_d", [True, False], ids=["D_and_dt_bias", "neither"])
def test_mamba2_op_registrations(with_d):
    """torch.library.opcheck: schema, fake implementation (shapes, dtypes, strides), autograd, AOT dispatch."""
    xs = [t if t is None else t.requires_grad_() for t in _mamba2_inputs(with_d)]
    torch.library.opcheck(mamba2_chunk_scan_fwd, (*xs, 4, True, 0.0, float("inf"), MAMBA2_IMPL))


def _source(impl: str) -> str:
    import importlib
    import inspect

    module, _, name = impl.rpartition(".")
    fn = getattr(importlib.import_module(module), name)
    return inspect.getsource(getattr(fn, "__wrapped__", fn))


def _installed(impls) -> list[str]:
    """The names whose module this transformers has (a family newer than the installed release is absent)."""
    import importlib.util

    return sorted(i for i in impls if importlib.util.find_spec(i.rpartition(".")[0].rpartition(".")[0]) is not None)


@pytest.mark.parametrize("impls", [GATED_DELTA_IMPLS, KDA_IMPLS, MAMBA2_IMPLS, MAMBA1_IMPLS],
                         ids=["gated_delta", "kda", "mamba2", "mamba1"])
def test_each_named_impl_is_one_source(impls):
    """The families' copies are one function (transformers' "Copied from"): the forest form models that one."""
    sources = {impl: _source(impl) for impl in _installed(impls)}
    assert len(set(sources.values())) == 1, sorted(sources)


def test_the_math_probe_accepts_the_fallbacks_and_refuses_other_math():
    assert all(math_agrees(impl) for impl in _installed(GATED_DELTA_IMPLS | KDA_IMPLS | MAMBA2_IMPLS | MAMBA1_IMPLS))
    # Same signature and name as a Mamba-2 scan, other math: refused by the probe, not by the name.
    assert not math_agrees(f"{__name__}.mamba2_chunk_scan")
    assert not math_agrees("transformers.models.mamba2.modeling_mamba2.no_such_function")


def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, dt_softplus=False,
                      dt_limit=(0.0, float("inf"))):  # the name the probe dispatches on; the op is ``mamba2_op``
    """A scan without its decay (exp(dt A) taken as 1): the probe must tell it from transformers'."""
    x = hidden_states.float() * dt[..., None].float()
    Bh, Ch = (t.float().repeat_interleave(x.shape[2] // t.shape[2], dim=2) for t in (B, C))
    state = torch.cumsum(x[..., None] * Bh[..., None, :], dim=1)
    return (state * Ch[..., None, :]).sum(-1)


def _mamba1_inputs(full: bool):
    g = torch.Generator().manual_seed(0)
    B, Dc, T, N = 2, 5, 9, 3
    x, dt = (torch.randn(B, Dc, T, generator=g) for _ in range(2))
    A = -torch.rand(Dc, N, generator=g) - 0.5
    Bm, Cm = (torch.randn(B, N, T, generator=g) for _ in range(2))
    D, z, bias = ((torch.randn(Dc, generator=g), torch.randn(B, Dc, T, generator=g), torch.randn(Dc, generator=g))
                  if full else (None, None, None))
    return [x, dt, A, Bm, Cm, D, z, bias]


MAMBA1_IMPL = "transformers.models.mamba.modeling_mamba.mamba_selective_scan"


@pytest.mark.parametrize("full", [True, False], ids=["D_z_bias", "neither"])
def test_mamba1_op_is_the_fallback_and_its_autograd(full):
    from transformers.models.mamba import modeling_mamba

    fallback = modeling_mamba.mamba_selective_scan.__wrapped__
    results = []
    for run in ("fallback", "op"):
        xs = [t if t is None else t.clone().requires_grad_() for t in _mamba1_inputs(full)]
        x, dt, A, Bm, Cm, D, z, bias = xs
        kw = dict(D=D, z=z, delta_bias=bias, delta_softplus=True)
        out = (fallback(x, dt, A, Bm, Cm, **kw) if run == "fallback"
               else mamba_selective_scan(x, dt, A, Bm, Cm, impl=MAMBA1_IMPL, **kw))
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out] + [t.grad for t in xs if t is not None])
    for a, b in zip(*results):
        assert a.dtype == b.dtype
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("full", [True, False], ids=["D_z_bias", "neither"])
def test_mamba1_op_registrations(full):
    xs = [t if t is None else t.requires_grad_() for t in _mamba1_inputs(full)]
    torch.library.opcheck(mamba_selective_scan_fwd, (*xs, True, False, False, MAMBA1_IMPL))


def test_hf_mamba1_layer_compiles_as_one_op():
    """The polyfill puts one op per Mamba mixer in Dynamo's graph, none of the fallback's token loop."""
    model = tiny_model("mamba")
    kwargs, _ = batch_kwargs(model)
    gm = capture(model, **kwargs)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("dualkv.mamba_selective_scan.default") == model.config.num_hidden_layers >= 1
    assert "stack" not in " ".join(targets)  # the loop's torch.stack of per-token outputs


def test_hf_mamba2_layer_compiles_as_one_op():
    """The polyfill puts one op per Mamba-2 mixer in Dynamo's graph, none of the fallback's chunked scan."""
    model = tiny_model("mamba2")
    kwargs, _ = batch_kwargs(model)
    targets = [str(n.target) for n in capture(model, **kwargs).graph.nodes if n.op == "call_function"]
    assert model.config.num_hidden_layers >= 1
    assert targets.count("dualkv.mamba2_chunk_scan.default") == model.config.num_hidden_layers
    assert not any("cumsum" in t for t in targets)


def test_hf_mamba2_call_with_a_layers_own_keywords_is_one_op():
    """GraniteMoeHybrid passes ``z=None`` and its forward's ``output_router_logits``: the wrapper drops what the
    fallback does not name, so the polyfill must too (and still record the op, not trace the fallback)."""
    from transformers.models.mamba2 import modeling_mamba2

    def scan(x, dt, A, B, C, D, bias):
        return modeling_mamba2.mamba2_chunk_scan(x, dt, A, B, C, chunk_size=4, D=D, z=None, dt_bias=bias,
                                                 dt_softplus=True, output_router_logits=False)

    xs = _mamba2_inputs(True)
    targets = [str(n.target) for n in capture(scan, *xs).graph.nodes if n.op == "call_function"]
    assert targets.count("dualkv.mamba2_chunk_scan.default") == 1 and not any("cumsum" in t for t in targets)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(scan, backend="aot_eager")(*xs),
                               modeling_mamba2.mamba2_chunk_scan.__wrapped__(*xs[:5], 4, D=xs[5], dt_bias=xs[6],
                                                                             dt_softplus=True))


def test_hf_mamba2_call_with_packed_sequences_raises_as_the_wrapper_does():
    from transformers.models.mamba2 import modeling_mamba2

    def scan(x, dt, A, B, C, D, bias, seq_idx):
        return modeling_mamba2.mamba2_chunk_scan(x, dt, A, B, C, chunk_size=4, seq_idx=seq_idx)

    xs = _mamba2_inputs(True)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="can't keep packed sequences apart"):
        torch.compile(scan, backend="aot_eager", fullgraph=True)(*xs, torch.zeros(2, 10, dtype=torch.int32))


def test_hf_kda_layer_compiles_as_one_op():
    """Kimi-linear's KDA goes through the GDN op (the same signature and contract), its gate per key channel."""
    model = tiny_model("kimi_linear")
    kwargs, _ = batch_kwargs(model)
    gm = capture(model, **kwargs)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == "dualkv.gated_delta_rule.default"]
    assert len(calls) == sum(t == "linear_attention" for t in model.config.layer_types) >= 1
    assert all(c.args[-1] in KDA_IMPLS and c.args[3].meta["example_value"].dim() == 4 for c in calls)


# Packed: the forest takes every layer (Qwen3.5 once its rotary's setitems are out of place: normalize.functionalize).
EXPECTED = {"qwen3_next": PACKED, "qwen3_5_text": PACKED, "qwen3_5_moe_text": PACKED, "kimi_linear": PACKED,
            "nemotron_h": PACKED, "mamba": PACKED}
# The same scan in more families: make test-slow.
EXPECTED_SLOW = {"olmo_hybrid": PACKED, "mamba2": PACKED, "falcon_h1": PACKED, "bamba": PACKED, "granitemoehybrid": PACKED, "zamba2": PACKED,
                 "falcon_mamba": PACKED, "jamba": PACKED, "lara_mini": PACKED, "bailing_hybrid": PACKED}


def _expect(family, expected):
    outcome = run_family(family)
    assert (outcome.outcome, family) == (expected[family], family), outcome.detail


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_hybrid_compiles_under_dualkv_and_is_exact(family, one_thread):
    """Forward and backward under ``backend="dualkv"`` (inner aot_eager) against the eager model, as the family
    sweep compares them (logits and every gradient within 1e-5): packed on the forest, or refused, never inexact."""
    _expect(family, EXPECTED)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(EXPECTED_SLOW))
def test_more_hybrids_compile_under_dualkv_and_are_exact(family, one_thread):
    _expect(family, EXPECTED_SLOW)


@pytest.mark.parametrize("family", ["qwen3_5_text", pytest.param("nemotron_h", marks=pytest.mark.slow)])
def test_hybrid_with_activation_checkpointing_packs_and_is_exact(family, one_thread):
    """transformers' non-reentrant activation checkpointing around GDN and Mamba-2 layers: their opaque ops inside
    the checkpointed regions are packed as without it (the forest scans' backward recomputes them), exactly."""
    import copy
    import functools

    from dualkv_compile.backend import dualkv_backend
    from tests.family_sweep import _forward_backward, _worst

    torch._dynamo.reset()
    model = tiny_model(family)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing
    kwargs, valid = batch_kwargs(model)
    ref = copy.deepcopy(model)
    ref_out, ref_grads = _forward_backward(ref, kwargs, valid)
    before = len(dualkv_compile.reports())
    compiled = torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    out, grads = _forward_backward(compiled, kwargs, valid)
    reports = dualkv_compile.reports()[before:]
    assert [r.packed_calls for r in reports] == [1], [str(r) for r in reports]
    kinds = [k for k, _ in reports[0].recurrent_layers]
    assert ("gated delta rule" if family == "qwen3_5_text" else "Mamba-2 scan") in kinds, kinds
    assert _worst(out, grads, ref_out, ref_grads) is None
