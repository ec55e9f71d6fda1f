"""``ops.forest_recurrent``: the packed forms of the hybrid layers as the packed graph calls them, against the
forest references of ``kernels.recurrent`` (themselves checked against transformers' torch paths run per sequence:
tests/kernels/test_forest_recurrence.py), forward and backward, on random forests of depth 1-3."""

from __future__ import annotations

import pytest
import torch

from dualkv_compile.kernels.recurrent import forest_causal_conv1d as ref_conv, forest_gated_delta_rule as ref_gdn
from dualkv_compile.kernels.recurrent import forest_mamba2_scan as ref_mamba2, forest_selective_scan as ref_mamba1
from dualkv_compile.layout.segments import previous_token_index
from dualkv_compile.ops.forest_recurrent import forest_causal_conv1d, forest_gated_delta_rule, forest_mamba2_scan
from dualkv_compile.ops.forest_recurrent import forest_selective_scan
from ..kernels.segments import forest_segments, small_forest

GDN_IMPL = "transformers.models.qwen3_next.modeling_qwen3_next.torch_chunk_gated_delta_rule"  # the torch reference runs
FORESTS = [([5], [-1]), ([2, 1, 1, 5, 3], [-1, 0, 1, 1, 0])] + [small_forest(seed, 40, 9) for seed in (1, 4, 7)]


def _segs_args(segs):
    return segs.seg_start, segs.seg_len, segs.parent, segs.prefix_len, segs.subtree_end


def _gdn_inputs(T, seed, Hk=2, Hv=4, D=4):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, T, Hk, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(1, T, Hv, D, generator=g, dtype=torch.float64, requires_grad=True)
    decay = (-torch.rand(1, T, Hv, generator=g, dtype=torch.float64)).requires_grad_()
    beta = torch.rand(1, T, Hv, generator=g, dtype=torch.float64, requires_grad=True)
    return [q, k, v, decay, beta]


@pytest.mark.parametrize("chunk", [0, 4])
@pytest.mark.parametrize("forest", FORESTS, ids=lambda f: f"{len(f[0])}nodes")
def test_gated_delta_op_is_the_reference_and_its_autograd(forest, chunk):
    segs, T = forest_segments(*forest)
    xs = _gdn_inputs(T, seed=len(forest[0]))
    out = forest_gated_delta_rule(*xs, *_segs_args(segs), chunk, True, GDN_IMPL)
    want = ref_gdn(*xs, segs, use_qk_l2norm=True, chunk_size=chunk or None)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    got = torch.autograd.grad((out * w).sum(), xs)
    exp = torch.autograd.grad((want * w).sum(), xs)
    for name, a, b in zip(("q", "k", "v", "g", "beta"), got, exp):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_gated_delta_op_registrations():
    """torch.library.opcheck: schema, fake implementation, autograd, AOT dispatch."""
    segs, T = forest_segments(*FORESTS[1])
    xs = [x.detach().float().requires_grad_() for x in _gdn_inputs(T, seed=0)]
    torch.library.opcheck(forest_gated_delta_rule, (*xs, *_segs_args(segs), 4, True, GDN_IMPL))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("forest", FORESTS, ids=lambda f: f"{len(f[0])}nodes")
