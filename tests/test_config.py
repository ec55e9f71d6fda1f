"""The dualkv backend composes with the torch.compile options users set.

Each test compiles a tiny HF Qwen3 with ``backend="dualkv"`` plus one option
(``fullgraph``, ``dynamic``, ``mode``), then checks that the graph was
rewritten (``dualkv_compile.reports()``) and that logits at valid positions
and every parameter gradient match the uncompiled model.

Most tests use ``inner="aot_eager"`` (the options under test act in Dynamo,
before the inner compiler); the ``mode`` test needs Inductor, the only inner
compiler that reads it. On a 2-core CPU an Inductor compile of this 1-layer
model takes ~20-40 s cold (g++ per generated kernel), and dualkv compiles two
graphs per Dynamo graph (the fallback and the packed graph), each forward and
backward; with a warm Inductor cache it is a few seconds.
"""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch

import dualkv_compile
from dualkv_compile import backend as backend_module
from dualkv_compile.runtime import nested_compile as nested_compile_module
from dualkv_compile.backend import dualkv_backend

from tests.helpers import hf_model, rel, grpo_batch

pytest.importorskip("transformers")

# Two batches of different shapes ([4, 15] and [5, 18]); each is one group.
SHAPE_A = [(7, [3, 5, 4, 2])]
SHAPE_B = [(9, [2, 3, 4, 5, 6])]
AOT = {"inner": "aot_eager"}


def _forward(m, ids, mask):
    return m(input_ids=ids, attention_mask=mask).logits


def _check(compiled, model, ref_model, batches, tol=1e-5):
    """Run compiled (wrapping ``model``) and ``ref_model`` on each batch; compare valid logits and gradients."""
    for ids, mask, _ in batches:
        valid = mask.bool()
        out = _forward(compiled, ids, mask)
        ref = _forward(ref_model, ids, mask)
        assert rel(out[valid], ref[valid]) <= tol
        proj = torch.randn(ref.shape[-1], generator=torch.Generator().manual_seed(1))
        (out[valid] @ proj).sum().backward()
        (ref[valid] @ proj).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            assert q.grad is not None and p.grad is not None, name
            assert rel(p.grad, q.grad) <= tol, name
        model.zero_grad(set_to_none=True)
        ref_model.zero_grad(set_to_none=True)


def _setup(**compile_kwargs):
    """A fresh tiny Qwen3, its uncompiled copy, the compiled model and the index of its first report."""
    torch._dynamo.reset()
    model = hf_model("qwen3", "sdpa", layers=1)
    ref_model = copy.deepcopy(model)
    start = len(dualkv_compile.reports())
    compiled = torch.compile(model, **compile_kwargs)
    return model, ref_model, compiled, start


def _batches(*shapes):
    return [grpo_batch(g, 101, seed=i) for i, g in enumerate(shapes)]


def test_fullgraph():
    model, ref_model, compiled, start = _setup(backend="dualkv", fullgraph=True, options=AOT)
    _check(compiled, model, ref_model, _batches(SHAPE_A))
    new = dualkv_compile.reports()[start:]
    # fullgraph: the whole forward is one Dynamo graph, and it is rewritten.
    assert len(new) == 1 and new[0].rewritten and new[0].packed_calls == 1


def test_dynamic_true():
    model, ref_model, compiled, start = _setup(backend="dualkv", dynamic=True, options=AOT)
    _check(compiled, model, ref_model, _batches(SHAPE_A, SHAPE_B))
    new = dualkv_compile.reports()[start:]
    # One symbolic graph serves both shapes; both calls ran packed.
    assert len(new) == 1 and new[0].rewritten and new[0].packed_calls == 2, [str(r) for r in new]


def test_dynamic_none_automatic_dynamic_recompile():
    """The default: the first graph is static; a second shape makes Dynamo recompile it dynamic."""
    model, ref_model, compiled, start = _setup(backend="dualkv", options=AOT)
    batches = _batches(SHAPE_A, SHAPE_B, [(6, [4, 1, 3])])
    _check(compiled, model, ref_model, batches)
    new = dualkv_compile.reports()[start:]
    assert len(new) == 2, [str(r) for r in new]  # static, then automatic dynamic (no third graph)
    assert all(r.rewritten for r in new)
    assert new[0].packed_calls == 1 and new[1].packed_calls == 2


