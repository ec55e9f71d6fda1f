"""Sliding and chunked windows and learnable sinks on the CPU backends, against the per-sequence oracle.

The reference (the dense mask by token depth) and CPU flash (its windowed root and sibling masks) against
``window_oracle.oracle`` (float64 autograd over every root-to-leaf path, windows and sinks from their
definitions), forward and backward; sinks through the op (``kernels.sinks`` around each backend), their
gradient included; head dims 64 and 128 on the op; bad windows and sinks refused with the reason.
"""

from __future__ import annotations

import pytest
import torch

from dualkv_compile import shared_prompt_attention
from dualkv_compile.kernels import cpu_flash, reference, sinks as sink_math
from dualkv_compile.layout.segments import dense_mask
from segments import forest_segments  # tests/kernels is on sys.path
from window_oracle import VARIANTS, inputs, oracle, rel, windowed_forest

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window, chunk", VARIANTS)
def test_reference_matches_oracle(seed, window, chunk):
    lens, parents = windowed_forest(seed)
    segs, T = forest_segments(lens, parents)
    q, k, v, dout, _ = inputs(T, 8, 8, seed)
    out, *grads, _ = oracle(q, k, v, dout, lens, parents, 0.3, window, chunk)
    ref_out, lse = reference.reference_forward(q, k, v, segs, 0.3, window=window, chunk=chunk)
    assert rel(ref_out, out) < 1e-12
    got = reference.reference_backward(dout, q, k, v, ref_out, lse, segs, 0.3, window=window, chunk=chunk)
    for name, a, b in zip("qkv", got, grads):
        assert rel(a, b) < 1e-12, name


def test_windows_bind():
    """On this forest every variant's window masks some key the plain forest mask allows (the tests test windows)."""
    lens, parents = windowed_forest(1)
    segs, T = forest_segments(lens, parents)
    plain = dense_mask(segs, T)
    for window, chunk in VARIANTS[1:]:
        narrowed = dense_mask(segs, T, window, chunk)
        assert (plain & ~narrowed).any() and not (narrowed & ~plain).any(), (window, chunk)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window, chunk", VARIANTS)
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_flash_matches_oracle(seed, window, chunk, softcap, dtype, tol):
    lens, parents = windowed_forest(seed + 10)
    segs, T = forest_segments(lens, parents)
    q, k, v, dout, _ = inputs(T, 8, 8, seed)
    out, *grads, _ = oracle(q, k, v, dout, lens, parents, 0.3, window, chunk, softcap=softcap)
    x = [t.to(dtype) for t in (q, k, v, dout)]
    o, lse = cpu_flash.forward(*x[:3], segs, 0.3, softcap, window=window, chunk=chunk)
    assert o.dtype == dtype and rel(o, out) < tol
    got = cpu_flash.backward(x[3], *x[:3], o, lse, segs, 0.3, softcap=softcap, window=window, chunk=chunk)
    for name, a, b in zip("qkv", got, grads):
        assert a.dtype == dtype and rel(a, b) < tol, (name, rel(a, b))


@pytest.mark.parametrize("backend", ["reference", "cpu_flash"])
@pytest.mark.parametrize("window, chunk", [(0, 0), (3, 0), (0, 4)])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_sinks_through_the_op(backend, window, chunk, dtype, tol):
    """out and every gradient (q, k, v and the sinks) with sinks, against the oracle's concatenated sink column."""
    lens, parents = windowed_forest(4)
    segs, T = forest_segments(lens, parents)
    q, k, v, dout, sinks = inputs(T, 8, 8, seed=4)
    out, *grads, dsinks = oracle(q, k, v, dout, lens, parents, 0.3, window, chunk, sinks)
    x = [t.to(dtype).requires_grad_() for t in (q, k, v, sinks)]
    o = shared_prompt_attention(*x[:3], segs, 0.3, backend=backend, window=window, chunk=chunk, sinks=x[3])
    assert rel(o, out) < tol
    o.backward(dout.to(dtype))
    for name, t, b in zip(("q", "k", "v", "sinks"), x, (*grads, dsinks)):
        assert rel(t.grad, b) < tol, (name, rel(t.grad, b))


@pytest.mark.parametrize("D", [64, 128])
def test_sinks_and_window_at_model_head_dims(D):
    """The op at gpt-oss's head dim (64) and 128, float32 on cpu_flash, through the custom op (traced: no eager path)."""
    lens, parents = [20, 7, 9, 3], [-1, 0, 0, 2]
    segs, T = forest_segments(lens, parents)
    q, k, v, dout, sinks = inputs(T, D, D, seed=D, hq=4, hkv=1)
    out, *grads, dsinks = oracle(q, k, v, dout, lens, parents, D ** -0.5, 6, 0, sinks)
    x = [t.float().requires_grad_() for t in (q, k, v, sinks)]
    f = torch.compile(lambda a, b, c, s: shared_prompt_attention(a, b, c, segs, D ** -0.5, backend="cpu_flash", window=6,
                                                                 sinks=s), backend="aot_eager", fullgraph=True,
                      dynamic=False)
    o = f(*x)
    assert rel(o, out) < 1e-5
    o.backward(dout.float())
    for name, t, b in zip(("q", "k", "v", "sinks"), x, (*grads, dsinks)):
        assert rel(t.grad, b) < 1e-5, name


def test_sinks_change_the_result():
    """A sink lowers every row's weights (nothing silently dropped); a very negative one is no sink."""
    segs, T = forest_segments([5, 3, 2], [-1, 0, 0])
    q, k, v, _, sinks = inputs(T, 8, 8, seed=2)
    plain = shared_prompt_attention(q, k, v, segs, 0.3, backend="reference")
    assert rel(shared_prompt_attention(q, k, v, segs, 0.3, backend="reference", sinks=sinks), plain) > 1e-2
    far = torch.full_like(sinks, -1e4)
    assert rel(shared_prompt_attention(q, k, v, segs, 0.3, backend="reference", sinks=far), plain) < 1e-12


def test_sink_grad_formula_matches_autograd():
    out, lse = torch.randn(1, 3, 5, 4, dtype=torch.float64), torch.randn(1, 3, 5, dtype=torch.float64)
    sinks = torch.randn(3, dtype=torch.float64, requires_grad=True)
    dout = torch.randn_like(out)
    o2, l2 = sink_math.apply_sinks(out, lse, sinks)
    (g,) = torch.autograd.grad((o2 * dout).sum(), sinks)
    assert rel(sink_math.sink_grad(dout, o2, l2, sinks.detach()), g) < 1e-12


@pytest.mark.parametrize("kw, match", [
    (dict(sinks=torch.zeros(3)), r"sinks must have shape \[4\]"),
    (dict(sinks=torch.zeros(4, 1)), r"sinks must have shape \[4\]"),
    (dict(sinks=torch.zeros(4, dtype=torch.int64)), "floating-point"),
    (dict(window=-1), "window must be an int >= 0"),
    (dict(chunk=2.5), "chunk must be an int >= 0"),
])
def test_bad_windows_and_sinks_are_refused(kw, match):
    segs, T = forest_segments([4, 2], [-1, 0])
    q, k, v, _, _ = inputs(T, 8, 8, seed=0)
    with pytest.raises(ValueError, match=match):
        shared_prompt_attention(q, k, v, segs, 0.3, **kw)
