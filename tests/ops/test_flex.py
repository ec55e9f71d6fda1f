"""Tests of the FlexAttention backend's op level (dualkv_compile/ops/flex.py).

CPU tests check the custom op ``dualkv::flex_block_tables`` with
``torch.library.opcheck`` and that the builder and the flex path trace
without recompiling across layouts. CUDA tests (marked ``cuda``, skipped
without a GPU) run FlexAttention forward and backward against the float64
reference on ragged, multi-group and prefix-forest (depth 3) GQA layouts in
bf16 and fp32. The block tables' math is tested in
tests/kernels/test_flex_block_tables.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.register_assert_rewrite("tests.kernels.flex_layouts")

from dualkv_compile.kernels import reference  # noqa: E402
from dualkv_compile.ops import flex  # noqa: E402
from dualkv_compile.ops.attention import attention_fwd, shared_prompt_attention  # noqa: E402
from ..kernels.flex_layouts import FIXED_FORESTS, FIXED_LAYOUTS, same_tables  # noqa: E402
from ..kernels.segments import forest_segments, make_segments  # noqa: E402

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
def test_block_tables_op_opcheck(layout):
    segs, T = _segments(layout)
    tables = flex.block_tables_op(flex.segment_table(segs, T), T, segs.max_seg_len)
    assert len(tables) == 9 and tables[-1].shape == (T,)
    torch.library.opcheck(flex.block_tables_op, (flex.segment_table(segs, T), T, segs.max_seg_len))


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
