"""Tests of the exact reference attention on the packed stream (kernels/reference.py).

The main check runs the packed reference against ordinary causal attention
over each sequence of a prefix forest, written independently here: every
root-to-leaf path of segments is one sequence, its tokens the concatenation
of the path's segments, and a per-path loop with an explicit causal mask and
softmax gives its output. In float64, outputs and log-sum-exps at every row
of every path, and dq/dk/dv (each row's upstream gradient given to one path,
the paths' gradients summed back onto the packed tokens by autograd through
the gather), agree to 1e-10. Layouts are Segments built directly from
(seg_len, parent) lists: the layout's own detection and packing are tested
with the layout (tests/layout).
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dualkv_compile.kernels.reference import (
    attention_with_mask,
    check_qkv,
    reference_backward,
    reference_forward,
    shared_prompt_attention,
)
from dualkv_compile.layout.segments import dense_mask
from dualkv_compile.ops import attention as op
from segments import forest_segments, make_segments, random_forest  # tests/kernels is on sys.path

TOL = dict(rtol=1e-10, atol=1e-10)


pytestmark = pytest.mark.usefixtures("one_thread")


def _layout(segs, T):
    """What reference.shared_prompt_attention reads of a layout."""
    return SimpleNamespace(num_tokens=T, attention_segments=segs)


# --------------------------------------------------------------------------- the per-sequence oracle


def forest_paths(seg_len, parent):
    """Packed token indices of every root-to-leaf path (a leaf: a segment with no children), in pre-order."""
    starts = [sum(seg_len[:i]) for i in range(len(seg_len))]
    has_child = {p for p in parent if p >= 0}
    paths = []
    for leaf in (i for i in range(len(seg_len)) if i not in has_child):
        chain, i = [], leaf
        while i != -1:
            chain.append(i)
            i = parent[i]
        paths.append([t for j in reversed(chain) for t in range(starts[j], starts[j] + seg_len[j])])
    return paths


def causal_attention(q, k, v, scale):
    """One sequence: q [Hq, n, D], k and v [Hkv, n, D]; returns out [Hq, n, D], lse [Hq, n]. Head h reads h // (Hq // Hkv)."""
    Hq, n, _ = q.shape
    heads = torch.arange(Hq) // (Hq // k.shape[0])
    scores = (q @ k[heads].transpose(-1, -2)) * scale
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
    return torch.softmax(scores, -1) @ v[heads], torch.logsumexp(scores, -1)


def per_path_oracle(q, k, v, dout, seg_len, parent, scale):
    """``([(row_index, out_rows, lse_rows)], (dq, dk, dv))`` of the packed stream, one sequence per path.

    Every path gives the rows of each of its tokens (returned for comparison);
    the packed gradients are those of sum over paths of <dout, out_path>, each
    packed row's dout counted in the first path through it (a row's output is
    the same in every path through it, so this is the packed stream's loss).
    """
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    T = q.shape[2]
    owner = torch.full((T,), -1)
    rows, loss = [], 0.0
    for n, path in enumerate(forest_paths(seg_len, parent)):
        if not path:
            continue
        idx = torch.tensor(path, dtype=torch.long)
        owner[idx[owner[idx] < 0]] = n
        o, l = causal_attention(qg[0][:, idx], kg[0][:, idx], vg[0][:, idx], scale)
        rows.append((idx, o.detach(), l.detach()))
        loss = loss + (o * dout[0][:, idx] * (owner[idx] == n)[None, :, None]).sum()
    grads = torch.autograd.grad(loss, (qg, kg, vg), allow_unused=True) if T else (None, None, None)
    grads = tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v)))
    return rows, grads


