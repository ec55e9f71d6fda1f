"""The warp-specialised Hopper kernels (Gluon: the forward, dK/dV and dQ) against the exact reference.

The kernel needs an sm_90 GPU: those tests carry the ``cuda`` marker and
skip elsewhere. On a CPU the suite checks what does not need one: the
backend's refusals, and (``test_compiles_for_sm90``) that the kernel
compiles for sm_90 under the installed Triton with Hopper's instructions in
its machine code, which catches Gluon API changes between Triton versions.
"""

from __future__ import annotations

import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dualkv_compile.kernels import reference
from dualkv_compile.ops.attention import resolve_backend, shared_prompt_attention
from segments import forest_segments, make_segments, small_forest  # noqa: E402  tests/kernels is on sys.path

ROOT = Path(__file__).resolve().parents[2]
SM90_RESOURCES = ROOT / "benchmarks" / "tuning" / "sm90_resources.py"  # the compile-only resource report
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100, H200)")


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def qkv(T, Hq, Hkv, D, dtype, seed=0, token_major=False):
    g = torch.Generator().manual_seed(seed)
    if token_major:  # [T, H, D] projections seen as [1, H, T, D], as models hand them over
        make = lambda h: torch.randn(1, T, h, D, generator=g).to("cuda", dtype).transpose(1, 2)  # noqa: E731
    else:
        make = lambda h: torch.randn(1, h, T, D, generator=g).to("cuda", dtype)  # noqa: E731
    return make(Hq), make(Hkv), make(Hkv)


def check_forward(segs, T, Hq, Hkv, D, dtype, seed=0, token_major=False):
    """The Gluon forward and backward (dK/dV and dQ kernels) against the float64 reference, and no less
    accurate than the Triton kernels on the same inputs."""
    from dualkv_compile.kernels.gluon import attention as ga
    from dualkv_compile.kernels.triton import attention as ta

    q, k, v = qkv(T, Hq, Hkv, D, dtype, seed, token_major)
    do = torch.randn(1, Hq, T, D, generator=torch.Generator().manual_seed(seed + 100)).to("cuda", dtype)
    scale = 1 / math.sqrt(D)
    out, lse = ga.forward(q, k, v, segs, scale)
    q64, k64, v64 = q.double(), k.double(), v.double()
    ref_out, ref_lse = reference.reference_forward(q64, k64, v64, segs, scale)
    assert out.dtype == dtype and out.shape == (1, Hq, T, D) and lse.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # P is rounded to the inputs' dtype before P V, as in every flash kernel.
    assert rel(out, ref_out) < 1e-2, rel(out, ref_out)
    assert rel(lse, ref_lse) < 1e-5, rel(lse, ref_lse)
    # No worse than the Triton kernel on the same inputs (both round P the same way).
    t_out, t_lse = ta.forward(q, k, v, segs, scale)
    assert rel(out, ref_out) < 1.5 * rel(t_out, ref_out) + 1e-4, (rel(out, ref_out), rel(t_out, ref_out))

    ref_grads = reference.reference_backward(do.double(), q64, k64, v64, ref_out, ref_lse, segs, scale)
    t_grads = ta.backward(do, q, k, v, t_out, t_lse, segs, scale)
    atomic = dict(dkdv_config=ga.DkdvConfig(dq_mode="atomic"))  # dQ added by the dK/dV kernel (D=128)
    by_mode = {}
    for mode, kwargs in (("default", {}), ("deterministic", {}), ("atomic", atomic)):
        by_mode[mode] = grads = ga.backward(do, q, k, v, out, lse, segs, scale, mode == "deterministic", **kwargs)
        for name, g, r, t, like in zip(("dq", "dk", "dv"), grads, ref_grads, t_grads, (q, k, v)):
            assert g.shape == like.shape and g.dtype == dtype, (mode, name)
            assert torch.isfinite(g).all(), (mode, name)
            assert rel(g, r) < 2e-2, (mode, name, rel(g, r))
            assert rel(g, r) < 1.5 * rel(t, r) + 1e-4, (mode, name, rel(g, r), rel(t, r))
    # Without atomic dQ no kernel has atomics: the same inputs give the same bits, in both modes, and
    # the deterministic mode never takes the atomic dQ. dK and dV never use atomics: the same bits with
    # atomic dQ too.
    again = ga.backward(do, q, k, v, out, lse, segs, scale)
    det_atomic = ga.backward(do, q, k, v, out, lse, segs, scale, True, **atomic)
    for g, g_det, g_again, g_det_atomic in zip(by_mode["default"], by_mode["deterministic"], again, det_atomic):
        assert torch.equal(g, g_det) and torch.equal(g, g_again) and torch.equal(g, g_det_atomic)
    for g, g_det in zip(by_mode["atomic"][1:], by_mode["default"][1:]):
        assert torch.equal(g, g_det)


