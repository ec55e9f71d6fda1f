"""The recurrent references on the packed forest (kernels/recurrent) against each sequence run alone, unpacked.

Every segment's root-to-segment chain is run as one sequence through transformers' own torch function (float32:
``torch_recurrent_gated_delta_rule``, ``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``, which compute in
float32 whatever their inputs; ``causal_conv1d_fn`` in both dtypes) or, in float64, a naive per-token loop written
here from the definitions (checked against transformers' functions in float32 below). A packed token's value must
equal its value in every chain through it, each segment's final state the chain's final state; the loss weights
each root-to-leaf sequence's outputs and every segment's final state, so a shared token's gradient is the sum
over the sequences that read it. ``test_on_cuda`` (marked cuda) runs the packed calls on a GPU against the same.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from dualkv_compile.kernels.recurrent import (
    forest_causal_conv1d, forest_gated_delta_rule, forest_levels, forest_mamba2_scan, forest_selective_scan,
)
from dualkv_compile.layout import tree_segments
from segments import small_forest  # tests/kernels is on sys.path

try:
    from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi
    from transformers.models.mamba import modeling_mamba as hf_mamba
    from transformers.models.mamba2 import modeling_mamba2 as hf_mamba2
    from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen3_next
except ImportError:  # the float64 loops still run
    hf_kimi = hf_mamba = hf_mamba2 = hf_qwen3_next = None

# (seg_len, parent): one root; two roots, a one-token child; depth 3 with a chain 2 -> 1 -> 1 shorter than K-1 = 3;
# then random forests (depth 2 and 3, up to 3 roots, nodes of 1-9 tokens, one-token nodes among them).
FORESTS = [([5], [-1]), ([3, 1, 2, 4], [-1, 0, 0, -1]), ([2, 1, 1, 5, 3], [-1, 0, 1, 1, 0])]
FORESTS += [small_forest(seed, 60, 9) for seed in (0, 5, 8, 10)]
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def hf(module, name):
    if module is None or not hasattr(module, name):
        pytest.skip(f"transformers has no {name}")
    return inspect.unwrap(getattr(module, name))  # the torch path itself, not a hub kernel or fla/mamba-ssm


def chains(lens, parents):
    """Per segment: its root-to-segment-end token chain (int64) and whether it is a leaf."""
    starts = [sum(lens[:i]) for i in range(len(lens))]
    out = []
    for s in range(len(lens)):
        nodes, i = [], s
        while i != -1:
            nodes.append(i)
            i = parents[i]
        idx = [t for j in reversed(nodes) for t in range(starts[j], starts[j] + lens[j])]
        out.append((torch.tensor(idx, dtype=torch.int64), s not in parents))
    return out


def close(a, b, tol, what):
    torch.testing.assert_close(a, b.to(a.dtype), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def check(lens, parents, tensors, packed, reference, cut, axis, tol, seed=0):
    """``packed(segs, *tensors) -> (out, states or None)`` against ``reference(*cut(tensors, chain))`` per chain."""
    segs = tree_segments(lens, parents)
    mine = [t.detach().clone().requires_grad_() for t in tensors]
    theirs = [t.detach().clone().requires_grad_() for t in tensors]
    out, states = packed(segs, *mine)
    gen = torch.Generator().manual_seed(seed)
    dout = torch.zeros_like(out, dtype=torch.float64)
    dstate = None if states is None else torch.randn(states.shape, generator=gen, dtype=torch.float64)
    ref_loss = 0.0
    for s, (idx, leaf) in enumerate(chains(lens, parents)):
        r_out, r_state = reference(*cut(theirs, idx))
        close(out.index_select(axis, idx), r_out, tol, f"output of chain {s}")
        if states is not None:
            close(states[s], r_state[0], tol, f"final state of segment {s}")
            ref_loss = ref_loss + (r_state[0].double() * dstate[s]).sum()
        if leaf:
            w = torch.randn(r_out.shape, generator=gen, dtype=torch.float64)
            ref_loss = ref_loss + (r_out.double() * w).sum()
            dout.index_add_(axis, idx, w)
    loss = (out.double() * dout).sum() + (0.0 if states is None else (states.double() * dstate).sum())
    for name, a, b in zip(range(len(mine)), torch.autograd.grad(loss, mine), torch.autograd.grad(ref_loss, theirs)):
        close(a, b, tol, f"gradient of input {name}")


def on_tokens(axis, per_token):
    """cut: the per-token tensors (the first ``per_token``) gathered along ``axis`` at a chain, the others as they are."""
    return lambda ts, idx: [t.index_select(axis, idx) if i < per_token else t for i, t in enumerate(ts)]


# --- the gated delta rule ---------------------------------------------------------------------------------------

def gdn_inputs(T, dtype, seed, hk=2, hv=4, dk=4, dv=3):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(1, T, hk, dk), r(1, T, hk, dk), r(1, T, hv, dv)
    g, beta = -F.softplus(r(1, T, hv)) * 0.5, torch.sigmoid(r(1, T, hv))
    return [t.to(dtype) for t in (q, k, v, g, beta)]


def gdn_loop(q, k, v, g, beta):
    """float64, one sequence, token by token from the definition (l2-normalised q, k; scale Dk^-0.5)."""
    rep = v.shape[2] // k.shape[2]
    q, k = (x[0] * torch.rsqrt((x[0] ** 2).sum(-1, keepdim=True) + 1e-6)
            for x in (q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)))
    q = q * q.shape[-1] ** -0.5
    state = q.new_zeros(v.shape[2], k.shape[-1], v.shape[-1])
    outs = []
    for t in range(q.shape[0]):
        state = state * g[0, t].exp()[:, None, None]
        err = v[0, t] - torch.einsum("hk,hkv->hv", k[t], state)
        state = state + beta[0, t][:, None, None] * k[t][:, :, None] * err[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outs)[None], state[None]


def gdn_packed(chunk_size):
    return lambda segs, *ts: forest_gated_delta_rule(
        *ts, segs, use_qk_l2norm=True, chunk_size=chunk_size, output_final_state=True
    )


def gdn_hf(chunk_size):
    if chunk_size is None:
        fn = hf(hf_qwen3_next, "torch_recurrent_gated_delta_rule")
        return lambda *ts: fn(*ts, output_final_state=True, use_qk_l2norm_in_kernel=True)
    fn = hf(hf_qwen3_next, "torch_chunk_gated_delta_rule")
    return lambda *ts: fn(*ts, chunk_size=chunk_size, output_final_state=True, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("chunk_size", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("forest", range(len(FORESTS)))
def test_gated_delta_rule_matches_each_sequence(forest, dtype, chunk_size):
    """Grouped heads (2 q/k heads for 4 value heads) against the float64 loop; equal heads against transformers
    (its fallback takes grouped heads from 5.2x on only: ``test_grouped_heads_are_transformers_math``)."""
    lens, parents = FORESTS[forest]
    ref = gdn_loop if dtype == torch.float64 else gdn_hf(chunk_size)
    hk = 2 if dtype == torch.float64 else 4
    tensors = gdn_inputs(sum(lens), dtype, seed=forest, hk=hk)
    check(lens, parents, tensors, gdn_packed(chunk_size), ref, on_tokens(1, 5), 1, TOL[dtype], seed=forest)


@pytest.mark.parametrize("hk", [4, 2], ids=["equal_heads", "grouped_heads"])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_the_float64_loop_is_transformers_math(chunk_size, hk):
    ts = gdn_inputs(11, torch.float64, seed=5, hk=hk)
    mine = gdn_loop(*ts)
    try:
        theirs = gdn_hf(chunk_size)(*(t.float() for t in ts))
    except RuntimeError as e:  # transformers 5.17's fallback: equal heads only (its layer repeats q and k first)
        if hk == 4:
            raise
        pytest.skip(f"this transformers' GDN fallback takes equal heads only ({e})")
    for a, b in zip(mine, theirs):
        close(b, a, 1e-5, "loop vs transformers")


# --- the causal convolution -------------------------------------------------------------------------------------

def conv_inputs(T, dtype, seed, channels=3, width=4):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    return [r(1, channels, T), r(channels, width), r(channels)]


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("forest", range(len(FORESTS)))
def test_causal_conv1d_matches_each_sequence(forest, dtype, activation):
    lens, parents = FORESTS[forest]
    fn = hf(hf_qwen3_next, "causal_conv1d_fn")
    packed = lambda segs, x, w, b: (forest_causal_conv1d(x, w, b, segs, activation), None)  # noqa: E731
    ref = lambda x, w, b: (fn(x, w, b, activation=activation), None)  # noqa: E731
    tensors = conv_inputs(sum(lens), dtype, seed=forest)
    check(lens, parents, tensors, packed, ref, on_tokens(2, 1), 2, TOL[dtype], seed=forest)


def test_conv_refuses_an_empty_segment_with_children():
    segs = tree_segments([2, 0, 3], [-1, 0, 1])
    with pytest.raises(ValueError, match="empty but have children"):
        forest_causal_conv1d(torch.zeros(1, 2, 5), torch.zeros(2, 4), None, segs)


# --- the Mamba-2 scan -------------------------------------------------------------------------------------------

def ssd_inputs(T, dtype, seed, heads=4, groups=2, head_dim=3, state=2):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x, dt, B, C = r(1, T, heads, head_dim), r(1, T, heads), r(1, T, groups, state), r(1, T, groups, state)
    A, D, dt_bias = -torch.rand(heads, generator=gen, dtype=torch.float64) - 0.5, r(heads), r(heads) * 0.5
    return [t.to(dtype) for t in (x, dt, B, C, A, D, dt_bias)]


def ssd_loop(x, dt, B, C, A, D, dt_bias):
    """float64, one sequence, token by token from the definition (softplus on dt + dt_bias)."""
    dt = F.softplus(dt[0] + dt_bias).clamp(min=0.0)
    rep = x.shape[2] // B.shape[2]
    B, C = B[0].repeat_interleave(rep, 1), C[0].repeat_interleave(rep, 1)
    state = x.new_zeros(x.shape[2], x.shape[3], B.shape[-1])
    ys = []
    for t in range(x.shape[1]):
        state = (dt[t] * A).exp()[:, None, None] * state + dt[t][:, None, None] * x[0, t][:, :, None] * B[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", state, C[t]) + D[:, None] * x[0, t])
    return torch.stack(ys)[None], state[None]


def ssd_packed(chunk_size):
    return lambda segs, x, dt, B, C, A, D, dt_bias: forest_mamba2_scan(
        x, dt, A, B, C, segs, D=D, dt_bias=dt_bias, dt_softplus=True, chunk_size=chunk_size, output_final_state=True
    )


def ssd_hf():
    fn = hf(hf_mamba2, "mamba2_chunk_scan")
    return lambda x, dt, B, C, A, D, dt_bias: fn(
        x, dt, A, B, C, chunk_size=4, D=D, dt_bias=dt_bias, dt_softplus=True, return_final_states=True
    )


@pytest.mark.parametrize("chunk_size", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("forest", range(len(FORESTS)))
def test_mamba2_scan_matches_each_sequence(forest, dtype, chunk_size):
    lens, parents = FORESTS[forest]
    ref = ssd_loop if dtype == torch.float64 else ssd_hf()
    tensors = ssd_inputs(sum(lens), dtype, seed=forest)
    check(lens, parents, tensors, ssd_packed(chunk_size), ref, on_tokens(1, 4), 1, TOL[dtype], seed=forest)


def test_the_float64_ssd_loop_is_transformers_math():
    ts = ssd_inputs(11, torch.float64, seed=5)
    for a, b in zip(ssd_loop(*ts), ssd_hf()(*(t.float() for t in ts))):
        close(b, a, 1e-5, "loop vs transformers")


# --- Kimi's delta attention (a decay per key channel) ------------------------------------------------------------

def kda_inputs(T, dtype, seed, h=2, dk=4, dv=3):
    q, k, v, g, beta = gdn_inputs(T, torch.float64, seed, hk=h, hv=h, dk=dk, dv=dv)
    gen = torch.Generator().manual_seed(seed + 100)
    g = -F.softplus(torch.randn(1, T, h, dk, generator=gen, dtype=torch.float64)) * 0.5
    return [t.to(dtype) for t in (q, k, v, g, beta)]


def kda_loop(q, k, v, g, beta):
    """float64, one sequence, token by token: ``S = diag(exp(g_t)) S``, then gdn_loop's delta update."""
    q, k = (x[0] * torch.rsqrt((x[0] ** 2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    state = q.new_zeros(v.shape[2], k.shape[-1], v.shape[-1])
    outs = []
    for t in range(q.shape[0]):
        state = state * g[0, t].exp()[:, :, None]
        err = v[0, t] - torch.einsum("hk,hkv->hv", k[t], state)
        state = state + beta[0, t][:, None, None] * k[t][:, :, None] * err[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outs)[None], state[None]


def kda_hf():
    fn = hf(hf_kimi, "chunk_kimi_delta_attention")
    return lambda *ts: fn(*ts, chunk_size=4, output_final_state=True, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("forest", range(len(FORESTS)))
def test_kda_matches_each_sequence(forest, dtype):
    """The chunk size is ignored for a per-channel decay (token by token): transformers' chunked form agrees."""
    lens, parents = FORESTS[forest]
    ref = kda_loop if dtype == torch.float64 else kda_hf()
    tensors = kda_inputs(sum(lens), dtype, seed=forest)
    check(lens, parents, tensors, gdn_packed(4), ref, on_tokens(1, 5), 1, TOL[dtype], seed=forest)


def test_the_float64_kda_loop_is_transformers_math():
    ts = kda_inputs(11, torch.float64, seed=5)
    for a, b in zip(kda_loop(*ts), kda_hf()(*(t.float() for t in ts))):
        close(b, a, 1e-5, "loop vs transformers")


# --- the Mamba (v1) selective scan ------------------------------------------------------------------------------

def s6_inputs(T, dtype, seed, channels=5, state=3):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x, dt, z, B, C = r(1, channels, T), r(1, channels, T), r(1, channels, T), r(1, state, T), r(1, state, T)
    A = -torch.rand(channels, state, generator=gen, dtype=torch.float64) - 0.5
    return [t.to(dtype) for t in (x, dt, z, B, C, A, r(channels), r(channels) * 0.5)]


def s6_loop(x, dt, z, B, C, A, D, bias):
    """float64, one sequence, token by token from the definition (softplus on dt + bias, silu(z) gate)."""
    dt = F.softplus(dt[0] + bias[:, None])
    state = x.new_zeros(A.shape)
    ys = []
    for t in range(x.shape[2]):
        state = (dt[:, t, None] * A).exp() * state + dt[:, t, None] * x[0, :, t, None] * B[0, None, :, t]
        ys.append((state @ C[0, :, t] + D * x[0, :, t]) * F.silu(z[0, :, t]))
    return torch.stack(ys, dim=-1)[None], state[None]


def s6_packed(segs, x, dt, z, B, C, A, D, bias):
    return forest_selective_scan(x, dt, A, B, C, segs, D=D, z=z, delta_bias=bias, delta_softplus=True), None


def s6_hf():
    fn = hf(hf_mamba, "mamba_selective_scan")
    return lambda x, dt, z, B, C, A, D, bias: (fn(x, dt, A, B, C, D=D, z=z, delta_bias=bias, delta_softplus=True),
                                                None)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("forest", range(len(FORESTS)))
def test_mamba1_scan_matches_each_sequence(forest, dtype):
    lens, parents = FORESTS[forest]
    ref = s6_loop if dtype == torch.float64 else s6_hf()
    tensors = s6_inputs(sum(lens), dtype, seed=forest)
    check(lens, parents, tensors, s6_packed, ref, on_tokens(2, 5), 2, TOL[dtype], seed=forest)


def test_the_float64_s6_loop_is_transformers_math():
    ts = s6_inputs(11, torch.float64, seed=5)
    close(s6_hf()(*(t.float() for t in ts))[0], s6_loop(*ts)[0], 1e-5, "loop vs transformers")


# --- the schedule -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("forest", range(len(FORESTS)))
def test_a_forest_of_depth_d_is_d_levels(forest):
    lens, parents = FORESTS[forest]
    depth = {-1: 0}
    for i, p in enumerate(parents):
        depth[i] = depth[p] + 1
    levels = forest_levels(tree_segments(lens, parents), sum(lens), pad_to=4)
    assert len(levels) == max(depth.values())
    assert sorted(torch.cat([lv.segments for lv in levels]).tolist()) == list(range(len(lens)))
    assert all(lv.tokens.shape[1] % 4 == 0 for lv in levels)


def test_an_empty_leaf_keeps_its_parents_state():
    lens, parents = [3, 0, 2], [-1, 0, 0]
    ts = gdn_inputs(5, torch.float64, seed=1)
    _, states = forest_gated_delta_rule(*ts, tree_segments(lens, parents), output_final_state=True)
    assert torch.equal(states[1], states[0])


# --- any device: the packed call on CUDA against the per-sequence loops on the CPU ----------------------------

def on_cuda(packed):
    def run(segs, *ts):
        cuda_segs = tree_segments(*host_lists(segs), device="cuda")  # registers the host twin the levels read
        out, states = packed(cuda_segs, *(t.cuda() for t in ts))
        return out.cpu(), None if states is None else states.cpu()
    return run


def host_lists(segs):
    return segs.seg_len.tolist(), segs.parent.tolist()


def conv_case(segs, x, w, b):
    return forest_causal_conv1d(x, w, b, segs, "silu"), None


CUDA_CASES = {  # name: (inputs, packed, per-sequence reference, per-token inputs and their axis)
    "gdn": (gdn_inputs, gdn_packed(None), gdn_loop, 5, 1),
    "gdn_chunked": (gdn_inputs, gdn_packed(4), gdn_loop, 5, 1),
    "conv": (conv_inputs, conv_case, lambda x, w, b: (hf(hf_qwen3_next, "causal_conv1d_fn")(x, w, b, "silu"), None), 1, 2),
    "ssd": (ssd_inputs, ssd_packed(None), ssd_loop, 4, 1),
    "ssd_chunked": (ssd_inputs, ssd_packed(4), ssd_loop, 4, 1),
}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", sorted(CUDA_CASES))
def test_on_cuda(case, dtype):
    make, packed, ref, per_token, axis = CUDA_CASES[case]
    lens, parents = FORESTS[3]
    tensors = make(sum(lens), dtype, seed=3)
    check(lens, parents, tensors, on_cuda(packed), ref, on_tokens(axis, per_token), axis, TOL[dtype], seed=3)