def _compare_with_oracle(seg_len, parent, hkv, ratio, d, scale, seed):
    segs, T = forest_segments(seg_len, parent)
    hq = hkv * ratio
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, T, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    dout = torch.randn(1, hq, T, d, generator=g, dtype=torch.float64)
    sc = 1 / math.sqrt(d) if scale is None else scale
    rows, expected = per_path_oracle(q, k, v, dout, seg_len, parent, sc)

    qp, kp, vp = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = reference_forward(qp, kp, vp, segs, scale)
    assert out.shape == (1, hq, T, d) and lse.shape == (1, hq, T)
    seen = torch.zeros(T, dtype=torch.bool)
    for idx, o, l in rows:
        torch.testing.assert_close(out[0][:, idx].detach(), o, **TOL)
        torch.testing.assert_close(lse[0][:, idx], l, **TOL)
        seen[idx] = True
    assert seen.all()  # every packed token lies on some path
    if T == 0:
        return
    got = torch.autograd.grad(out, (qp, kp, vp), dout)
    for name, a, b in zip("qkv", got, expected):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"d{name}: {m}")
    # The explicit backward of the reference (what the op's backward calls) agrees too.
    manual = reference_backward(dout, q, k, v, None, None, segs, sc)
    for name, a, b in zip("qkv", manual, expected):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"reference_backward d{name}: {m}")


@st.composite
def forests(draw, max_depth=3, max_len=5, max_children=3, max_roots=3):
    """A prefix forest in pre-order, ``(seg_len, parent)``: empty and one-token nodes likely."""
    lens, parents = [], []

    def grow(p, depth):
        me = len(lens)
        lens.append(draw(st.integers(0, max_len)))
        parents.append(p)
        if depth < max_depth:
            for _ in range(draw(st.integers(0, max_children))):
                grow(me, depth + 1)

    for _ in range(draw(st.integers(1, max_roots))):
        grow(-1, 1)
    return lens, parents


@settings(max_examples=200, deadline=None)
@given(
    forest=forests(),
    hkv=st.integers(1, 2),
    ratio=st.integers(1, 3),
    d=st.sampled_from([1, 3, 4]),
    scale=st.sampled_from([None, 0.7]),
    seed=st.integers(0, 2**16),
)
def test_matches_per_sequence_attention(forest, hkv, ratio, d, scale, seed):
    _compare_with_oracle(*forest, hkv, ratio, d, scale, seed)


@pytest.mark.parametrize("seed", range(8))
def test_random_forest_matches_per_sequence_attention(seed):
    """Larger random forests (depth 1 to 3, several roots, one-token nodes) from the shared helper."""
    rng = random.Random(seed)
    lens, parents = random_forest(rng, max_depth=1 + seed % 3, max_len=12)
    _compare_with_oracle(lens, parents, 2, 2, 4, None, seed)


# --------------------------------------------------------------------------- hand-computed


def test_one_softmax_over_all_ancestors_by_hand():
    # Root of 2 tokens, a child of 1, two grandchildren of 1 each: T = 5.
    segs, T = forest_segments([2, 1, 1, 1], [-1, 0, 1, 1])
    q = torch.zeros(1, 1, T, 1, dtype=torch.float64)  # all scores 0: uniform over what each token sees
    k = torch.randn(1, 1, T, 1, dtype=torch.float64)
    v = torch.tensor([3.0, 6.0, 9.0, 30.0, 60.0], dtype=torch.float64).view(1, 1, T, 1)
    out, lse = shared_prompt_attention(q, k, v, _layout(segs, T))
    # Token 3 sees {0, 1, 2, 3}: one softmax over the whole chain and itself (not normalised per segment).
    assert out.flatten().tolist() == pytest.approx([3.0, 4.5, 6.0, 12.0, 19.5], abs=1e-12)
    assert lse.flatten().tolist() == pytest.approx([0.0, math.log(2), math.log(3), math.log(4), math.log(4)], abs=1e-12)
    assert lse.dtype == torch.float64 and out.dtype == torch.float64


