"""``DirectCompile``: the packed graph compiled for symbolic sizes without a second Dynamo trace, its guards checked
on every call (runtime.direct_compile)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx

import dualkv_compile
from dualkv_compile.config import DualKVConfig
from dualkv_compile.layout.packed_ops import gather_columns
from dualkv_compile.runtime import direct_compile
from dualkv_compile.runtime import runner as runner_module
from dualkv_compile.runtime.direct_compile import DirectCompile, TooManyCompiles
from tests.helpers import assert_loss_and_grads_match, grpo_steps_match, grpo_token_mean, hf_model, make_batch


def _matmul_relu(x, w, scale):
    return ((x @ w).relu().sum(0) * scale,)  # a tuple, as Dynamo's graphs return


def _compiled(fn, dims, inner="aot_eager"):
    gm = fx.symbolic_trace(fn)
    compiles = []
    return DirectCompile(gm, DualKVConfig(inner=inner), None, lambda args: dims, on_compile=lambda: compiles.append(1)), compiles


def _check_rows(compiled, fn, row_counts, *rest) -> None:
    """``compiled`` on x of each row count (and a fixed [3, 5] w), bit-equal to ``fn``."""
    w = torch.randn(3, 5)
    for rows in row_counts:
        x = torch.randn(rows, 3)
        torch.testing.assert_close(compiled(x, w, *rest), fn(x, w, *rest), rtol=0, atol=0)


def test_one_compile_serves_every_size_its_guards_admit_and_a_size_they_refuse_compiles_again():
    compiled, compiles = _compiled(_matmul_relu, [(True, False), (False, False), False])
    _check_rows(compiled, _matmul_relu, (4, 7, 9), 2)
    assert len(compiles) == 1
    # The first compile saw 4 rows: as in Dynamo, 0 and 1 specialise, so 4 made a symbol with 2 <= rows; one row
    # fails that guard and compiles again, for one row.
    _check_rows(compiled, _matmul_relu, (1,), 2)
    assert len(compiles) == 2
    _check_rows(compiled, _matmul_relu, (6,), 2)
    assert len(compiles) == 2


def test_a_static_size_or_int_is_not_guarded_and_a_symbolic_int_is_an_input():
    """Static sizes are the caller's to guard (the outer frame's Dynamo guards); a symbolic int is read per call."""
    compiled, compiles = _compiled(_matmul_relu, [(True, False), (False, False), True])
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    for scale in (2, 3, 5):
        torch.testing.assert_close(compiled(x, w, scale), _matmul_relu(x, w, scale), rtol=0, atol=0)
    assert len(compiles) == 1


def _padded_matmul(x, w):
    return (torch.nn.functional.pad(x @ w, (0, 1)).relu().sum(0),)


def test_the_fake_value_propagation_keeps_symbolic_sizes_symbolic():
    """The fake values are made under the Python dispatcher, as Dynamo's trace makes them: without it, ``F.pad``
    (torch 2.13) and 3-d ``linear`` / ``matmul`` (torch 2.11) ran C++ composites that read a fake tensor's concrete
    sizes, specialising the rows, and each new row count compiled again (the runner's test failed on torch 2.11)."""
    compiled, compiles = _compiled(_padded_matmul, [(True, False), (False, False)])
    _check_rows(compiled, _padded_matmul, (4, 7, 9))
    assert len(compiles) == 1


def test_past_the_limit_a_call_is_refused_not_compiled(monkeypatch):
    monkeypatch.setattr(direct_compile, "MAX_ENTRIES", 1)
    compiled, compiles = _compiled(_matmul_relu, [(True, False), (False, False), False])
    w = torch.randn(3, 5)
    compiled(torch.randn(4, 3), w, 2)
    with pytest.raises(TooManyCompiles, match="compiled 1 times"):
        compiled(torch.randn(1, 3), w, 2)
    assert len(compiles) == 1


def _gather_then_scale(x, col_index, w):
    return (gather_columns(x, col_index, 1) * w,)


def test_a_graph_calling_dualkv_layout_functions_hits_aotautograds_cache():
    """A packed graph calls dualkv's layout functions (``layout.packed_ops``). AOTAutograd's cache takes only torch
    functions, so such a graph bypassed it and every warm start traced AOTAutograd again: they are marked with a
    hash of their source (which joins the cache key)."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    gm = fx.GraphModule(torch.nn.Module(), fx.Tracer(autowrap_functions=(gather_columns,)).trace(_gather_then_scale))
    assert any(n.target is gather_columns for n in gm.graph.nodes)
    x, cols, w = torch.randn(2, 6, 3, requires_grad=True), torch.tensor([0, 2, 2, 5]), torch.randn(3)
    dims = [(False, True, False), (True,), (False,)]
    counters.clear()
    with fresh_cache():
        for _ in range(2):  # a second process's warm start: a new compile of the same graph
            compiled = DirectCompile(copy.deepcopy(gm), DualKVConfig(inner="inductor"), None, lambda args: dims)
            (out,) = compiled(x, cols, w)
            out.sum().backward()
    torch.testing.assert_close(out, _gather_then_scale(x, cols, w)[0])
    assert counters["aot_autograd"]["autograd_cache_bypass"] == 0
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1, dict(counters["aot_autograd"])


def test_the_runner_compiles_the_packed_graph_without_a_nested_dynamo_trace(monkeypatch):
    """The packed graph of an HF model under ``@policy_loss(dynamic=True)`` compiles once for two batches of other
    layouts, exact, and never through ``nested_compile`` (made to fail here)."""

    def no_nested(*args, **kwargs):
        raise AssertionError("the packed graph went through nested_compile")

    monkeypatch.setattr(runner_module, "nested_compile", no_nested)
    torch._dynamo.reset()
    model = hf_model("qwen3", "sdpa", layers=1)
    ref_model = copy.deepcopy(model)
    decorated = dualkv_compile.policy_loss(grpo_token_mean, dynamic=True, inner="aot_eager")
    new = grpo_steps_match(decorated, model, ref_model)
    assert sum(r.packed_calls for r in new) == 2 and not any(r.fallback_reasons for r in new), [str(r) for r in new]
    assert sum(r.packed_compiles for r in new) == 1, [str(r) for r in new]


def _clip(x, eps):
    return (x.clamp(1 - eps.item(), 1 + eps.item()) * 2,)


def test_a_scalar_read_with_item_is_baked_in_and_a_changed_one_goes_to_the_other_route():
    """A loss's clip range arrives as a 0-dim CPU tensor read with ``.item()`` (Dynamo lifts float arguments and
    defaults): baked in and compared per call; a new value hands the graph to ``otherwise`` (the nested route)."""
    gm = fx.symbolic_trace(_clip)
    compiles, nested_calls = [], []

    def otherwise():
        def run(*args):
            nested_calls.append(1)
            return _clip(*args)
        return run

    compiled = DirectCompile(gm, DualKVConfig(inner="aot_eager"), None, lambda args: [(True,), ()],
                             on_compile=lambda: compiles.append(1), otherwise=otherwise)
    eps = torch.tensor(0.2, dtype=torch.float64)
    for n in (5, 8):
        x = torch.linspace(0, 2, n)
        torch.testing.assert_close(compiled(x, eps)[0], _clip(x, eps)[0], rtol=0, atol=0)
    assert len(compiles) == 1 and not nested_calls
    eps = torch.tensor(0.3, dtype=torch.float64)
    torch.testing.assert_close(compiled(x, eps)[0], _clip(x, eps)[0], rtol=0, atol=0)
    assert len(compiles) == 1 and len(nested_calls) == 1
    # Without another route, a new value compiles again.
    compiled = DirectCompile(gm, DualKVConfig(inner="aot_eager"), None, lambda args: [(True,), ()],
                             on_compile=lambda: compiles.append(1))
    for value in (0.2, 0.3, 0.2):
        eps = torch.tensor(value, dtype=torch.float64)
        torch.testing.assert_close(compiled(x, eps)[0], _clip(x, eps)[0], rtol=0, atol=0)
    assert len(compiles) == 3


def _own_function(body: str, filename: str):
    """A function named ``scale_tokens`` of a dualkv module, as the rewrite's layout functions are, with ``body``
    as its source (registered with linecache, so ``inspect.getsource`` reads it as it reads a file)."""
    import linecache

    source = f"def scale_tokens(x):\n    return {body}\n"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {}
    exec(compile(source, filename, "exec"), namespace)
    fn = namespace["scale_tokens"]
    fn.__module__ = "dualkv_compile.layout.packed_ops"
    return fn


def test_an_edited_layout_function_misses_the_cache_entry_of_the_old_one():
    """Two versions of one layout function (same module and name, other source): the second must not be served
    the first one's cached graph. torch 2.11 keys the graph by its code, which names the function; the hash of
    the source is in that name."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    x = torch.randn(4, 3, requires_grad=True)
    counters.clear()
    with fresh_cache():
        for body, factor in (("x * 2", 2), ("x * 3", 3)):
            fn = _own_function(body, f"<dualkv test {factor}>")
            gm = fx.GraphModule(torch.nn.Module(), fx.Tracer(autowrap_functions=(fn,)).trace(lambda x: (fn(x) + 1,)))
            (out,) = DirectCompile(gm, DualKVConfig(inner="inductor"), None, lambda args: [(True, False)])(x)
            torch.testing.assert_close(out, x * factor + 1)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 0 and counters["aot_autograd"]["autograd_cache_bypass"] == 0