def test_causal_conv_along_prev_index_is_the_reference(forest, bias):
    segs, T = forest_segments(*forest)
    g = torch.Generator().manual_seed(T)
    C, K = 5, 4  # K - 1 = 3 reaches past one-token parents into grandparents
    x = torch.randn(1, C, T, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, 1, K, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(C, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    out = forest_causal_conv1d(x, w, b, previous_token_index(segs, T))
    want = ref_conv(x, w.reshape(C, K), b, segs)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    leaves = [x, w] + ([b] if bias else [])
    wt = torch.randn(out.shape, generator=g, dtype=out.dtype)
    for a, e in zip(torch.autograd.grad((out * wt).sum(), leaves), torch.autograd.grad((want * wt).sum(), leaves)):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def _mamba2_inputs(T, seed, dtype=torch.float64, H=4, P=3, G=2, N=4, with_d=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, H, P, generator=g, dtype=dtype)
    dt = torch.randn(1, T, H, generator=g, dtype=dtype)
    A = -torch.rand(H, generator=g, dtype=dtype) - 0.5
    B, C = (torch.randn(1, T, G, N, generator=g, dtype=dtype) for _ in range(2))
    D, bias = (torch.randn(H, generator=g, dtype=dtype) if with_d else None for _ in range(2))
    return [t if t is None else t.requires_grad_() for t in (x, dt, A, B, C, D, bias)]


@pytest.mark.parametrize("with_d", [True, False], ids=["D_and_dt_bias", "neither"])
@pytest.mark.parametrize("chunk", [0, 4])
@pytest.mark.parametrize("forest", FORESTS, ids=lambda f: f"{len(f[0])}nodes")
def test_mamba2_op_is_the_reference_and_its_autograd(forest, chunk, with_d):
    segs, T = forest_segments(*forest)
    xs = _mamba2_inputs(T, seed=len(forest[0]), with_d=with_d)
    x, dt, A, B, C, D, bias = xs
    limit = (0.0, 3.0)  # a binding upper clamp: the packed op must apply it as the layer does
    out = forest_mamba2_scan(*xs, *_segs_args(segs), chunk, True, *limit)
    want = ref_mamba2(x, dt, A, B, C, segs, D=D, dt_bias=bias, dt_softplus=True, dt_limit=limit,
                      chunk_size=chunk or None)
    # transformers' dtype: float32 (it upcasts x), D's where D is wider; the reference computes in x's (float64).
    assert out.dtype == (torch.float64 if with_d else torch.float32) and out.is_contiguous()
    want = want.to(out.dtype)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    leaves = [t for t in xs if t is not None]
    for a, b in zip(torch.autograd.grad((out * w).sum(), leaves), torch.autograd.grad((want * w).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_mamba2_op_returns_float32_for_half_inputs():
    """transformers' scan upcasts to float32 and returns it; the packed form must hand the next op the same dtype."""
    segs, T = forest_segments(*FORESTS[1])
    xs = [t.detach().to(torch.bfloat16) for t in _mamba2_inputs(T, seed=0)]
    assert forest_mamba2_scan(*xs, *_segs_args(segs), 4, True, 0.0, float("inf")).dtype == torch.float32


@pytest.mark.parametrize("with_d", [True, False], ids=["D_and_dt_bias", "neither"])
def test_mamba2_op_registrations(with_d):
    """torch.library.opcheck: schema, fake implementation, autograd, AOT dispatch."""
    segs, T = forest_segments(*FORESTS[1])
    xs = [t if t is None else t.detach().float().requires_grad_() for t in _mamba2_inputs(T, seed=0, with_d=with_d)]
    torch.library.opcheck(forest_mamba2_scan, (*xs, *_segs_args(segs), 4, True, 0.0, float("inf")))


def _mamba1_inputs(T, seed, dtype=torch.float64, Dc=5, N=3, full=True):
    g = torch.Generator().manual_seed(seed)
    x, dt = (torch.randn(1, Dc, T, generator=g, dtype=dtype) for _ in range(2))
    A = -torch.rand(Dc, N, generator=g, dtype=dtype) - 0.5
    B, C = (torch.randn(1, N, T, generator=g, dtype=dtype) for _ in range(2))
    D = torch.randn(Dc, generator=g, dtype=dtype) if full else None
    z = torch.randn(1, Dc, T, generator=g, dtype=dtype) if full else None
    bias = torch.randn(Dc, generator=g, dtype=dtype) if full else None
    return [t if t is None else t.requires_grad_() for t in (x, dt, A, B, C, D, z, bias)]


@pytest.mark.parametrize("full", [True, False], ids=["D_z_bias", "neither"])
@pytest.mark.parametrize("forest", FORESTS, ids=lambda f: f"{len(f[0])}nodes")
def test_mamba1_op_is_the_reference_and_its_autograd(forest, full):
    segs, T = forest_segments(*forest)
    xs = _mamba1_inputs(T, seed=len(forest[0]), full=full)
    x, dt, A, B, C, D, z, bias = xs
    out = forest_selective_scan(*xs, *_segs_args(segs), True)
    want = ref_mamba1(x, dt, A, B, C, segs, D=D, z=z, delta_bias=bias, delta_softplus=True)
    assert out.dtype == torch.float64 and out.is_contiguous()
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    leaves = [t for t in xs if t is not None]
    for a, b in zip(torch.autograd.grad((out * w).sum(), leaves), torch.autograd.grad((want * w).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("full", [True, False], ids=["D_z_bias", "neither"])
def test_mamba1_op_registrations(full):
    """torch.library.opcheck: schema, fake implementation, autograd, AOT dispatch."""
    segs, T = forest_segments(*FORESTS[1])
    xs = [t if t is None else t.detach().float().requires_grad_() for t in _mamba1_inputs(T, seed=0, full=full)]
    torch.library.opcheck(forest_selective_scan, (*xs, *_segs_args(segs), True))


def test_gated_delta_op_with_a_decay_per_key_channel():
    """Kimi's KDA through the same op: g ``[1, T, H, Dk]``; the reference and its autograd, and opcheck."""
    segs, T = forest_segments(*FORESTS[2])
    q, k, v, _, beta = _gdn_inputs(T, seed=3, Hk=4, Hv=4)
    g = (-torch.rand(1, T, 4, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)).requires_grad_()
    xs = [q, k, v, g, beta]
    out = forest_gated_delta_rule(*xs, *_segs_args(segs), 4, True, GDN_IMPL)
    want = ref_gdn(*xs, segs, use_qk_l2norm=True, chunk_size=4)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    for a, b in zip(torch.autograd.grad((out * w).sum(), xs), torch.autograd.grad((want * w).sum(), xs)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.library.opcheck(forest_gated_delta_rule, (*(x.detach().float().requires_grad_() for x in xs),
                                                    *_segs_args(segs), 4, True, GDN_IMPL))
