"""Tests of the FlexAttention backend's op level (dualkv_compile/ops/flex.py).

CPU tests check the custom op ``dualkv::flex_block_tables`` with
``torch.library.opcheck`` (with and without windows) and that the builder and
the flex path trace without recompiling across layouts. With the CPU device
check lifted and FlexAttention run by its dense implementation (``_cpu_flex``:
no block tables are read there, so these check the mask_mod, the sinks and the
recomputing backward, not the tables), sliding and chunked windows and sinks go
through ``shared_prompt_attention(backend="flex")`` (eager and under an outer
compile) and through the custom ops (``flex.forward``, then ``flex.backward`` at
the sink-aware stats) against the per-sequence float64 oracle
(tests/kernels/window_oracle.py), gradients of the sinks included; a new window
size recompiles nothing. CUDA tests (marked ``cuda``, skipped without a GPU)
run FlexAttention forward and backward against the float64 reference on
ragged, multi-group and prefix-forest (depth 3) GQA layouts in bf16 and fp32,
and with windows and sinks against the oracle at head dims 64 and 128 (GQA),
through both routes. The block tables' math is tested in
tests/kernels/test_flex_block_tables.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.register_assert_rewrite("tests.kernels.flex_layouts")
# window_oracle imports its neighbours as top-level modules (tests/kernels is on sys.path when its tests run)
_KERNEL_TESTS = str(Path(__file__).resolve().parents[1] / "kernels")
if _KERNEL_TESTS not in sys.path:
    sys.path.insert(0, _KERNEL_TESTS)

from dualkv_compile.kernels import reference  # noqa: E402
from dualkv_compile.ops import flex  # noqa: E402
from dualkv_compile.kernels.flex import attention as flex_math  # noqa: E402
from dualkv_compile.ops.attention import attention_fwd, shared_prompt_attention  # noqa: E402
from ..kernels.flex_layouts import FIXED_FORESTS, FIXED_LAYOUTS, same_tables  # noqa: E402
from ..kernels.segments import forest_segments, make_segments  # noqa: E402
from window_oracle import VARIANTS, inputs, oracle, rel, windowed_forest  # noqa: E402  (tests/kernels)

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (FlexAttention's backward has no CPU kernel)")


def _segments(layout, device="cpu"):
    """A layout spec: two-level groups ``[(P, [R, ...]), ...]`` or a forest ``("forest", seg_len, parent)``."""
    if layout and layout[0] == "forest":
        return forest_segments(layout[1], layout[2], device)
    return make_segments(layout, device)


def _forest(lens, parents):
    return ("forest", lens, parents)


@pytest.mark.parametrize("layout", [[(300, [100, 200, 5]), (40, [3])], _forest([300, 100, 50, 60, 200], [-1, 0, 1, 1, 0])])
@pytest.mark.parametrize("window, chunk", [(0, 0), (100, 0), (0, 200)])
def test_block_tables_op_opcheck(layout, window, chunk):
    segs, T = _segments(layout)
    tables = flex.block_tables_op(flex.segment_table(segs, T), T, segs.max_seg_len, window, chunk)
    assert len(tables) == 11 and all(t.shape == (T,) for t in tables[-3:])
    torch.library.opcheck(flex.block_tables_op, (flex.segment_table(segs, T), T, segs.max_seg_len, window, chunk))


def test_flex_path_traces_once_under_outer_compile(monkeypatch):
    """shared_prompt_attention's flex path is traceable: one graph for several layouts, right gradients.

    FlexAttention refuses backward on CPU in its python wrapper; the traced
    higher-order op's dense fallback can run it, so the check is lifted here
    to exercise tracing (block tables, mask_mod capture, autograd) on CPU.
    """
    import torch.nn.attention.flex_attention as fa
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def f(q, k, v, segs):
        return flex.attention(q, k, v, segs, 0.2)

    cf = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    layouts = ([(150, [40, 70, 9])], [(131, [30, 90]), (20, [5, 5, 5, 7, 1])], _forest([90, 40, 1, 70, 30, 9], [-1, 0, 1, 1, 0, -1]))
    for layout in layouts:
        segs, T = _segments(layout)
        g = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(1, h, T, 16, generator=g).requires_grad_() for h in (6, 2, 2))
        out = cf(q, k, v, segs)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        q64, k64, v64 = (t.detach().double() for t in (q, k, v))
        ro, lse = reference.reference_forward(q64, k64, v64, segs, 0.2)
        rg = reference.reference_backward(dout.double(), q64, k64, v64, ro, lse, segs, 0.2)
        assert _rel(out, ro) < 1e-5
        for a, b in zip(grads, rg):
            assert _rel(a, b) < 1e-5
    assert counter.frame_count == 1


def test_supports_refuses_cpu():
    why = flex.supports(torch.zeros(1, 2, 8, 16))
    assert why is not None and "CUDA" in why


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# --------------------------------------------------------------------------- windows and sinks on CPU


@pytest.fixture
def _cpu_flex(monkeypatch):
    """FlexAttention on CPU tensors: its device check lifted, its compiled callable ``aot_eager`` (the dense
    implementation, which differentiates the lse too); a compile counter on it; ``flex.supports`` lets CPU in."""
    import torch.nn.attention.flex_attention as fa
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    monkeypatch.setattr(flex, "supports", lambda q, v=None, **kw: None)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fa.flex_attention, backend=counter, dynamic=True)
    monkeypatch.setattr(flex_math, "compiled_flex", lambda: compiled)
    yield counter
    torch._dynamo.reset()


def _oracle_case(seed, window, chunk, with_sinks, D=16, hq=4, hkv=2, dtype=torch.float32, device="cpu", forest=None):
    """A forest (``windowed_forest(seed)`` unless given as (lens, parents)), inputs in ``dtype`` on ``device``, and
    the oracle's (out, dq, dk, dv, dsinks) on those very (rounded) inputs."""
    lens, parents = forest if forest is not None else windowed_forest(seed)
    segs, T = forest_segments(lens, parents, device)
    q, k, v, dout, sinks = (t.to(dtype) for t in inputs(T, D, D, seed, hq=hq, hkv=hkv))
    sinks = sinks if with_sinks else None
    want = oracle(q, k, v, dout, lens, parents, D ** -0.5, window, chunk, sinks)
    x = [t.to(device) for t in (q, k, v, dout)] + [None if sinks is None else sinks.to(device)]
    return segs, x, want