def test_a_size_specialised_to_one_is_checked_per_call():
    """A size asked to be symbolic that came as 1 is specialised (as in Dynamo); its guard is not the shape
    environment's (that leaves static sizes to the caller), yet a later call with more rows must not run the
    compile made for one (Inductor's would fail its size asserts, or worse)."""
    compiled, compiles = _compiled(_matmul_relu, [(True, False), (False, False), False])
    _check_rows(compiled, _matmul_relu, (1, 4, 1), 2)
    assert len(compiles) == 2


def test_option_packed_compile_nested_takes_the_nested_route(monkeypatch):
    """``packed_compile="nested"`` (for A/B runs, and what "direct" hands over to) compiles the packed graph through
    ``nested_compile``, exact as the direct route."""
    calls = []
    nested = runner_module.nested_compile

    def counted(*args, **kwargs):
        calls.append(1)
        return nested(*args, **kwargs)

    monkeypatch.setattr(runner_module, "nested_compile", counted)
    torch._dynamo.reset()
    model = hf_model("llama", "sdpa", layers=1)
    ref_model = copy.deepcopy(model)
    decorated = dualkv_compile.policy_loss(grpo_token_mean, dynamic=True, inner="aot_eager", packed_compile="nested")
    batch = make_batch([(6, [3, 4, 1, 5]), (4, [2, 5])], seed=0)
    assert_loss_and_grads_match(decorated(model, batch), grpo_token_mean(ref_model, batch), model, ref_model)
    assert calls == [1]