def test_dynamic_false():
    """Static shapes: every new shape is a new Dynamo graph, and each is rewritten."""
    model, ref_model, compiled, start = _setup(backend="dualkv", dynamic=False, options=AOT)
    _check(compiled, model, ref_model, _batches(SHAPE_A, SHAPE_B))
    new = dualkv_compile.reports()[start:]
    assert len(new) == 2 and all(r.rewritten and r.packed_calls == 1 for r in new), [str(r) for r in new]


def test_mode_and_options_together_is_refused_by_torch():
    """torch.compile refuses mode= with options= for any backend; a partial of the backend takes both."""
    with pytest.raises(RuntimeError, match="Either mode or options"):
        torch.compile(torch.nn.Linear(2, 2), backend="dualkv", mode="max-autotune-no-cudagraphs", options=AOT)
    # The way to give both: bind them on the backend function.
    torch.compile(
        torch.nn.Linear(2, 2),
        backend=functools.partial(dualkv_backend, mode="max-autotune-no-cudagraphs", options={"inner": "inductor"}),
    )


@pytest.mark.slow  # make test's budget: Inductor's max-autotune compiles twice on CPU
def test_mode_max_autotune_no_cudagraphs(monkeypatch):
    """mode= reaches the backend and the Inductor config of both the fallback and the packed compile."""
    seen = []
    real = nested_compile_module.mode_patches

    def spy(mode):
        seen.append(mode)
        return real(mode)

    monkeypatch.setattr(nested_compile_module, "mode_patches", spy)
    # options cannot be given with mode (see above); inner is Inductor by default.
    model, ref_model, compiled, start = _setup(backend="dualkv", mode="max-autotune-no-cudagraphs")
    _check(compiled, model, ref_model, _batches(SHAPE_A))
    new = dualkv_compile.reports()[start:]
    assert len(new) == 1 and new[0].rewritten and new[0].packed_calls == 1 and new[0].packed_compiles == 1
    # The packed graph compiled with the mode's patches; the (static) fallback is
    # compiled only when first needed, so not yet.
    assert seen == ["max-autotune-no-cudagraphs"], seen
    # Same shape, nothing shared: the static graph's fallback runs, compiled with the mode too, and is exact.
    unshared = [(7, [r]) for r in SHAPE_A[0][1]]
    _check(compiled, model, ref_model, _batches(unshared))
    assert new[0].packed_calls == 1 and new[0].fallback_reasons
    assert seen == ["max-autotune-no-cudagraphs"] * 2, seen
    assert real("max-autotune-no-cudagraphs").get("max_autotune") is True


def test_dynamic_true_lifted_scale_follows_the_module():
    """Under dynamic=True Dynamo passes module floats (attention scaling, dropout) as graph inputs.

    The packed graph bakes their values in; a changed value must never be
    computed with the old one: Dynamo recompiles (a new graph, rewritten with
    the new value) or the runner's per-call check runs that call unpacked.
    """
    model, ref_model, compiled, start = _setup(backend="dualkv", dynamic=True, options=AOT)
    _check(compiled, model, ref_model, _batches(SHAPE_A))
    for m in (model, ref_model):
        m.model.layers[0].self_attn.scaling = 0.2
    _check(compiled, model, ref_model, _batches(SHAPE_A))
    new = dualkv_compile.reports()[start:]
    assert new[0].rewritten and new[0].packed_calls == 1, [str(r) for r in new]
    second = new[1:] or new
    assert any(r.packed_calls for r in new[1:]) or any("scale is 0.2" in f for f in new[0].fallback_reasons), [str(r) for r in second]


# --------------------------------------------------------------------------- option validation

