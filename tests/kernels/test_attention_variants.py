"""Attention variants on the reference and CPU flash backends: Gemma 2's logit softcap and MLA head dims.

The reference (kernels/reference.py) is checked against a per-sequence
oracle written here: every root-to-leaf path of a prefix forest is one
sequence, attended causally with the softcap applied by hand
(``c * tanh(scale * q.k / c)`` before the mask) and differentiated by
autograd. The CPU flash backend (explicit scores for a softcap, zero-padded
head dims for MLA) is then checked against the float64 reference. MLA here:
q/k head dim 24, v head dim 16 (DeepSeek-V3's 192 and 128, scaled down).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from dualkv_compile.kernels import cpu_flash, reference
from dualkv_compile.kernels.head_dims import common_head_dim, pad_head_dim
from segments import forest_segments, random_forest  # tests/kernels is on sys.path
from window_oracle import paths as _paths

pytestmark = pytest.mark.usefixtures("one_thread")

# (q/k head dim, v head dim, softcap): softcaps that bind (1.0, scores of a few units) and Gemma 2's 50.
VARIANTS = [(16, 16, 1.0), (16, 16, 50.0), (24, 16, 0.0), (24, 16, 2.0), (16, 24, 0.0)]


def oracle(q, k, v, dout, lens, parents, scale, softcap):
    """``(out, dq, dk, dv)`` of the packed stream, each root-to-leaf path attended on its own (float64, autograd)."""
    qg, kg, vg = (t.detach().double().requires_grad_() for t in (q, k, v))
    T, groups = q.shape[2], q.shape[1] // k.shape[1]
    out = torch.zeros(1, q.shape[1], T, v.shape[-1], dtype=torch.float64)
    owner = torch.full((T,), -1)
    loss = 0.0
    for n, path in enumerate(_paths(lens, parents)):
        idx = torch.tensor(path)
        owner[idx[owner[idx] < 0]] = n
        kk = kg[0][:, idx].repeat_interleave(groups, 0)
        s = (qg[0][:, idx] @ kk.transpose(-1, -2)) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~torch.ones(len(path), len(path), dtype=torch.bool).tril(), -math.inf)
        o = torch.softmax(s, -1) @ vg[0][:, idx].repeat_interleave(groups, 0)
        out[0][:, idx] = o.detach()
        loss = loss + (o * dout[0][:, idx].double() * (owner[idx] == n)[None, :, None]).sum()
    return (out, *torch.autograd.grad(loss, (qg, kg, vg)))


def _inputs(T, D, Dv, seed, hq=4, hkv=2):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, h, T, D, generator=g, dtype=torch.float64) for h in (hq, hkv))
    v = torch.randn(1, hkv, T, Dv, generator=g, dtype=torch.float64)
    return 2 * q, k, v, torch.randn(1, hq, T, Dv, generator=g, dtype=torch.float64)  # scores of a few units


def _forest(seed):
    return random_forest(random.Random(seed), max_depth=1 + seed % 3, max_len=12, max_children=3)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("D, Dv, softcap", VARIANTS)
def test_reference_matches_per_sequence_oracle(seed, D, Dv, softcap):
    lens, parents = _forest(seed)
    segs, T = forest_segments(lens, parents)
    q, k, v, dout = _inputs(T, D, Dv, seed)
    out, *grads = oracle(q, k, v, dout, lens, parents, 0.3, softcap)
    ref_out, lse = reference.reference_forward(q, k, v, segs, 0.3, softcap)
    assert ref_out.shape == (1, 4, T, Dv)
    assert rel(ref_out, out) < 1e-12
    for name, a, b in zip("qkv", reference.reference_backward(dout, q, k, v, None, None, segs, 0.3, softcap=softcap), grads):
        assert a.shape == b.shape and rel(a, b) < 1e-12, name


def test_reference_softcap_gradcheck():
    segs, T = forest_segments([3, 2, 2, 0, 1], [-1, 0, 0, -1, 3])
    q, k, v, _ = _inputs(T, 3, 2, seed=5, hq=2, hkv=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda *a: reference.reference_forward(*a, segs, 0.8, 1.5), (q, k, v))


def test_softcap_changes_the_result_and_tends_to_none():
    """A binding cap changes the output; a huge one is the uncapped attention (nothing is silently dropped)."""
    segs, T = forest_segments(*_forest(1))
    q, k, v, _ = _inputs(T, 16, 16, seed=1)
    plain, _ = reference.reference_forward(q, k, v, segs, 0.3)
    assert rel(reference.reference_forward(q, k, v, segs, 0.3, 1.0)[0], plain) > 1e-2
    assert rel(reference.reference_forward(q, k, v, segs, 0.3, 1e6)[0], plain) < 1e-9


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("D, Dv, softcap", VARIANTS)
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_flash_matches_reference(seed, D, Dv, softcap, dtype, tol):
    segs, T = forest_segments(*_forest(seed + 10))
    q, k, v, dout = _inputs(T, D, Dv, seed)
    ref_out, ref_lse = reference.reference_forward(q, k, v, segs, 0.3, softcap)
    ref_grads = reference.reference_backward(dout, q, k, v, None, None, segs, 0.3, softcap=softcap)
    x = [t.to(dtype) for t in (q, k, v, dout)]
    out, lse = cpu_flash.forward(*x[:3], segs, 0.3, softcap)
    assert out.shape == (1, 4, T, Dv) and out.dtype == dtype
    assert rel(out, ref_out) < tol and rel(lse, ref_lse) < tol
    grads = cpu_flash.backward(x[3], *x[:3], out, lse, segs, 0.3, softcap=softcap)
    for name, a, b in zip("qkv", grads, ref_grads):
        assert a.shape == b.shape and a.dtype == dtype, name
        assert rel(a, b) < tol, (name, rel(a, b))


def test_head_dim_padding_helpers():
    q, v = torch.randn(1, 2, 5, 24), torch.randn(1, 1, 5, 16)
    assert common_head_dim(q, v) == 24 and pad_head_dim(q, 24) is q
    p = pad_head_dim(v, 24)
    assert p.shape == (1, 1, 5, 24) and torch.equal(p[..., :16], v) and not p[..., 16:].any()