def _check_grads(got, want, tol):
    for name, a, b in zip(("out", "q", "k", "v", "sinks"), got, want):
        if b is not None:
            assert a is not None and torch.isfinite(a).all(), name
            assert rel(a.cpu(), b) < tol, (name, rel(a.cpu(), b))


def _through_shared_prompt_attention(segs, x, window, chunk, scale, compiled=False):
    q, k, v, sinks = (None if t is None else t.clone().requires_grad_() for t in (*x[:3], x[4]))

    def f(q, k, v, sinks):
        return shared_prompt_attention(q, k, v, segs, scale, backend="flex", window=window, chunk=chunk, sinks=sinks)

    if compiled:
        f = torch.compile(f, backend="aot_eager", fullgraph=True)
    out = f(q, k, v, sinks)
    out.backward(x[3])
    return out.detach(), q.grad, k.grad, v.grad, None if sinks is None else sinks.grad


def _through_custom_op(segs, x, window, chunk, scale):
    """``dualkv::attention_fwd`` with backend='flex' and its autograd (``dualkv::attention_bwd``: flex.backward)."""
    q, k, v, sinks = (None if t is None else t.clone().requires_grad_() for t in (*x[:3], x[4]))
    out, lse = torch.ops.dualkv.attention_fwd(q, k, v, *segs, scale, 0.0, "flex", window, chunk, sinks)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    out.backward(x[3])
    return out.detach(), q.grad, k.grad, v.grad, None if sinks is None else sinks.grad