def test_single_row_equals_plain_causal_sdpa():
    segs, T = forest_segments([5], [-1])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, T, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out, _ = reference_forward(q, k, v, segs)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), **TOL)


def test_chain_equals_plain_causal_sdpa():
    # A chain of segments is one sequence split into nodes.
    segs, T = forest_segments([3, 1, 4, 2], [-1, 0, 1, 2])
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, T, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out, _ = reference_forward(q, k, v, segs)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), **TOL)


def test_gqa_convention_matches_sdpa_enable_gqa():
    # Query head h reads KV head h // (Hq // Hkv), as in SDPA(enable_gqa=True) and HF's repeat_kv.
    segs, T = forest_segments([6], [-1])
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 6, T, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, T, 4, generator=g, dtype=torch.float64) for _ in range(2))
    out, _ = reference_forward(q, k, v, segs)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected, **TOL)
    mha, _ = reference_forward(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), segs)
    torch.testing.assert_close(out, mha, **TOL)


def test_scale():
    segs, T = make_segments([(2, [2, 2])])
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, T, 8, generator=g, dtype=torch.float64) for _ in range(3))
    default, _ = reference_forward(q, k, v, segs)
    explicit, _ = reference_forward(q, k, v, segs, scale=1 / math.sqrt(8))
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)
    scaled, _ = reference_forward(q, k, v, segs, scale=0.3)
    unit, _ = reference_forward(q * 0.3, k, v, segs, scale=1.0)
    torch.testing.assert_close(scaled, unit, **TOL)
    assert not torch.allclose(scaled, default)


def test_reference_forward_takes_segments():
    segs, T = forest_segments([2, 2, 1, 2], [-1, 0, 1, 0])
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, T, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out, lse = shared_prompt_attention(q, k, v, _layout(segs, T), scale=0.5)
    out2, lse2 = reference_forward(q, k, v, segs, 0.5)
    out3, lse3 = attention_with_mask(q, k, v, dense_mask(segs, T), 0.5)
    for a, b in ((out, out2), (lse, lse2), (out, out3), (lse, lse3)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_empty_stream():
    segs, T = forest_segments([], [])
    q = torch.randn(1, 2, 0, 4)
    out, lse = shared_prompt_attention(q, q, q, _layout(segs, T))
    assert out.shape == (1, 2, 0, 4) and lse.shape == (1, 2, 0)


# --------------------------------------------------------------------------- bad input


def test_check_qkv_errors():
    segs, T = make_segments([(2, [1, 1])])  # T = 4
    L = _layout(segs, T)
    good = torch.zeros(1, 4, 4, 8)
    kv = torch.zeros(1, 2, 4, 8)
    shared_prompt_attention(good, kv, kv, L)
    cases = [
        ((torch.zeros(4, 4, 8), kv, kv), r"q must have shape \[1, H, T, D\] with T=4, got \[4, 4, 8\]"),
        ((torch.zeros(2, 4, 4, 8), kv, kv), r"q must have shape \[1, H, T, D\]"),
        ((torch.zeros(1, 4, 5, 8), kv, kv), r"q must have shape .*T=4, got \[1, 4, 5, 8\]"),
        ((good, torch.zeros(1, 2, 3, 8), kv), r"k must have shape .*T=4"),
        ((good, kv, torch.zeros(1, 2, 3, 8)), r"v must have shape .*T=4"),
        ((good, kv, torch.zeros(1, 1, 4, 8)), r"k and v must have the same shape"),
        ((good, torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4)), r"head dim"),
        ((good, torch.zeros(1, 3, 4, 8), torch.zeros(1, 3, 4, 8)), r"multiple of k's heads \(3\)"),
        ((good, kv.double(), kv.double()), r"dtype"),
    ]
    for args, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            shared_prompt_attention(*args, L)
        with pytest.raises(ValueError, match=pattern):
            check_qkv(*args, 4)


# --------------------------------------------------------------------------- gradcheck, dtypes, op


