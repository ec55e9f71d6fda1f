"""The CPU flash-attention backend against the exact float64 reference, on random layouts."""

from __future__ import annotations

import pytest
import torch

from dualkv_compile.kernels import cpu_flash, reference
from dualkv_compile.ops.attention import shared_prompt_attention
from dualkv_compile.layout import detect


def random_layout(seed):
    g = torch.Generator().manual_seed(seed)
    rows, lens = [], []
    for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
        P = int(torch.randint(1, 40, (1,), generator=g))
        prompt = torch.randint(1, 1000, (P,), generator=g)
        for _ in range(int(torch.randint(1, 6, (1,), generator=g))):
            R = int(torch.randint(0, 30, (1,), generator=g))
            rows.append(torch.cat([prompt, torch.randint(1, 1000, (R,), generator=g)]))
    S = max(len(r) for r in rows) + 2
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, 1 : 1 + len(r)] = r
        mask[b, 1 : 1 + len(r)] = 1
    return detect(ids, mask)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_matches_float64_reference(seed, dtype, tol):
    layout = random_layout(seed)
    g = torch.Generator().manual_seed(seed)
    hq, hkv, D = [(4, 2, 16), (2, 2, 32), (8, 2, 64)][seed % 3]
    T = layout.num_tokens
    q, k, v = (torch.randn(1, h, T, D, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(1, hq, T, D, generator=g)
    segs, scale = layout.attention_segments, D**-0.5
    ref_out, ref_lse = reference.reference_forward(q.double(), k.double(), v.double(), segs, scale)
    ref_grads = reference.reference_backward(dout.double(), q.double(), k.double(), v.double(), None, None, segs, scale)
    out, lse = cpu_flash.forward(q.to(dtype), k.to(dtype), v.to(dtype), segs, scale)
    grads = cpu_flash.backward(dout.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype), out, lse, segs, scale)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert rel(out, ref_out) <= tol
    assert rel(lse, ref_lse) <= tol
    for name, a, b in zip("qkv", grads, ref_grads):
        assert a.dtype == dtype
        assert rel(a, b) <= tol, name


def test_through_the_op():
    layout = random_layout(3)
    T = layout.num_tokens
    q, k, v = (torch.randn(1, h, T, 16, requires_grad=True) for h in (4, 2, 2))
    out = shared_prompt_attention(q, k, v, layout, backend="cpu_flash")
    out.square().sum().backward()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = shared_prompt_attention(qd, kd, vd, layout, backend="reference")
    ref.square().sum().backward()
    assert rel(out, ref) <= 1e-5
    for a, b in ((q, qd), (k, kd), (v, vd)):
        assert rel(a.grad, b.grad) <= 1e-5


def test_refuses_what_it_cannot_run():
    assert cpu_flash.supports(torch.zeros(1, dtype=torch.float64)) is not None
    assert cpu_flash.supports(torch.zeros(1, dtype=torch.float32)) is None
