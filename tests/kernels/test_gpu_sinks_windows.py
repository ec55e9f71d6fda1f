"""Sinks and windows on the GPU backends through the op, against the per-sequence float64 oracle.

Every GPU backend that ``supports`` sinks or a window runs them here in bf16 at head dims 64 (gpt-oss) and
128, forward and backward (the sinks' gradient too); one that does not must say so (``supports`` gives the
reason, and ``backend="auto"`` then picks one that does, never one that would drop them). CUDA only: the
tests skip elsewhere (the CPU backends are checked in ``test_windows_sinks.py``).
"""

from __future__ import annotations

import pytest
import torch

from dualkv_compile import shared_prompt_attention
from dualkv_compile.ops.attention import resolve_backend, unsupported_reason
from segments import forest_segments  # tests/kernels is on sys.path
from window_oracle import inputs, oracle, rel, windowed_forest

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BACKENDS = ["triton", "gluon", "flex"]


@cuda
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("window, chunk, with_sinks", [(0, 0, True), (37, 0, False), (37, 0, True), (0, 48, True)])
def test_gpu_backend_matches_oracle(backend, D, window, chunk, with_sinks):
    # A forest long enough for the window to bind across nodes (a seed may draw one token: every gradient but v's
    # is then zero, and a relative error against zero says nothing).
    lens, parents = next(f for f in (windowed_forest(D + window + i, max_len=90) for i in range(200))
                         if len(f[0]) > 2 and sum(f[0]) > 2 * max(window, chunk, 8) + 16)
    segs, T = forest_segments(lens, parents, "cuda")
    q, k, v, dout, sinks = inputs(T, D, D, seed=D, hq=8, hkv=2)
    probe = q.to("cuda", torch.bfloat16)
    why = unsupported_reason(backend, probe, probe, window=window, chunk=chunk, sinks=with_sinks)
    if why is not None:
        # Refused with a reason, and auto then runs a backend that implements them.
        auto = resolve_backend("auto", probe, probe, window=window, chunk=chunk, sinks=with_sinks)
        assert auto != backend and unsupported_reason(auto, probe, probe, window=window, chunk=chunk, sinks=with_sinks) is None
        pytest.skip(f"{backend}: {why}")
    s = sinks if with_sinks else None
    out, *grads, dsinks = oracle(q, k, v, dout, lens, parents, D ** -0.5, window, chunk, s)
    assert all(g.norm() > 0 for g in grads)  # a forest where q, k and v all matter
    x = [t.to("cuda", torch.bfloat16).requires_grad_() for t in (q, k, v)]
    xs = s.to("cuda", torch.float32).requires_grad_() if with_sinks else None
    o = shared_prompt_attention(*x, segs, D ** -0.5, backend=backend, window=window, chunk=chunk, sinks=xs)
    assert rel(o.float().cpu(), out) < 2e-2
    o.backward(dout.to("cuda", torch.bfloat16))
    for name, t, b in zip("qkv", x, grads):
        assert rel(t.grad.float().cpu(), b) < 2e-2, name
    if with_sinks:
        assert rel(xs.grad.cpu(), dsinks) < 2e-2
