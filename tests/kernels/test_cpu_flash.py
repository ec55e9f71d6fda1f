"""The CPU flash-attention backend against the exact float64 reference.

Layouts are Segments built directly: random two-level groups (a prompt and
its responses, some empty), hand-written prefix forests and random forests
(depth 1 to 3, several roots, one-token and empty nodes). float64 runs in
float64 throughout (exact to rounding), float32 is the tight float32 check
and bf16 the loose one.
"""

from __future__ import annotations

import random

import pytest
import torch

from dualkv_compile.kernels import cpu_flash, reference
from dualkv_compile.ops.attention import shared_prompt_attention
from flex_layouts import FIXED_FORESTS  # tests/kernels is on sys.path
from segments import forest_segments, make_segments, random_forest  # tests/kernels is on sys.path


def random_layout(seed):
    """Two-level groups: 1-3 prompts of 1-39 tokens, each with 1-5 responses of 0-29 tokens."""
    g = torch.Generator().manual_seed(seed)

    def rand(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    groups = [(rand(1, 40), [rand(0, 30) for _ in range(rand(1, 6))]) for _ in range(rand(1, 4))]
    return make_segments(groups)


def random_forest_layout(seed):
    rng = random.Random(seed)
    return forest_segments(*random_forest(rng, max_depth=1 + seed % 3, max_len=30))


def within(a, b, tol):
    """Relative Frobenius error at most ``tol``, absolute below norm 1 (a one-token stream has dq = 0; inputs are O(1))."""
    err = (a.double() - b.double()).norm().item()
    return err <= tol * max(b.double().norm().item(), 1.0)


def _check(segs, T, seed, dtype, tol):
    g = torch.Generator().manual_seed(seed)
    hq, hkv, D = [(4, 2, 16), (2, 2, 32), (8, 2, 64)][seed % 3]
    q, k, v = (torch.randn(1, h, T, D, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(1, hq, T, D, generator=g)
    scale = D**-0.5
    ref_out, ref_lse = reference.reference_forward(q.double(), k.double(), v.double(), segs, scale)
    ref_grads = reference.reference_backward(dout.double(), q.double(), k.double(), v.double(), None, None, segs, scale)
    out, lse = cpu_flash.forward(q.to(dtype), k.to(dtype), v.to(dtype), segs, scale)
    grads = cpu_flash.backward(dout.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype), out, lse, segs, scale)
    assert out.dtype == dtype and lse.dtype == torch.promote_types(dtype, torch.float32)
    assert within(out, ref_out, tol)
    assert within(lse, ref_lse, tol)
    for name, a, b in zip("qkv", grads, ref_grads):
        assert a.dtype == dtype
        assert within(a, b, tol), name


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_matches_float64_reference(seed, dtype, tol):
    _check(*random_layout(seed), seed, dtype, tol)


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_random_forest_matches_float64_reference(seed, dtype, tol):
    _check(*random_forest_layout(seed), seed, dtype, tol)


@pytest.mark.parametrize("forest", range(len(FIXED_FORESTS)))
def test_fixed_forest_matches_float64_reference(forest):
    lens, parents = FIXED_FORESTS[forest]
    _check(*forest_segments([min(n, 70) for n in lens], parents), forest, torch.float32, 1e-5)


def test_through_the_op():
    segs, T = random_forest_layout(5)
    q, k, v = (torch.randn(1, h, T, 16, requires_grad=True) for h in (4, 2, 2))
    out = shared_prompt_attention(q, k, v, segs, backend="cpu_flash")
    out.square().sum().backward()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = shared_prompt_attention(qd, kd, vd, segs, backend="reference")
    ref.square().sum().backward()
    assert within(out, ref, 1e-5)
    for a, b in ((q, qd), (k, kd), (v, vd)):
        assert within(a.grad, b.grad, 1e-5)


def test_refuses_what_it_cannot_run():
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        assert cpu_flash.supports(torch.zeros(1, dtype=dtype)) is None
    assert cpu_flash.supports(torch.zeros(1, dtype=torch.int32)) is not None