def _small_segments():
    # Two trees: a depth-3 one (an empty node, a one-token node, siblings) and a lone root.
    return forest_segments([2, 1, 2, 0, 1, 2], [-1, 0, 1, 0, 3, -1])


def _qkv(T, hq, hkv, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, T, d, generator=g, dtype=torch.float64).to(dtype) for h in (hq, hkv, hkv))


def test_gradcheck_reference():
    segs, T = _small_segments()
    q, k, v = (t.requires_grad_() for t in _qkv(T, 4, 2, 3))
    assert torch.autograd.gradcheck(lambda *a: reference_forward(*a, segs, scale=0.8), (q, k, v))
    assert torch.autograd.gradgradcheck(lambda *a: reference_forward(*a, segs)[0], (q, k, v))


def test_gradcheck_op_reference_backend():
    segs, T = _small_segments()
    q, k, v = (t.requires_grad_() for t in _qkv(T, 4, 2, 3, seed=1))
    f = lambda *a: op.shared_prompt_attention(*a, segs, backend="reference")  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v))
    assert torch.autograd.gradcheck(lambda *a: op.shared_prompt_attention(*a, segs, scale=0.3, backend="reference"), (q, k, v))
    # Same values as the reference itself, forward and backward.
    out = f(q, k, v)
    ref, _ = reference_forward(q, k, v, segs)
    torch.testing.assert_close(out, ref, **TOL)
    dout = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_dtypes_use_fp32_softmax(dtype):
    # A long shared prompt and large, similar scores: a softmax in bf16/fp16
    # would be off by many units in the last place; computing in fp32 and
    # rounding once at the end keeps the output within one.
    segs, T = make_segments([(96, [1, 1, 1])])
    q, k, v = _qkv(T, 4, 2, 16, seed=2)
    q = q * 3
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out, lse = reference_forward(q, k, v, segs)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref, ref_lse = reference_forward(q.double(), k.double(), v.double(), segs)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    else:
        ulp = torch.finfo(dtype).eps  # spacing at 1: at least one unit in the last place of |ref| >= 1 ... and of smaller values
        err = (out.double() - ref).abs()
        assert (err <= ulp * ref.abs() + 1e-5).all(), float((err - ulp * ref.abs()).max())
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-5)
    # Gradients flow in the input dtype.
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    reference_forward(q, k, v, segs)[0].float().sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == dtype
    b_q, b_k, b_v = reference_backward(torch.ones_like(out), q.detach(), k.detach(), v.detach(), None, None, segs)
    assert b_q.dtype == b_k.dtype == b_v.dtype == dtype


def test_shared_key_gradient_keeps_float32_precision_over_thousands_of_readers():
    # Issue 35, defect 5: a 2-token prompt read by 4,096 two-token responses. Each prompt key's dK and dV sum
    # 8,194 per-query terms; in float32 they must still come out within a few units in the last place of float64
    # truth (the same float32 inputs, computed in float64), whatever the number of readers. One float32 matmul
    # over all queries (the reference before the fix) was off by 19 (dK) and 25 (dV) units of 2^-24 here; 2 and 1.5 after.
    segs, T = make_segments([(2, [2] * 4096)])
    q, k, v, dout = (t.float() for t in _qkv(T, 1, 1, 8, seed=3) + _qkv(T, 1, 1, 8, seed=4)[:1])
    _, dk, dv = reference_backward(dout, q, k, v, None, None, segs)
    _, dk64, dv64 = reference_backward(dout.double(), q.double(), k.double(), v.double(), None, None, segs)
    bound = 8 * 2.0**-24  # eight units of float32's relative rounding
    for name, got, truth in (("dk", dk, dk64), ("dv", dv, dv64)):
        err = (got[0, :, :2].double() - truth[0, :, :2]).norm() / truth[0, :, :2].norm()
        assert err <= bound, (name, err.item(), bound)
