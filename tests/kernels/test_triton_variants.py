"""The Triton kernels' attention variants against the reference: logit softcap (Gemma 2) and MLA head dims.

Under the interpreter (no CUDA) on small random forests, with the tile
configurations of test_triton_attention.py that reach the GPU code paths
(tensor descriptors, query heads split over programs, dQ by atomics). The
softcap is the kernels' compile-time ``SOFTCAP``: float32 inputs take the
polynomial-refined tanh, float16 and float64 the exp2 form alone. MLA (v's
head dim differs) runs on zero-padded operands.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dualkv_compile.kernels import reference  # noqa: E402
from dualkv_compile.kernels.triton import attention as ta  # noqa: E402
from dualkv_compile.kernels.triton.attention import Config, KernelConfig  # noqa: E402
from segments import forest_segments, random_forest  # noqa: E402  tests/kernels is on sys.path

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                       reason="no CUDA and TRITON_INTERPRET is off"),
    pytest.mark.usefixtures("one_thread"),
]

SMALL = KernelConfig(16, 16, 4, 1)
INTERP = Config(SMALL, SMALL, SMALL)
ATOMIC = Config(KernelConfig(16, 32, 4, 1), KernelConfig(32, 16, 4, 1), KernelConfig(32, 16, 4, 1), dq_mode="atomic",
                head_split=2)
TMA = Config(KernelConfig(32, 16, 4, 1, tma=True), KernelConfig(16, 32, 4, 1, tma=True, stats_tma=True),
             KernelConfig(16, 32, 4, 1, tma=True))
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(seed, D, Dv, softcap, dtype, config, deterministic=(True, False), Hq=4, Hkv=2):
    if dtype == torch.float64 and DEVICE == "cuda":
        pytest.skip("float64 runs only under the Triton interpreter")
    forest = random_forest(random.Random(seed), max_depth=3, max_len=20, max_children=2)
    (cpu_segs, T), (segs, _) = forest_segments(*forest), forest_segments(*forest, DEVICE)
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, h, T, d, generator=g, dtype=torch.float64) for h, d in ((Hq, D), (Hkv, D), (Hkv, Dv), (Hq, Dv)))
    q = 2 * q  # scores of a few units: a cap of 1 or 2 binds
    scale = 0.3
    ref_out, ref_lse = reference.reference_forward(q, k, v, cpu_segs, scale, softcap)
    ref_grads = reference.reference_backward(do, q, k, v, None, None, cpu_segs, scale, softcap=softcap)
    x = [t.to(DEVICE, dtype) for t in (q, k, v, do)]
    out, lse = ta.forward(*x[:3], segs, scale, softcap, config=config)
    tol = TOL[dtype]
    assert out.shape == (1, Hq, T, Dv) and out.dtype == dtype
    assert rel(out, ref_out) < tol, rel(out, ref_out)
    assert rel(lse, ref_lse) < min(tol, 1e-5) if dtype in (torch.float32, torch.float64) else rel(lse, ref_lse) < tol
    for det in deterministic:
        grads = ta.backward(x[3], *x[:3], out, lse, segs, scale, det, softcap, config=config)
        for name, a, r, like in zip(("dq", "dk", "dv"), grads, ref_grads, x[:3]):
            assert a.shape == like.shape and a.dtype == dtype and torch.isfinite(a).all(), name
            assert rel(a, r) < tol, (name, det, rel(a, r))


@pytest.mark.parametrize(
    "seed, dtype, softcap, config",
    [
        (0, torch.float64, 1.0, INTERP),
        (1, torch.float32, 1.0, TMA),
        (2, torch.float32, 50.0, ATOMIC),
        (3, torch.float16, 2.0, INTERP),
        (4, torch.bfloat16, 1.0, TMA),
    ],
)
def test_softcap_matches_reference(seed, dtype, softcap, config):
    check(seed, 16, 16, softcap, dtype, config)


@pytest.mark.parametrize(
    "seed, D, Dv, softcap, dtype, config",
    [
        (5, 24, 16, 0.0, torch.float64, INTERP),
        (6, 24, 16, 0.0, torch.float32, TMA),
        (7, 24, 16, 2.0, torch.float32, ATOMIC),
        (8, 16, 24, 0.0, torch.float64, INTERP),
    ],
)
def test_mla_head_dims_match_reference(seed, D, Dv, softcap, dtype, config):
    check(seed, D, Dv, softcap, dtype, config, deterministic=(True,))


def test_supports_names_mla_head_dims():
    q = torch.zeros(1, 2, 4, 16, device=DEVICE)
    assert ta.supports(q, torch.zeros(1, 1, 4, 24, device=DEVICE)) is None
    why = ta.supports(q, torch.zeros(1, 1, 4, 272, device=DEVICE))
    assert why is not None and "head dim 272" in why and "q/k 16 and v 272" in why