@pytest.mark.parametrize("window, chunk", VARIANTS)
def test_flex_windows_and_sinks_match_oracle_cpu(_cpu_flex, window, chunk):
    """Both routes, with sinks (their gradient too) and without, fp32, against the float64 oracle."""
    for seed, with_sinks in ((5, True), (11, False)):
        segs, x, want = _oracle_case(seed, window, chunk, with_sinks)
        _check_grads(_through_shared_prompt_attention(segs, x, window, chunk, 0.25), want, 1e-5)
        _check_grads(_through_custom_op(segs, x, window, chunk, 0.25), want, 1e-5)


def test_flex_windows_and_sinks_under_outer_compile_cpu(_cpu_flex):
    """shared_prompt_attention's flex path traced (fullgraph) with a window, chunks and sinks."""
    segs, x, want = _oracle_case(2, 3, 4, True)
    _check_grads(_through_shared_prompt_attention(segs, x, 3, 4, 0.25, compiled=True), want, 1e-5)


def test_new_window_size_recompiles_nothing_cpu(_cpu_flex):
    """Window and chunk sizes are data of the compiled flex callable (the depth limits), not constants of it."""
    lens, parents = windowed_forest(10)
    segs, T = forest_segments(lens, parents)
    q, k, v, _, _ = (t.float() for t in inputs(T, 16, 16, 10))
    flex.forward(q, k, v, segs, 0.25, window=2)
    frames = _cpu_flex.frame_count
    for window, chunk in ((5, 0), (7, 3), (0, 4), (1, 9)):
        out, lse = flex.forward(q, k, v, segs, 0.25, window=window, chunk=chunk)
        want, *_ = oracle(q, k, v, torch.zeros_like(q), lens, parents, 0.25, window, chunk)
        assert rel(out, want) < 1e-5
    assert _cpu_flex.frame_count == frames


# --------------------------------------------------------------------------- CUDA

GPU_LAYOUTS = [
    [(1000, [300, 77, 513])],  # ragged, nothing a multiple of 128
    [(512, [256, 256, 256])],  # block-aligned
    [(200, [1, 130, 7]), (333, [64, 1000]), (50, [])],  # several groups, tiny segments, a lone row
    _forest([700, 300, 129, 1, 257, 64, 500, 3, 90], [-1, 0, 1, 1, 0, 4, -1, 6, 6]),  # depth 3, two trees
    _forest([128, 128, 1, 255, 384], [-1, 0, 1, 2, 1]),  # a block-aligned chain with a one-token node
]


def _cuda_inputs(T, hq, hkv, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(1, h, T, d, device="cuda", dtype=dtype, generator=g) for h in (hq, hkv, hkv))


def _ref_grads(q, k, v, dout, segs, scale):
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    ro, lse = reference.reference_forward(q64, k64, v64, segs, scale)
    return ro, reference.reference_backward(dout.double(), q64, k64, v64, ro, lse, segs, scale)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("layout", GPU_LAYOUTS)
@pytest.mark.parametrize("dtype,heads,d", [(torch.bfloat16, (8, 2), 128), (torch.bfloat16, (4, 4), 64), (torch.float32, (6, 3), 64)])
def test_flex_matches_reference_cuda(layout, dtype, heads, d):
    segs, T = _segments(layout, "cuda")
    q, k, v = _cuda_inputs(T, *heads, d, dtype, seed=T + d)
    scale = d**-0.5
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = shared_prompt_attention(qg, kg, vg, segs, scale=scale, backend="flex")
    assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    ro, rg = _ref_grads(q, k, v, dout, segs, scale)
    assert _rel(out, ro) < tol
    for name, a, b in zip("qkv", grads, rg):
        assert torch.isfinite(a).all(), name
        assert _rel(a, b) < tol, f"d{name}"