BAD_OPTIONS = [
    ("min_rho", "2"), ("min_rho", -1), ("min_rho", 0.5), ("min_rho", 0), ("min_rho", float("nan")),
    ("min_rho", True), ("min_rho", None),
    ("group_size", 0), ("group_size", -2), ("group_size", 2.0), ("group_size", "4"), ("group_size", True),
    ("min_shared", 0), ("min_shared", -1), ("min_shared", 1.5), ("min_shared", "1"), ("min_shared", True),
    ("min_shared", None),
    ("inner", "cuda"), ("inner", None), ("inner", 1),
    ("packed_compile", "dynamo"), ("packed_compile", None), ("packed_compile", True),
    ("verify", 1), ("verify", "yes"), ("verify", None),
    ("attention_backend", "cuda"), ("attention_backend", ""), ("attention_backend", "Reference"),
    ("attention_backend", None), ("attention_backend", 1),
    ("verify_max_elements", -1), ("verify_max_elements", 1.5), ("verify_max_elements", "10"),
    ("verify_max_elements", True), ("verify_max_elements", None),
    ("chunked_log_probs", 1), ("chunked_log_probs", "yes"), ("chunked_log_probs", None),
    ("log_prob_chunk_bytes", 0), ("log_prob_chunk_bytes", 1.5), ("log_prob_chunk_bytes", True),
    ("log_prob_chunk_bytes", None),
]


@pytest.mark.parametrize("name, value", BAD_OPTIONS, ids=[f"{n}={v!r}" for n, v in BAD_OPTIONS])
def test_bad_option_values_raise_value_error_naming_the_option(name, value):
    """Every option is checked when the config is built: at decoration (policy_loss) and at the backend's
    first call (torch.compile only hands options to the backend then; Dynamo wraps the ValueError)."""
    match = rf"options\['{name}'\] must be .*got {re.escape(repr(value))}"
    with pytest.raises(ValueError, match=match):
        dualkv_compile.DualKVConfig.from_options({name: value})
    if not (name in ("min_rho", "group_size") and value is None):  # policy_loss's "not given"
        with pytest.raises(ValueError, match=match):
            dualkv_compile.policy_loss(**{name: value})
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x + 1, backend="dualkv", options={name: value})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=match):
        compiled(torch.ones(2))


GOOD_OPTIONS = [
    ("min_rho", 1.0), ("min_rho", 1), ("min_rho", 1.5), ("min_rho", float("inf")),
    ("group_size", None), ("group_size", 1), ("group_size", 8),
    ("min_shared", 1), ("min_shared", 32),
    *[("inner", v) for v in ("inductor", "aot_eager", "eager")], ("verify", False),
    ("packed_compile", "direct"), ("packed_compile", "nested"),
    *[("attention_backend", v) for v in ("auto", "reference", "cpu_flash", "flex", "triton", "gluon")],
    ("verify_max_elements", 0), ("chunked_log_probs", False), ("log_prob_chunk_bytes", 1),
]


@pytest.mark.parametrize("name, value", GOOD_OPTIONS, ids=[f"{n}={v!r}" for n, v in GOOD_OPTIONS])
def test_good_option_values_are_accepted(name, value):
    cfg = dualkv_compile.DualKVConfig.from_options({name: value})
    assert getattr(cfg, name) == value
    dualkv_compile.policy_loss(**{name: value})


def test_attention_backend_that_cannot_run_is_refused_with_its_reason(monkeypatch):
    """attention_backend="triton" on CPU without the interpreter (TinyDecoder: head dim 8): the graph is refused,
    runs unchanged, and explain() gives the real reason (the device), not the head dim and not "None"."""
    pytest.importorskip("triton")
    from dualkv_compile.kernels.triton import fwd as triton_fwd  # noqa: F401 - compiled as the session set it, before the flag changes

    from tests.helpers import BATCHES
    from tests.tiny_decoder import TinyDecoder

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(0)
    model = TinyDecoder()
    ids, _, pos = grpo_batch(BATCHES["one_group"], 61)
    result = dualkv_compile.explain(model, ids, pos, options={"inner": "aot_eager", "attention_backend": "triton"}, quiet=True)
    assert len(result.refused) == 1 and not result.rewritten
    reason = result.refused[0].reason
    assert reason is not None and "attention_backend='triton'" in reason, reason
    assert "needs a CUDA tensor" in reason and "TRITON_INTERPRET=1" in reason and "on cpu" in reason, reason
    assert "head dim" not in reason.split(":", 1)[1], reason
    assert "REFUSED: None" not in str(result) and reason in str(result)
    assert torch.equal(result.output, model(ids, pos))


def test_report_without_reason_does_not_print_none():
    text = str(backend_module.GraphReport(graph_id=3, num_nodes=10, num_attention=1, rewritten=False))
    assert "None" not in text and "graph 3" in text