# --------------------------------------------------------------------------- on any machine


def test_refuses_cpu_tensors_with_the_reason():
    from dualkv_compile.kernels.gluon import attention as ga

    q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    assert "compute capability 9.0" in ga.supports(q) and "on cpu" in ga.supports(q)
    with pytest.raises(ValueError, match=r"backend='gluon' cannot run this input: .*on cpu"):
        resolve_backend("gluon", q)
    with pytest.raises(ValueError, match="gluon attention cannot run this input"):
        ga.forward(q, q, q, make_segments([(4, [4])])[0], 0.125)


def test_dkdv_config_names_a_bad_dq_mode():
    from dualkv_compile.kernels.gluon import attention as ga

    assert ga.DkdvConfig().dq_mode == "auto" and ga.DkdvConfig(dq_mode="atomic").dq_mode == "atomic"
    with pytest.raises(ValueError, match=r"DkdvConfig.dq_mode: expected one of \('atomic', 'auto', 'recompute'\), "
                                         r"got 'atomics'"):
        ga.DkdvConfig(dq_mode="atomics")
    with pytest.raises(ValueError, match=r"DkdvConfig.atomic_min_waves: expected a number >= 0, got -1"):
        ga.DkdvConfig(atomic_min_waves=-1)


def test_auto_dq_mode_takes_atomic_dq_for_many_long_prompt_tiles_only():
    """"auto": the atomic dQ when the longest ancestor chain's 128-key tiles times the kv heads fill 3 waves of
    the SMs (the H200's 132 here); the deterministic mode and head dim 64 always recompute."""
    from dualkv_compile.kernels.gluon import attention as ga

    auto, pick = ga.DkdvConfig(), ga.resolve_dq_mode
    assert pick(auto, False, 128, 32768, 8, 132) == "atomic"  # 256 tiles x 8 heads: 15.5 waves
    assert pick(auto, False, 128, 8192, 8, 132) == "atomic"  # 3.9 waves
    assert pick(auto, False, 128, 50 * 128 - 5, 8, 132) == "atomic"  # 50 tiles: 3.03 waves
    assert pick(auto, False, 128, 49 * 128, 8, 132) == "recompute"  # 2.97
    assert pick(auto, False, 128, 6144, 8, 132) == "recompute"  # the 2-level tree's chain: 2.9 waves
    assert pick(auto, False, 128, 2048, 8, 132) == "recompute"
    assert pick(auto, False, 128, 0, 8, 132) == "recompute"  # no prompt shared at all
    assert pick(auto, False, 128, 16384, 2, 132) == "recompute"  # 1.9 waves with 2 kv heads
    assert pick(auto, False, 128, 16384, 8, 264) == "atomic" and pick(auto, False, 128, 8192, 8, 264) == "recompute"
    assert pick(auto, True, 128, 32768, 8, 132) == "recompute"  # deterministic: never atomics
    assert pick(auto, False, 64, 32768, 8, 132) == "recompute"  # the atomic dQ is head dim 128 only
    assert pick(ga.DkdvConfig(dq_mode="atomic"), False, 128, 0, 8, 132) == "atomic"
    assert pick(ga.DkdvConfig(dq_mode="atomic"), True, 128, 0, 8, 132) == "recompute"
    assert pick(ga.DkdvConfig(dq_mode="recompute"), False, 128, 32768, 8, 132) == "recompute"
    assert pick(ga.DkdvConfig(atomic_min_waves=0), False, 128, 0, 1, 132) == "atomic"