@pytest.mark.cuda
@needs_cuda
def test_flex_opaque_op_forward_lse_and_recomputed_backward_cuda():
    """The protocol path (dualkv::attention_fwd/bwd with backend='flex'): lse, and the recompute backward."""
    segs, T = forest_segments([700, 129, 60, 300, 90, 45, 200, 3], [-1, 0, 1, 1, 0, -1, 5, 5], "cuda")
    q, k, v = _cuda_inputs(T, 8, 2, 128, torch.bfloat16, seed=7)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attention_fwd(qg, kg, vg, *segs, 0.1, 0.0, "flex")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    ro, rg = _ref_grads(q, k, v, dout, segs, 0.1)
    _, rlse = reference.reference_forward(q.double(), k.double(), v.double(), segs, 0.1)
    assert lse.dtype == torch.float32 and lse.shape == (1, 8, T)
    assert torch.allclose(lse.double(), rlse, atol=2e-2, rtol=0)
    assert _rel(out, ro) < 2e-2
    for a, b in zip(grads, rg):
        assert _rel(a, b) < 2e-2


@pytest.mark.cuda
@needs_cuda
def test_block_mask_build_does_not_sync_cuda():
    segs, T = forest_segments([3000, 500, 700, 129, 60, 257, 1000, 5], [-1, 0, 1, 1, 0, -1, 5, 6], "cuda")
    flex.block_mask(segs, T, builder="torch")  # warm up allocator and kernels
    flex.block_mask(segs, T)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flex.block_mask(segs, T, builder="torch")
        flex.block_mask(segs, T)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("layout", FIXED_LAYOUTS + GPU_LAYOUTS + [_forest(*f) for f in FIXED_FORESTS])
def test_triton_builder_matches_torch_builder_cuda(layout):
    segs, T = _segments(layout, "cuda")
    table = flex.segment_table(segs, T)
    same_tables(flex.block_tables(table, T), flex.block_tables_op(table, T, segs.max_seg_len))


@pytest.mark.cuda
@needs_cuda
def test_no_recompile_across_layouts_cuda():
    from torch._dynamo.utils import counters

    def run(layout):
        segs, T = _segments(layout, "cuda")
        q, k, v = (t.requires_grad_() for t in _cuda_inputs(T, 8, 2, 128, torch.bfloat16, seed=T))
        out = shared_prompt_attention(q, k, v, segs, backend="flex")
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()

    run([(640, [200, 300])])  # compiles (or reuses) the builder and the flex kernels
    before = counters["stats"]["unique_graphs"]
    for layout in ([(1000, [1, 513, 77])], [(128, [128] * 5), (300, [40])], [(2049, [7] * 9)], GPU_LAYOUTS[3]):
        run(layout)
    assert counters["stats"]["unique_graphs"] == before


# --------------------------------------------------------------------------- windows and sinks on CUDA

_compiled_for = []  # the input configuration the flex callable's compiled variants were last made for


@pytest.fixture
def fused_flex(monkeypatch):
    """Past Dynamo's recompile limit (8 per code object) FlexAttention would silently run eagerly, unfused, and these
    tests would stop testing the fused kernels and the block tables: here that fails instead. ``fresh(key)`` drops
    the compiled variants when the input configuration changes, so that each stays well under the limit."""
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)

    def fresh(key):
        if _compiled_for != [key]:
            torch._dynamo.reset()
            _compiled_for[:] = [key]

    return fresh