def test_the_callers_saved_tensor_hooks_see_real_tensors_only():
    """The compile runs inside the caller's step, under its saved-tensors hooks (activation offloading): they must
    see the tensors the compiled function saves, never the fake values the compile propagates (which a test of
    checkpointing under sequence parallelism recorded as whole-stream activations)."""
    from torch._subclasses.fake_tensor import FakeTensor

    compiled, _ = _compiled(_matmul_relu, [(True, False), (False, False), False])
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (seen.append(t), t)[1], lambda t: t):
        (out,) = compiled(x, w, 2)
    out.sum().backward()
    assert seen and not any(isinstance(t, FakeTensor) for t in seen), [type(t).__name__ for t in seen]


@pytest.mark.parametrize("mode, options, direct", [
    (None, {}, True), ("max-autotune-no-cudagraphs", {}, True), ("reduce-overhead", {}, False),
    (None, {"packed_compile": "nested"}, False), (None, {"inner": "eager"}, False),
])
def test_which_graphs_take_the_direct_route(mode, options, direct):
    """CUDA graphs learn the static inputs from Dynamo, and the eager inner compiler compiles nothing: those, and
    the nested option, take the nested route, with the reason."""
    why = direct_compile.eligible(fx.symbolic_trace(_matmul_relu), DualKVConfig.from_options(options), mode)
    assert (why is None) == direct, why