@pytest.mark.skipif(HOPPER, reason="the refusals of other GPUs")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_refuses_other_gpus():
    from dualkv_compile.kernels.gluon import attention as ga

    q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16, device="cuda")
    assert "compute capability 9.0" in ga.supports(q)


def test_compiles_for_sm90():
    """The forward compiles for sm_90 with the installed Triton (no GPU needed): wgmma, bulk tensor
    copies and register reallocation between the partitions in its SASS; with FMAs, even where
    Triton's default is off (as 3.10's will be)."""
    pytest.importorskip("triton.experimental.gluon")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="0")
    run = subprocess.run([sys.executable, str(SM90_RESOURCES), "--gluon", "--head-dim", "128"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [ln for ln in run.stdout.splitlines() if "loop" in ln]
    assert any("'HGMMA': 16" in ln for ln in lines), run.stdout  # forward: 64x128 S and P V, K = 128: 8 + 8 per block
    assert any("'HGMMA': 20" in ln for ln in lines), run.stdout  # dQ: S, dP (8 + 8), dS K (4) per 64-key block
    # dK/dV: S^T, dP^T (8 + 8: 64 keys x 64 rows, K = 128), P^T dO and dS^T Q (4 + 4: K = 64 rows) per block
    assert any("'HGMMA': 24" in ln for ln in lines), run.stdout
    # ... and with the optional atomic dQ, dS K (8: 64 rows x 64 of D, K = 128 keys) and its bulk reductions.
    assert any("'HGMMA': 32" in ln for ln in lines), run.stdout
    # No loop waits after every product (ptxas serialising the wgmma pipeline): at most one wait per
    # group of products the kernel waits for (2 in the forward and dQ, 3 in dK/dV, 4 with atomic dQ).
    for ln in lines:
        if "HGMMA" in ln:
            groups = 4 if "'HGMMA': 32" in ln else 3
            assert int(re.search(r"'DEPBAR': (\d+)", ln).group(1)) <= groups, run.stdout
    assert any("UTMALDG" in ln for ln in lines), run.stdout
    setmaxnreg = re.search(r"(\d+) setmaxnreg", run.stdout)
    assert setmaxnreg and int(setmaxnreg.group(1)) > 0, run.stdout
    kernels = [ln for ln in run.stdout.splitlines() if "registers," in ln]
    assert len(kernels) >= 4 and all("FMA contraction on" in ln for ln in kernels), run.stdout


def test_compiles_the_head_dims_default_tiles_for_sm90():
    """``sm90_resources.py --gluon`` compiles the dK/dV kernel with the head dim's default tiles (``DKDV_CONFIGS``):
    at D=64, 128-row steps, whose loops issue 24 products per block (S^T, dP^T: 8 + 8 at 64 keys x 128 rows and
    K = 64; P^T dO, dS^T Q: 4 + 4 at K = 128 rows). It once compiled the class defaults' 64-row steps (16)."""
    pytest.importorskip("triton.experimental.gluon")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(SM90_RESOURCES), "--gluon", "--head-dim", "64"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout.split("shared_prompt_dkdv_kernel")
    dkdv_loops = [ln for part in out[1:] for ln in part.split("shared_prompt_dq_kernel")[0].splitlines() if "HGMMA" in ln]
    assert dkdv_loops and all("'HGMMA': 24" in ln for ln in dkdv_loops), run.stdout


# --------------------------------------------------------------------------- on an H100 / H200


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(4))
def test_random_forests(seed, dtype, D):
    segs, T = forest_segments(*small_forest(seed, max_tokens=600, max_len=200), "cuda")
    Hq, Hkv = [(4, 1), (8, 2), (4, 4), (6, 2)][seed]
    check_forward(segs, T, Hq, Hkv, D, dtype, seed, token_major=seed % 2 == 1)


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("D", [64, 128])
def test_edge_segments(D):
    # One-token prompts and responses, a prompt of several blocks beside one shorter than a block,
    # roots alone, empty segments (an empty root, an empty middle node), lengths at block edges.
    lens = [1, 1, 3, 129, 1, 500, 17, 1, 2, 5, 400, 23, 0, 6, 0, 1, 1, 128, 256, 127]
    parents = [-1, 0, 0, -1, 3, -1, 5, 5, 5, -1, 9, -1, -1, 12, 13, 14, -1, -1, 17, 18]
    segs, T = forest_segments(lens, parents, "cuda")
    check_forward(segs, T, 4, 2, D, torch.bfloat16, seed=3)


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("D", [64, 128])
def test_realistic_trees(D):
    """Several trees at realistic sizes, ragged lengths down to 1, GQA: a 2-level tree (a system
    prompt over two prompts), a one-level group, a one-token prompt, single-token responses."""
    lens, parents = [], []

    def add(n, parent):
        lens.append(n)
        parents.append(parent)
        return len(lens) - 1

    rng = random.Random(D)
    system = add(1100, -1)
    for P in (900, 257):
        p = add(P, system)
        for _ in range(6):
            add(rng.choice([1, 2, rng.randint(3, 1200)]), p)
    p = add(2049, -1)
    for _ in range(5):
        add(rng.randint(1, 700), p)
    p = add(1, -1)
    for R in (1, 300, 64):
        add(R, p)
    segs, T = forest_segments(lens, parents, "cuda")
    check_forward(segs, T, 8, 2, D, torch.bfloat16, seed=D, token_major=True)


@pytest.mark.cuda
@hopper
def test_other_segments_values_never_reach_a_product():
    """Blocks that run past a segment are copied whole; a NaN or inf in another segment's keys,
    values, queries or output gradients must not reach any row or key that cannot see it."""
    from dualkv_compile.kernels.gluon import attention as ga

    lens, parents = [300, 77, 130, 1, 200], [-1, 0, 0, 0, -1]
    segs, T = forest_segments(lens, parents, "cuda")
    q, k, v = qkv(T, 4, 2, 128, torch.bfloat16, seed=5)
    do = torch.randn_like(q)
    clean, clean_lse = ga.forward(q, k, v, segs, 0.088)
    modes = {"recompute": {}, "atomic": dict(dkdv_config=ga.DkdvConfig(dq_mode="atomic"))}
    clean_grads = {mode: ga.backward(do, q, k, v, clean, clean_lse, segs, 0.088, **kw) for mode, kw in modes.items()}
    k[:, :, 300:377] = float("nan")  # the first response: only its own rows see it
    v[:, :, 300:377] = float("inf")
    out, lse = ga.forward(q, k, v, segs, 0.088)
    others = torch.ones(T, dtype=torch.bool, device="cuda")
    others[300:377] = False
    assert torch.equal(out[:, :, others], clean[:, :, others])
    # dQ of every other row stays finite (its ancestors' and its own keys only; masked columns by
    # select; with atomic dQ, the key rows past a segment zeroed before dS K reads them).
    for mode, kw in modes.items():
        dq = ga.backward(do, q, k, v, out, lse, segs, 0.088, **kw)[0]
        assert torch.isfinite(dq[:, :, others]).all(), mode

    # The second response's rows: read by the prompt's keys and its own only. The dK/dV kernel's
    # blocks of the first response and of the one-token third response run into them (ragged).
    q, k, v = qkv(T, 4, 2, 128, torch.bfloat16, seed=5)
    q[:, :, 377:507] = float("nan")
    do = do.clone()
    do[:, :, 377:507] = float("inf")
    unseen = torch.zeros(T, dtype=torch.bool, device="cuda")
    unseen[300:377] = unseen[507:] = True
    others = torch.ones(T, dtype=torch.bool, device="cuda")
    others[377:507] = False
    for mode, kw in modes.items():
        dq, dk, dv = ga.backward(do, q, k, v, clean, clean_lse, segs, 0.088, **kw)
        dq_clean, dk_clean, dv_clean = clean_grads[mode]
        for g, c in ((dk, dk_clean), (dv, dv_clean)):
            assert torch.equal(g[:, :, unseen], c[:, :, unseen]), mode
        if mode == "recompute":
            assert torch.equal(dq[:, :, others], dq_clean[:, :, others])
        else:  # the float32 adds land in any order: the same values up to their rounding
            assert torch.isfinite(dq[:, :, others]).all()
            assert rel(dq[:, :, others], dq_clean[:, :, others]) < 1e-3


@pytest.mark.cuda
@hopper
def test_auto_dq_mode_on_a_long_prompt():
    """A 16K-token prompt fills the waves "auto" asks for (128 tiles x 8 kv heads): the default backward adds
    dQ in the dK/dV kernel. Its dQ differs from the recomputing pass's in the last bits (float32 sums in
    another order: the atomic path ran) and agrees to rounding; dK and dV are the same bits; the
    deterministic mode recomputes, the same bits as "recompute"."""
    from dualkv_compile.kernels.device import sm_count
    from dualkv_compile.kernels.gluon import attention as ga

    segs, T = make_segments([(16384, [100, 1, 257])], "cuda")
    q, k, v = qkv(T, 8, 8, 128, torch.bfloat16, seed=4, token_major=True)
    assert ga.resolve_dq_mode(ga.DkdvConfig(), False, 128, segs.max_prefix_len, 8, sm_count(q.device)) == "atomic"
    do = torch.randn_like(q)
    out, lse = ga.forward(q, k, v, segs, 0.0883)
    auto = ga.backward(do, q, k, v, out, lse, segs, 0.0883)
    recompute = ga.backward(do, q, k, v, out, lse, segs, 0.0883, dkdv_config=ga.DkdvConfig(dq_mode="recompute"))
    det = ga.backward(do, q, k, v, out, lse, segs, 0.0883, True)
    assert torch.isfinite(auto[0]).all() and not torch.equal(auto[0], recompute[0])
    assert rel(auto[0], recompute[0]) < 1e-3, rel(auto[0], recompute[0])
    assert torch.equal(auto[1], recompute[1]) and torch.equal(auto[2], recompute[2])
    assert all(torch.equal(a, b) for a, b in zip(det, recompute))


@pytest.mark.cuda
@hopper
def test_backward_through_the_op():
    """backend='gluon' through the op: the Gluon forward's out and lse feed the Gluon backward."""
    segs, T = make_segments([(1000, [300, 17, 1]), (5, [700])], "cuda")
    q, k, v = (t.requires_grad_() for t in qkv(T, 8, 2, 128, torch.bfloat16, seed=2))
    out = shared_prompt_attention(q, k, v, segs, backend="gluon")
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    ref_out, ref_lse = reference.reference_forward(q64, k64, v64, segs, 1 / math.sqrt(128))
    ref = reference.reference_backward(do.double(), q64, k64, v64, ref_out, ref_lse, segs, 1 / math.sqrt(128))
    assert rel(out, ref_out) < 1e-2
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert rel(g, r) < 2e-2, (name, rel(g, r))


@pytest.mark.cuda
@hopper
def test_new_lengths_do_not_recompile():
    from dualkv_compile.kernels.gluon import attention as ga
    from dualkv_compile.kernels.gluon.dkdv import shared_prompt_dkdv_kernel
    from dualkv_compile.kernels.gluon.dq import shared_prompt_dq_kernel
    from dualkv_compile.kernels.gluon.fwd import shared_prompt_fwd_kernel

    def compiled():
        kernels = (shared_prompt_fwd_kernel, shared_prompt_dkdv_kernel, shared_prompt_dq_kernel)
        return sum(len(cache[0]) for kern in kernels
                   for cache in kern.device_caches.values())

    counts = []
    layouts = [make_segments(groups, "cuda") for groups in (
        [(1000, [300, 17])], [(4096, [1024] * 4)], [(777, [5, 1, 333]), (129, [1000])])]
    layouts.append(forest_segments([1000, 300, 17, 1, 500, 64], [-1, 0, 1, 2, 0, -1], "cuda"))
    for segs, T in layouts:
        q, k, v = qkv(T, 32, 8, 128, torch.bfloat16, seed=1, token_major=True)
        out, lse = ga.forward(q, k, v, segs, 0.0883)
        ga.backward(torch.randn_like(q), q, k, v, out, lse, segs, 0.0883)
        counts.append(compiled())
    assert counts[1:] == counts[:1] * 3, counts


@pytest.mark.cuda
@hopper
def test_softcap_and_untileable_operands_run_the_triton_forward():
    """A softcap is refused by the Gluon backend by name, so "auto" resolves it to Triton, whose kernels run it;
    an operand without a descriptor view runs the Triton kernels for that call (``backend_for_call``). The Gluon
    module itself never runs another backend."""
    from dualkv_compile.kernels.gluon import attention as ga
    from dualkv_compile.kernels.triton import attention as ta
    from dualkv_compile.ops.attention import backend_for_call

    segs, T = make_segments([(300, [100, 7])], "cuda")
    q, k, v = qkv(T, 4, 2, 64, torch.bfloat16, seed=4)
    for softcap in (0.0, 30.0):
        out = shared_prompt_attention(q, k, v, segs, 0.125, softcap=softcap)  # auto: gluon, then triton
        ref, _ = reference.reference_forward(q.double(), k.double(), v.double(), segs, 0.125, softcap)
        assert rel(out, ref) < 1e-2
    assert torch.equal(ga.forward(q, k, v, segs, 0.125)[0], shared_prompt_attention(q, k, v, segs, 0.125))
    assert resolve_backend("auto", q, v, softcap=30.0) == "triton" and "softcap" in ga.supports(q, v, softcap=30.0)
    assert torch.equal(shared_prompt_attention(q, k, v, segs, 0.125, softcap=30.0),
                       ta.forward(q, k, v, segs, 0.125, 30.0)[0])
    with pytest.raises(ValueError, match="softcap"):
        ga.forward(q, k, v, segs, 0.125, 30.0)
    with pytest.raises(ValueError, match=r"backend='gluon' cannot run this input: .*softcap"):
        shared_prompt_attention(q, k, v, segs, 0.125, backend="gluon", softcap=30.0)
    skewed = torch.empty(1, 4, T, 65, dtype=torch.bfloat16, device="cuda")[..., 1:].copy_(q)  # rows not 16-byte aligned
    assert backend_for_call("gluon", q=skewed, k=k, v=v) is ta
    assert torch.equal(shared_prompt_attention(skewed, k, v, segs, 0.125, backend="gluon"),
                       ta.forward(skewed, k, v, segs, 0.125)[0])


@pytest.mark.cuda
@hopper
def test_auto_picks_gluon_where_it_runs():
    q = torch.zeros(1, 4, 256, 128, dtype=torch.bfloat16, device="cuda")
    assert resolve_backend("auto", q) == "gluon"
    assert resolve_backend("auto", q.half()) == "gluon"
    assert resolve_backend("auto", torch.zeros(1, 4, 256, 96, dtype=torch.bfloat16, device="cuda")) == "triton"
    assert resolve_backend("auto", q.float()) == "triton"
    v = torch.zeros(1, 4, 256, 64, dtype=torch.bfloat16, device="cuda")  # MLA: v's head dim differs
    assert resolve_backend("auto", q, v) == "triton"