# (dtype, (Hq, Hkv), head dim, tolerance): GQA at gpt-oss's head dim 64 and at 128, bf16 and fp32.
_CUDA_VARIANTS = [(torch.bfloat16, (8, 2), 128, 3e-2), (torch.bfloat16, (4, 1), 64, 3e-2), (torch.float32, (6, 3), 64, 3e-3)]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("window, chunk", VARIANTS)
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("dtype, heads, D, tol", _CUDA_VARIANTS)
def test_flex_windows_and_sinks_match_oracle_cuda(fused_flex, window, chunk, with_sinks, dtype, heads, D, tol):
    """Token-scale windows on small forests (two blocks), both routes, against the oracle.

    Forests of at least 128 tokens: on torch 2.11 (H200) compiled FlexAttention finds no kernel configuration
    for a stream shorter than one block, with torch's own ``create_block_mask`` too (NoValidChoicesError).
    """
    fused_flex((dtype, heads, D))
    for seed in (29, 62):  # windowed_forest's only seeds under 300 of 128 tokens or more (139 and 150)
        segs, x, want = _oracle_case(seed, window, chunk, with_sinks, D, *heads, dtype, "cuda")
        _check_grads(_through_shared_prompt_attention(segs, x, window, chunk, D ** -0.5), want, tol)
        _check_grads(_through_custom_op(segs, x, window, chunk, D ** -0.5), want, tol)


# Block-scale windows on streams of many blocks: skipped blocks, FULL blocks inside the window, cut ones.
_LONG_FOREST = ([700, 300, 129, 1, 257, 64, 500, 3, 90], [-1, 0, 1, 1, 0, 4, -1, 6, 6])  # depth 3, two trees
_LONG_WINDOWED = [
    (_LONG_FOREST, 256, 0),
    (_LONG_FOREST, 0, 384),
    (([1000, 300, 77, 513], [-1, 0, 0, 0]), 300, 200),  # a group, nothing a multiple of 128
    (([512, 256, 256, 256], [-1, 0, 0, 0]), 128, 0),  # block-aligned, the window one block
]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("forest, window, chunk", _LONG_WINDOWED)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_flex_block_scale_windows_match_oracle_cuda(fused_flex, forest, window, chunk, with_sinks):
    fused_flex("block scale")
    segs, x, want = _oracle_case(sum(forest[0]), window, chunk, with_sinks, 128, 8, 2, torch.bfloat16, "cuda", forest)
    _check_grads(_through_shared_prompt_attention(segs, x, window, chunk, 128 ** -0.5), want, 3e-2)
    _check_grads(_through_custom_op(segs, x, window, chunk, 128 ** -0.5), want, 3e-2)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("window, chunk", [(2, 0), (256, 0), (0, 384), (300, 200), (129, 64)])
def test_windowed_triton_builder_matches_torch_builder_cuda(window, chunk):
    for layout in GPU_LAYOUTS + [_forest(*f) for f in FIXED_FORESTS]:
        segs, T = _segments(layout, "cuda")
        table = flex.segment_table(segs, T)
        same_tables(flex.block_tables(table, T, window=window, chunk=chunk),
                    flex.block_tables_op(table, T, segs.max_seg_len, window, chunk))


@pytest.mark.cuda
@needs_cuda
def test_windowed_block_mask_does_not_sync_and_window_sizes_do_not_recompile_cuda(fused_flex):
    from torch._dynamo.utils import counters

    segs, T = forest_segments([3000, 500, 700, 129, 60, 257, 1000, 5], [-1, 0, 1, 1, 0, -1, 5, 6], "cuda")
    flex.block_mask(segs, T, builder="torch", window=256)
    flex.block_mask(segs, T, window=256, chunk=1024)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flex.block_mask(segs, T, builder="torch", window=300, chunk=500)
        flex.block_mask(segs, T, window=300, chunk=500)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    def run(window, chunk):
        q, k, v = (t.requires_grad_() for t in _cuda_inputs(T, 8, 2, 128, torch.bfloat16, seed=window + chunk))
        sinks = torch.zeros(8, device="cuda", requires_grad=True)
        out = shared_prompt_attention(q, k, v, segs, backend="flex", window=window, chunk=chunk, sinks=sinks)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()

    fused_flex("no recompile")
    run(256, 0)  # compiles (or reuses) the builder and the windowed flex kernels
    before = counters["stats"]["unique_graphs"]
    for window, chunk in ((1000, 0), (0, 512), (77, 3000)):
        run(window, chunk)
    assert counters["stats"]["unique_graphs"] == before
