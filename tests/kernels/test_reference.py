"""Tests of the exact reference attention on the packed stream (kernels/reference.py).

The main check runs the packed reference against ordinary causal attention
over the duplicated, padded [B, S] batch, written independently here (an
explicit per-row loop with masks and softmax), in float64: outputs at every
valid position, the log-sum-exp, and dq/dk/dv (the padded batch's gradients
summed back onto the packed tokens) agree to 1e-10.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dualkv_compile.ops import attention as op
from dualkv_compile.kernels.reference import (
    attention_with_mask,
    check_qkv,
    reference_backward,
    reference_forward,
    shared_prompt_attention,
)
from dualkv_compile.layout import detect, pack, unpack

TOL = dict(rtol=1e-10, atol=1e-10)


pytestmark = pytest.mark.usefixtures("one_thread")


def T(rows):
    return torch.tensor(rows, dtype=torch.long)


def to_kernel(x):
    """[T, H, D] -> [1, H, T, D]."""
    return x.permute(1, 0, 2).unsqueeze(0).contiguous()


def from_kernel(x):
    """[1, H, T, ...] -> [T, H, ...]."""
    return x[0].transpose(0, 1)


def dense_attention(q, k, v, mask, scale):
    """Causal attention of each row of a padded batch over its valid tokens.

    q [B, S, Hq, D], k and v [B, S, Hkv, D], mask [B, S]; returns out
    [B, S, Hq, D] (zeros at padding) and lse [B, S, Hq] (-inf at padding).
    Query head h uses KV head h // (Hq // Hkv).
    """
    B, S, Hq, D = q.shape
    r = Hq // k.shape[2]
    out = q.new_zeros(B, S, Hq, D)
    lse = q.new_full((B, S, Hq), -math.inf)
    for b in range(B):
        cols = mask[b].nonzero().flatten().tolist()
        if not cols:
            continue
        s0, e0 = cols[0], cols[-1] + 1
        n = e0 - s0
        qb = q[b, s0:e0].transpose(0, 1)  # [Hq, n, D]
        kb = k[b, s0:e0].transpose(0, 1)[torch.arange(Hq) // r]
        vb = v[b, s0:e0].transpose(0, 1)[torch.arange(Hq) // r]
        scores = (qb @ kb.transpose(-1, -2)) * scale
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, -math.inf)
        out[b, s0:e0] = (torch.softmax(scores, -1) @ vb).transpose(0, 1)
        lse[b, s0:e0] = torch.logsumexp(scores, -1).transpose(0, 1)
    return out, lse


def sum_onto_packed(x, layout):
    """Adjoint of unpack, written out: [B, S, ...] -> [T, ...], summing every valid position onto the token it reads."""
    flat = x.reshape(-1, *x.shape[2:])
    valid = layout.valid
    return x.new_zeros(layout.num_tokens, *x.shape[2:]).index_add_(0, layout.unpack_index[valid], flat[valid])


# --------------------------------------------------------------------------- hand-computed


def test_one_softmax_over_both_regions_by_hand():
    # Shared prefix of 2 tokens, two responses of 1 token each: T = 4.
    L = detect(T([[1, 2, 3], [1, 2, 4]]))
    assert L.segments() == [(0, 2, 0, 0), (2, 1, 0, 2), (3, 1, 0, 2)]
    q = torch.zeros(1, 1, 4, 1, dtype=torch.float64)  # all scores 0: uniform over what each token sees
    k = torch.randn(1, 1, 4, 1, dtype=torch.float64)
    v = torch.tensor([3.0, 6.0, 9.0, 30.0], dtype=torch.float64).view(1, 1, 4, 1)
    out, lse = shared_prompt_attention(q, k, v, L)
    # Token 2 sees {0, 1, 2}: (3 + 6 + 9) / 3 (normalising the regions apart would give (4.5 + 9) / 2).
    assert out.flatten().tolist() == pytest.approx([3.0, 4.5, 6.0, 13.0], abs=1e-12)
    assert lse.flatten().tolist() == pytest.approx([0.0, math.log(2), math.log(3), math.log(3)], abs=1e-12)
    assert lse.dtype == torch.float64 and out.dtype == torch.float64


def test_single_row_equals_plain_causal_sdpa():
    L = detect(T([[0, 1, 2, 3, 4, 5]]), T([[0, 1, 1, 1, 1, 1]]))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out, _ = shared_prompt_attention(q, k, v, L)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), **TOL)


def test_gqa_convention_matches_sdpa_enable_gqa():
    # Query head h reads KV head h // (Hq // Hkv), as in SDPA(enable_gqa=True) and HF's repeat_kv.
    L = detect(T([[1, 2, 3, 4, 5, 6]]))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 6, 6, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(2))
    out, _ = shared_prompt_attention(q, k, v, L)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected, **TOL)
    mha, _ = shared_prompt_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), L)
    torch.testing.assert_close(out, mha, **TOL)


def test_scale():
    L = detect(T([[1, 2, 3, 4], [1, 2, 5, 6]]))
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, L.num_tokens, 8, generator=g, dtype=torch.float64) for _ in range(3))
    default, _ = shared_prompt_attention(q, k, v, L)
    explicit, _ = shared_prompt_attention(q, k, v, L, scale=1 / math.sqrt(8))
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)
    scaled, _ = shared_prompt_attention(q, k, v, L, scale=0.3)
    unit, _ = shared_prompt_attention(q * 0.3, k, v, L, scale=1.0)
    torch.testing.assert_close(scaled, unit, **TOL)
    assert not torch.allclose(scaled, default)


def test_reference_forward_takes_segments():
    L = detect(T([[1, 2, 3, 4], [1, 2, 5, 6]]))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, L.num_tokens, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out, lse = shared_prompt_attention(q, k, v, L, scale=0.5)
    out2, lse2 = reference_forward(q, k, v, L.attention_segments, 0.5)
    out3, lse3 = attention_with_mask(q, k, v, L.dense_mask(), 0.5)
    for a, b in ((out, out2), (lse, lse2), (out, out3), (lse, lse3)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_empty_stream():
    L = detect(T([[0, 0], [0, 0]]), T([[0, 0], [0, 0]]))
    q = torch.randn(1, 2, 0, 4)
    out, lse = shared_prompt_attention(q, q, q, L)
    assert out.shape == (1, 2, 0, 4) and lse.shape == (1, 2, 0)


# --------------------------------------------------------------------------- bad input


def test_check_qkv_errors():
    L = detect(T([[1, 2, 3], [1, 2, 4]]))  # T = 4
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


# --------------------------------------------------------------------------- dense equivalence, randomized


@st.composite
def batches(draw, max_groups=3, max_rows=4, max_prompt=5, max_resp=4, vocab=3):
    """A veRL-style batch (left-padded prompts, right-padded responses), with
    groups of different sizes; a small vocabulary makes responses share first
    tokens by chance. Returns (input_ids, attention_mask, position_ids)."""
    groups = []
    for _ in range(draw(st.integers(1, max_groups))):
        P = draw(st.integers(0, max_prompt))
        prompt = draw(st.lists(st.integers(1, vocab), min_size=P, max_size=P))
        resps = [draw(st.lists(st.integers(1, vocab), max_size=max_resp)) for _ in range(draw(st.integers(1, max_rows)))]
        groups.append((prompt, resps))
    Pw = max(len(p) for p, _ in groups) + draw(st.integers(0, 1))
    Rw = max(len(r) for _, rs in groups for r in rs) + draw(st.integers(0, 1))
    Rw = max(Rw, 1 - Pw)
    ids, mask = [], []
    for prompt, resps in groups:
        for r in resps:
            lp, rp = Pw - len(prompt), Rw - len(r)
            ids.append([0] * lp + prompt + r + [0] * rp)
            mask.append([0] * lp + [1] * (len(prompt) + len(r)) + [0] * rp)
    ids, mask = T(ids), T(mask)
    pos = draw(st.sampled_from([None, "hf", "arange"]))
    if pos == "hf":
        pos = (mask.cumsum(1) - 1).clamp(min=0)
    elif pos == "arange":
        pos = torch.arange(ids.shape[1]).view(1, -1)
    return ids, mask, pos


@settings(max_examples=200, deadline=None)
@given(
    batch=batches(),
    hkv=st.integers(1, 2),
    ratio=st.integers(1, 3),
    d=st.sampled_from([1, 3, 4]),
    scale=st.sampled_from([None, 0.7]),
    seed=st.integers(0, 2**16),
)
def test_matches_dense_attention_over_duplicated_batch(batch, hkv, ratio, d, scale, seed):
    ids, mask, pos = batch
    B, S = ids.shape
    hq = hkv * ratio
    L = detect(ids, mask, pos)
    g = torch.Generator().manual_seed(seed)

    # q, k, v of the padded batch as functions of (token, column, position),
    # so rows that share a token at a column (and position) have the same q/k/v there,
    # as a real model's projections would.
    positions = torch.arange(S).view(1, S) if pos is None else pos
    positions = positions.expand(B, S)

    def proj(h):
        table = torch.randn(4, S, h, d, generator=g, dtype=torch.float64)
        per_pos = torch.randn(S, h, d, generator=g, dtype=torch.float64)
        return table[ids, torch.arange(S)] + 0.5 * per_pos[positions]

    qd, kd, vd = proj(hq), proj(hkv), proj(hkv)
    qd.requires_grad_(), kd.requires_grad_(), vd.requires_grad_()
    sc = 1 / math.sqrt(d) if scale is None else scale
    out_d, lse_d = dense_attention(qd, kd, vd, mask, sc)

    # Packed: the layout's stream built from the padded batch.
    qp, kp, vp = (to_kernel(pack(x.detach(), L)).requires_grad_() for x in (qd, kd, vd))
    out_p, lse_p = shared_prompt_attention(qp, kp, vp, L, scale=scale)
    assert out_p.shape == (1, hq, L.num_tokens, d) and lse_p.shape == (1, hq, L.num_tokens)

    valid = mask.bool()
    out_u = unpack(from_kernel(out_p), L)
    torch.testing.assert_close(out_u[valid], out_d[valid], **TOL)
    assert not out_u[~valid].any()  # zeros at padding
    lse_u = unpack(from_kernel(lse_p), L)
    torch.testing.assert_close(lse_u[valid], lse_d[valid], **TOL)

    # Gradients: a random upstream gradient at valid positions (padding carries none).
    dout = torch.randn(B, S, hq, d, generator=g, dtype=torch.float64) * valid[..., None, None]
    if L.num_tokens == 0:  # every row empty: nothing to differentiate
        return
    dq_d, dk_d, dv_d = torch.autograd.grad(out_d, (qd, kd, vd), dout)
    expected = [to_kernel(sum_onto_packed(x, L)) for x in (dq_d, dk_d, dv_d)]
    got = torch.autograd.grad(out_u, (qp, kp, vp), dout, retain_graph=True)
    for name, a, b in zip("qkv", got, expected):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"d{name}: {m}")
    # The explicit backward of the reference (what the op's backward calls) agrees too.
    dout_p = torch.autograd.grad(out_u, out_p, dout)[0]
    manual = reference_backward(dout_p, qp.detach(), kp.detach(), vp.detach(), None, None, L.attention_segments, sc)
    for name, a, b in zip("qkv", manual, expected):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"reference_backward d{name}: {m}")


# --------------------------------------------------------------------------- gradcheck, dtypes, op


def _small_layout():
    # Two groups (3 rows sharing a left-padded prompt, one of them with an empty
    # response; 2 rows sharing their first response token) and a row of its own.
    ids = T([[0, 5, 6, 1, 2], [0, 5, 6, 3, 0], [0, 5, 6, 0, 0], [7, 8, 9, 9, 1], [7, 8, 9, 9, 2], [4, 4, 0, 0, 0]])
    mask = T([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [0, 1, 1, 0, 0], [1] * 5, [1] * 5, [1, 1, 0, 0, 0]])
    L = detect(ids, mask)
    assert [(g.rows, g.shared_len) for g in L.groups] == [(range(0, 3), 2), (range(3, 5), 4), (range(5, 6), 2)]
    return L


def _qkv(L, hq, hkv, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, L.num_tokens, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(1, hkv, L.num_tokens, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(1, hkv, L.num_tokens, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def test_gradcheck_reference():
    L = _small_layout()
    q, k, v = (t.requires_grad_() for t in _qkv(L, 4, 2, 3))
    assert torch.autograd.gradcheck(lambda *a: shared_prompt_attention(*a, L, scale=0.8), (q, k, v))
    assert torch.autograd.gradgradcheck(lambda *a: shared_prompt_attention(*a, L)[0], (q, k, v))


def test_gradcheck_op_reference_backend():
    L = _small_layout()
    q, k, v = (t.requires_grad_() for t in _qkv(L, 4, 2, 3, seed=1))
    f = lambda *a: op.shared_prompt_attention(*a, L, backend="reference")  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v))
    assert torch.autograd.gradcheck(lambda *a: op.shared_prompt_attention(*a, L.attention_segments, scale=0.3, backend="reference"), (q, k, v))
    # Same values as the reference itself, forward and backward.
    out = f(q, k, v)
    ref, _ = shared_prompt_attention(q, k, v, L)
    torch.testing.assert_close(out, ref, **TOL)
    dout = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_dtypes_use_fp32_softmax(dtype):
    # A long shared prompt and large, similar scores: a softmax in bf16/fp16
    # would be off by many units in the last place; computing in fp32 and
    # rounding once at the end keeps the output within one.
    ids = T([[*range(1, 97), 200 + i] for i in range(3)])
    L = detect(ids)
    assert L.groups[0].shared_len == 96
    q, k, v = _qkv(L, 4, 2, 16, seed=2)
    q = q * 3
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out, lse = shared_prompt_attention(q, k, v, L)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref, ref_lse = shared_prompt_attention(q.double(), k.double(), v.double(), L)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    else:
        ulp = torch.finfo(dtype).eps  # spacing at 1: at least one unit in the last place of |ref| >= 1 ... and of smaller values
        err = (out.double() - ref).abs()
        assert (err <= ulp * ref.abs() + 1e-5).all(), float((err - ulp * ref.abs()).max())
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-5)
    # Gradients flow in the input dtype.
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    shared_prompt_attention(q, k, v, L)[0].float().sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == dtype
    b_q, b_k, b_v = reference_backward(torch.ones_like(out), q.detach(), k.detach(), v.detach(), None, None, L.attention_segments)
    assert b_q.dtype == b_k.dtype == b_v.dtype == dtype
