"""The Triton shared-prompt attention kernels against the exact reference.

On a machine without CUDA the kernels run under the Triton interpreter
(``TRITON_INTERPRET=1``), which ``triton.jit`` reads when the kernel modules
are imported: this module sets it before importing them. Shapes are small
there (the interpreter runs every program in numpy); the ``cuda`` tests use
realistic sizes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dualkv_compile.kernels import reference  # noqa: E402
from dualkv_compile.kernels.triton import attention as ta  # noqa: E402
from dualkv_compile.kernels.common import schedule  # noqa: E402
from dualkv_compile.kernels.triton import tma  # noqa: E402
from dualkv_compile.kernels.triton.attention import Config, KernelConfig  # noqa: E402
from dualkv_compile.layout.segments import host_rows  # noqa: E402
import segments  # noqa: E402  tests/kernels is on sys.path
from segments import forest_segments, make_segments, random_forest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="no CUDA and TRITON_INTERPRET is off",
)
pytestmark = needs_kernels


def make_layout(groups, seed=0, device=DEVICE):
    """A real padded batch whose rows share prompts (for the tests through the op): groups = [(P, [R0, R1, ...])]."""
    from dualkv_compile.layout import detect

    g = torch.Generator().manual_seed(seed)
    rows = []
    for P, Rs in groups:
        prompt = torch.randint(1, 1000, (P,), generator=g)
        for R in Rs:
            # Distinct first response tokens, so the shared prefix is exactly the prompt.
            rest = torch.randint(1000, 2000, (R,), generator=g)
            rest[0] = 2000 + len(rows)
            rows.append(torch.cat([prompt, rest]))
    S = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return detect(ids.to(device), mask.to(device))


def random_groups(seed, max_groups=3, max_p=40, max_r=30, max_n=4):
    rnd = random.Random(seed)
    return [(rnd.randint(1, max_p), [rnd.randint(1, max_r) for _ in range(rnd.randint(1, max_n))])
            for _ in range(rnd.randint(2, max_groups))]


def qkv(T, Hq, Hkv, D, dtype, seed=0, device=DEVICE):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, do = (torch.randn(1, h, T, D, generator=g).to(device=device, dtype=dtype) for h in (Hq, Hkv, Hkv, Hq))
    return q, k, v, do


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def reference_all(q, k, v, do, segs, scale):
    q64, k64, v64, do64 = (t.detach().double() for t in (q, k, v, do))
    out, lse = reference.reference_forward(q64, k64, v64, segs, scale)
    grads = reference.reference_backward(do64, q64, k64, v64, out, lse, segs, scale)
    return out, lse, grads


def check_against_reference(segs, T, Hq, Hkv, D, dtype, config=None, seed=0, transpose_q=False):
    if dtype == torch.float64 and DEVICE == "cuda":
        pytest.skip("float64 runs only under the Triton interpreter")
    q, k, v, do = qkv(T, Hq, Hkv, D, dtype, seed)
    if transpose_q:  # [T, H, D] storage seen as [1, H, T, D]
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    scale = 1 / math.sqrt(D)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 1e-2)
    ref_out, ref_lse, ref_grads = reference_all(q, k, v, do, segs, scale)
    out, lse = ta.forward(q, k, v, segs, scale, config=config)
    assert out.dtype == dtype and lse.dtype == torch.promote_types(dtype, torch.float32) and lse.shape == (1, Hq, T)
    assert rel(out, ref_out) < tol, rel(out, ref_out)
    assert rel(lse, ref_lse) < min(tol, 1e-5), rel(lse, ref_lse)
    for det in (True, False):
        grads = ta.backward(do, q, k, v, out, lse, segs, scale, det, config=config)
        for name, g, r, like in zip("dq dk dv".split(), grads, ref_grads, (q, k, v)):
            assert g.shape == like.shape and g.dtype == dtype, name
            assert torch.isfinite(g).all(), name
            assert rel(g, r) < tol, (name, det, rel(g, r))


# Interpreter-sized tiles that still cover the GPU code paths: BLOCK_M != BLOCK_N
# both ways, query heads split over programs with atomics, dQ by atomics, and
# full blocks loaded through tensor descriptors (with the packed row statistics).
SMALL = KernelConfig(16, 16, 4, 1)
MIXED = Config(KernelConfig(32, 16, 4, 1), KernelConfig(16, 32, 4, 1), KernelConfig(16, 32, 4, 1), head_split=2)
ATOMIC = Config(KernelConfig(16, 32, 4, 1), KernelConfig(32, 16, 4, 1), KernelConfig(32, 16, 4, 1), dq_mode="atomic")
INTERP = Config(SMALL, SMALL, SMALL)
TMA = Config(KernelConfig(32, 16, 4, 1, tma=True), KernelConfig(16, 32, 4, 1, tma=True, stats_tma=True),
             KernelConfig(16, 32, 4, 1, tma=True))
TMA_SPLIT = Config(KernelConfig(16, 16, 4, 1, tma=True), KernelConfig(16, 16, 4, 1, tma=True, stats_tma=True),
                   KernelConfig(16, 16, 4, 1, tma=True), head_split=2)


@pytest.mark.parametrize(
    "seed, D, Hq, Hkv, dtype, config",
    [
        (0, 64, 4, 2, torch.float32, INTERP),
        (1, 128, 2, 1, torch.float32, MIXED),
        (2, 64, 4, 1, torch.bfloat16, ATOMIC),
        (3, 128, 2, 2, torch.bfloat16, INTERP),
        (4, 64, 4, 2, torch.float16, MIXED),
        (5, 64, 4, 2, torch.float32, TMA),
        (6, 128, 2, 1, torch.bfloat16, TMA_SPLIT),
        (7, 64, 4, 1, torch.float16, TMA),
    ],
)
def test_matches_reference_random_layouts(seed, D, Hq, Hkv, dtype, config):
    segs, T = make_segments(random_groups(seed), DEVICE)
    check_against_reference(segs, T, Hq, Hkv, D, dtype, config if DEVICE == "cpu" else None, seed,
                            transpose_q=seed % 2 == 1)


def small_forest(seed, max_tokens=128):
    """A random forest small enough for the interpreter (T <= max_tokens)."""
    return segments.small_forest(seed, max_tokens, max_len=24)


@pytest.mark.parametrize(
    "seed, Hq, Hkv, config, dtype",
    [(10, 2, 1, INTERP, torch.float32), (11, 4, 2, MIXED, torch.float32), (12, 2, 1, ATOMIC, torch.float32),
     (13, 2, 2, TMA, torch.float32), (14, 4, 1, TMA_SPLIT, torch.float32),
     # float64 (interpreter only) through head-split and dQ atomics and the packed row statistics: exact.
     (15, 4, 2, MIXED, torch.float64), (16, 2, 1, ATOMIC, torch.float64), (17, 4, 1, TMA_SPLIT, torch.float64)],
)
def test_random_forests_match_reference(seed, Hq, Hkv, config, dtype):
    # Prefix forests: every ancestor of a node fully visible, one softmax over all of them;
    # the readers of a node's keys reach down several levels.
    segs, T = forest_segments(*small_forest(seed), DEVICE)
    check_against_reference(segs, T, Hq, Hkv, 32, dtype, config if DEVICE == "cpu" else None, seed,
                            transpose_q=seed % 2 == 1)


def test_depth_three_middle_node_with_several_children():
    # root -> middle (children: three leaves of 12, 1 and 25 tokens), a leaf, a second middle node
    # with one child; then a one-token root of its own.
    lens = [20, 18, 12, 1, 25, 9, 16, 5, 1]
    parents = [-1, 0, 1, 1, 1, 0, 0, 6, -1]
    segs, T = forest_segments(lens, parents, DEVICE)
    assert segs.prefix_len.tolist() == [0, 20, 38, 38, 38, 20, 20, 36, 0]
    assert segs.subtree_end.tolist() == [106, 76, 50, 51, 76, 85, 106, 106, 107]
    check_against_reference(segs, T, 2, 1, 32, torch.float32, ATOMIC if DEVICE == "cpu" else None, seed=15)


def test_edge_segments():
    # Prompts of one token, responses of one token, a prompt longer than several blocks next
    # to one shorter than a block, roots alone (no ancestors, no readers), and empty
    # segments: an empty root and an empty middle node (ancestors that add no block).
    lens = [1, 1, 3, 9, 1, 50, 17, 1, 2, 5, 40, 23, 0, 6, 0, 1, 1]
    parents = [-1, 0, 0, -1, 3, -1, 5, 5, 5, -1, 9, -1, -1, 12, 13, 14, -1]
    segs, T = forest_segments(lens, parents, DEVICE)
    check_against_reference(segs, T, 2, 1, 64, torch.float32, INTERP if DEVICE == "cpu" else None, seed=7)


def test_ancestors_with_only_full_or_only_ragged_blocks():
    # The query kernels walk all ancestors' full blocks, then their ragged last blocks, each walk
    # skipping the ancestors without such a block: the leaf's ancestors (nearest first) have
    # 2 full blocks and a ragged one, 1 full block only, a ragged one only, 1 full and a ragged one.
    lens, parents = [20, 5, 16, 37, 3, 2], [-1, 0, 1, 2, 3, 2]
    segs, T = forest_segments(lens, parents, DEVICE)
    assert schedule.ancestor_walk(segs, 16).tolist()[4] == [4, 3, 3, 3]
    check_against_reference(segs, T, 2, 1, 32, torch.float32, INTERP if DEVICE == "cpu" else None, seed=16)


@pytest.mark.parametrize("config", [INTERP, ATOMIC], ids=["recompute_dq", "atomic_dq"])
def test_very_negative_scores_give_finite_gradients(config):
    # Every visible score near -200: lse is too, and a zero-loaded column past a ragged
    # prefix block scores 0, whose exp(0 - lse) overflows float32 unless it is masked.
    # The large common direction sits in q, not k: dQ = scale * sum_j dS_ij k_j with
    # sum_j dS_ij = 0, so a large shared part of k cancels there, and float32 rounding of the
    # scores (~2e-5 at magnitude 200) then left dQ ill-conditioned (relative error up to 0.17,
    # depending on the block shapes and on the CPU's BLAS), with no kernel error at all.
    segs, T = make_segments([(21, [7, 13]), (5, [9])], DEVICE)
    D = 64
    _, _, v, do = qkv(T, 2, 1, D, torch.float32, seed=4)
    u = torch.ones(1, 1, T, D, device=DEVICE) / math.sqrt(D)
    jitter = torch.randn(1, 1, T, D, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    q = (u * 1600 + jitter * 0.01).expand(1, 2, T, D).contiguous()
    k = -u + jitter * 0.05
    scale = 1 / math.sqrt(D)
    ref_out, ref_lse, ref_grads = reference_all(q, k, v, do, segs, scale)
    assert ref_lse.max() < -150
    out, lse = ta.forward(q, k, v, segs, scale, config=config if DEVICE == "cpu" else None)
    # Scores of magnitude 200 carry float32 rounding of ~2e-5 each: a looser bound than elsewhere.
    assert rel(out, ref_out) < 1e-3
    grads = ta.backward(do, q, k, v, out, lse, segs, scale, False, config=config if DEVICE == "cpu" else None)
    for name, g, r in zip("dq dk dv".split(), grads, ref_grads):
        assert torch.isfinite(g).all(), name
        assert rel(g, r) < 1e-3, (name, rel(g, r))


def test_readers_span_several_levels():
    # The dK/dV kernel walks a key tile's own rows after the diagonal and every descendant's rows
    # as one range up to the subtree's end: the root's readers here are children, grandchildren
    # and a great-grandchild; node 1's subtree ends before its sibling's starts.
    lens = [37, 21, 19, 3, 40, 5, 1]
    parents = [-1, 0, 1, 2, 0, 4, -1]
    segs, T = forest_segments(lens, parents, DEVICE)
    assert segs.subtree_end.tolist() == [125, 80, 80, 80, 125, 125, 126]
    assert segs.prefix_len.tolist() == [0, 37, 58, 77, 37, 77, 0]
    for config in (INTERP, TMA):
        check_against_reference(segs, T, 2, 1, 64, torch.float32, config if DEVICE == "cpu" else None, seed=9)


def test_readers_longer_than_one_chunk():
    # float32 dK/dV sum a key tile's readers 16 query blocks at a time, then add those partial sums
    # (tiles.key_sum_chunk): the prompt's tiles here have 22 full reader blocks of 16 after the diagonal
    # (a full chunk, a partial one) and a ragged tail; the 300-token response's first tiles have 18 of their own.
    segs, T = make_segments([(20, [300, 9, 40])], DEVICE)
    # Interpreted on CPU, one config (the suite's time: 50 s for three); the others are the smaller tests'.
    for config in (INTERP, MIXED, TMA) if DEVICE != "cpu" else (INTERP,):
        check_against_reference(segs, T, 2, 1, 32, torch.float32, config if DEVICE == "cpu" else None, seed=21)


def test_tma_paths_are_taken():
    T = make_segments([(40, [20, 33]), (9, [17])])[1]
    q, k, v, do = qkv(T, 4, 2, 64, torch.float32, seed=8)
    assert tma.descriptors(TMA.fwd, 16, k, v)[1]
    assert tma.descriptors(TMA.dkdv, 16, q.transpose(1, 2).contiguous().transpose(1, 2), do)[1]
    assert not tma.descriptors(INTERP.fwd, 16, k, v)[1]  # tma off in the config
    padded = torch.randn(1, 2, T, 96, device=DEVICE)  # D=96 runs in 128-wide blocks: pointers only
    assert not tma.descriptors(TMA.fwd, 16, padded, padded)[1]


@pytest.mark.parametrize("layout", ["head_major", "token_major", "one_head", "strided_heads"])
def test_tma_view_addresses_every_head(layout):
    H, T, D = 3, 40, 32
    base = torch.randn(H, T, D, device=DEVICE)
    t = {
        "head_major": base.unsqueeze(0),
        "token_major": base.transpose(0, 1).contiguous().transpose(0, 1).unsqueeze(0),
        "one_head": base[:1].unsqueeze(0),
        "strided_heads": torch.randn(H, T + 5, D, device=DEVICE)[:, :T].unsqueeze(0),  # gaps between heads
    }[layout]
    desc, row_h, col_h = tma.tma_view(t, 8)
    assert desc.block_shape == [8, D] and desc.strides[-1] == 1
    flat = torch.as_strided(t, desc.shape, desc.strides)
    for h in range(t.shape[1]):
        assert torch.equal(flat[h * row_h: h * row_h + T, h * col_h: h * col_h + D], t[0, h])


def test_tma_view_refuses_layouts_it_cannot_address():
    t = torch.randn(1, 2, 16, 64, device=DEVICE)
    assert tma.tma_view(t[..., ::2], 8) is None  # last dim not contiguous
    assert tma.tma_view(torch.randn(1, 2, 16, 65, device=DEVICE)[..., 1:], 8) is None  # misaligned base
    # a head stride (80) neither a multiple of the token stride (192) nor dividing it
    odd = torch.randn(16 * 192, device=DEVICE).as_strided((1, 2, 16, 64), (0, 80, 192, 1))
    assert tma.tma_view(odd, 8) is None
    assert tma.tma_view(torch.randn(16 * 192, device=DEVICE).as_strided((1, 2, 16, 64), (0, 96, 192, 1)), 8)


def test_config_rejects_unknown_dq_mode():
    with pytest.raises(ValueError, match="dq_mode"):
        Config(SMALL, SMALL, SMALL, dq_mode="fast")
    with pytest.raises(ValueError, match="head_split"):
        Config(SMALL, SMALL, SMALL, head_split=0)


def test_through_op_forward_and_backward():
    from dualkv_compile.ops.attention import shared_prompt_attention

    layout = make_layout([(21, [7, 13, 2]), (12, [30])], seed=3)
    T, Hq, Hkv, D = layout.num_tokens, 4, 2, 64
    q, k, v, do = qkv(T, Hq, Hkv, D, torch.float32, seed=3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = shared_prompt_attention(q, k, v, layout, backend="triton")
    out.backward(do)
    ref_out, _, ref_grads = reference_all(q, k, v, do, layout.attention_segments, 1 / math.sqrt(D))
    assert rel(out, ref_out) < 1e-5
    for g, r in zip((q.grad, k.grad, v.grad), ref_grads):
        assert rel(g, r) < 1e-5


def test_deterministic_backward_is_bitwise_reproducible():
    segs, T = forest_segments([30, 9, 25, 4, 14, 11, 6], [-1, 0, 1, 0, -1, 4, 4], DEVICE)
    D = 64
    q, k, v, do = qkv(T, 4, 2, D, torch.bfloat16, seed=5)
    out, lse = ta.forward(q, k, v, segs, 0.125)
    a = ta.backward(do, q, k, v, out, lse, segs, 0.125, True)
    b = ta.backward(do, q, k, v, out, lse, segs, 0.125, True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_tile_schedule_covers_every_tile_once_heaviest_first():
    lens, parents = random_forest(random.Random(11), max_depth=3, max_len=90)
    segs, T = forest_segments(lens, parents, DEVICE)
    rows = host_rows(lens, parents)
    for block, kind in ((16, "q"), (32, "kv"), (128, "q")):
        sched = schedule.tile_schedule(segs, T, block, kind).cpu().tolist()
        got = [(s, t) for s, t in zip(*sched) if s >= 0]
        assert sorted(got) == [(i, t) for i, n in enumerate(lens) for t in range(-(-n // block))]
        assert all(s == -1 for s in sched[0][len(got):])  # padding only at the end
        # Work per tile: "q" all ancestors + the causal part; "kv" the rows from the tile to the subtree's end.
        work = [rows[s][3] + min((t + 1) * block, rows[s][1]) if kind == "q" else rows[s][4] - rows[s][0] - t * block
                for s, t in got]
        assert work == sorted(work, reverse=True), (kind, work)


@pytest.mark.parametrize("seed", range(4))
def test_ancestor_walk_follows_the_parent_chain(seed):
    rng = random.Random(seed)
    lens, parents = random_forest(rng, max_depth=5, max_len=40)
    lens = [0 if rng.random() < 0.2 else n for n in lens]  # empty segments: ancestors with no block at all
    chain = [rng.choice([0, 1, 16, 17, 40]) for _ in range(70)]  # deeper than a few rounds of pointer doubling
    for lens, parents in ((lens, parents), (chain, list(range(-1, 69)))):
        segs, _ = forest_segments(lens, parents, DEVICE)
        for block in (16, 32):
            for s, (n, got) in enumerate(zip(lens, schedule.ancestor_walk(segs, block).tolist())):
                chain_s, a = [], parents[s]
                while a >= 0:
                    chain_s, a = chain_s + [a], parents[a]
                want = [sum(lens[a] // block for a in chain_s), sum(lens[a] % block != 0 for a in chain_s),
                        next((a for a in chain_s if lens[a] >= block), -1),
                        next((a for a in chain_s if lens[a] % block), -1)]
                # the counts are only read for segments with tokens (the only ones with tiles)
                assert got == want if n else got[2:] == want[2:], (s, got, want)


def test_plan_cache_tells_forests_apart():
    # Same starts and lengths, another parent chain: the cached schedules must not be shared.
    a, T = forest_segments([20, 20, 20], [-1, 0, 1], DEVICE)
    b = forest_segments([20, 20, 20], [-1, -1, -1], DEVICE)[0]._replace(seg_start=a.seg_start, seg_len=a.seg_len)
    qa, qb = (schedule.tile_schedule(x, T, 16, "q") for x in (a, b))
    assert qa.tolist() != qb.tolist()
    assert schedule.tile_schedule(a, T, 16, "q") is qa


def test_supports_gives_reasons():
    assert ta.supports(torch.empty(1, 2, 4, 64, device=DEVICE, dtype=torch.bfloat16)) is None
    assert "dtype" in ta.supports(torch.empty(1, 2, 4, 64, device=DEVICE, dtype=torch.int32))
    assert "head dim" in ta.supports(torch.empty(1, 2, 4, 8, device=DEVICE))
    assert "head dim" in ta.supports(torch.empty(1, 2, 4, 512, device=DEVICE))


# --------------------------------------------------------------------------- GPU, realistic sizes

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _check_heads(out, lse, grads, q, k, v, do, segs, scale, kv_heads):
    """Compare the kernel with the fp32 reference on a few kv-head groups (the reference is O(T^2) per head)."""
    G = q.shape[1] // k.shape[1]
    for h in kv_heads:
        qs, dos = q[:, h * G:(h + 1) * G], do[:, h * G:(h + 1) * G]
        ks, vs = k[:, h:h + 1], v[:, h:h + 1]
        ro, rl = reference.reference_forward(qs.float(), ks.float(), vs.float(), segs, scale)
        rg = reference.reference_backward(dos.float(), qs.float(), ks.float(), vs.float(), None, None, segs, scale)
        assert rel(out[:, h * G:(h + 1) * G], ro) < 1e-2
        assert rel(lse[:, h * G:(h + 1) * G], rl) < 1e-4
        for g, r in zip((grads[0][:, h * G:(h + 1) * G], grads[1][:, h:h + 1], grads[2][:, h:h + 1]), rg):
            assert rel(g, r) < 1e-2


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("forest", [
    make_segments([(4096, [517, 300, 1, 777, 640, 1023, 64, 700])], "cpu"),
    make_segments([(3001, [500, 777, 1, 1200]), (2500, [900, 640, 33]), (129, [1000])], "cpu"),
    # depth 3: a middle node with several children (one of one token), a leaf, a one-child chain; a second tree
    forest_segments([2048, 1024, 700, 1, 1500, 900, 512, 2000, 1000, 600], [-1, 0, 1, 1, 1, 0, 0, 6, -1, 8], "cpu"),
], ids=["one_group", "three_groups", "depth3"])
def test_gpu_realistic(forest, D):
    segs, T = forest
    segs = segs._replace(**{f: getattr(segs, f).to(DEVICE) for f in ("seg_start", "seg_len", "parent", "prefix_len",
                                                                      "subtree_end")})
    assert 8000 <= T <= 20000
    q, k, v, do = qkv(T, 32, 8, D, torch.bfloat16, seed=D)
    scale = 1 / math.sqrt(D)
    out, lse = ta.forward(q, k, v, segs, scale)
    grads = ta.backward(do, q, k, v, out, lse, segs, scale, True)
    _check_heads(out, lse, grads, q, k, v, do, segs, scale, kv_heads=(0, 7))
    table = ta.config_for(q)
    for mode in ta.DQ_MODES:  # the table's mode and the others
        grads = ta.backward(do, q, k, v, out, lse, segs, scale, False, config=dataclasses.replace(table, dq_mode=mode))
        _check_heads(out, lse, grads, q, k, v, do, segs, scale, kv_heads=(0, 7))
    a = ta.backward(do, q, k, v, out, lse, segs, scale, True)
    b = ta.backward(do, q, k, v, out, lse, segs, scale, True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.cuda
@cuda
def test_gpu_through_op():
    from dualkv_compile.ops.attention import shared_prompt_attention

    layout = make_layout([(4000, [1000, 2000, 999, 1])], seed=1)
    q, k, v, do = qkv(layout.num_tokens, 32, 8, 128, torch.bfloat16, seed=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = shared_prompt_attention(q, k, v, layout, backend="triton")
    out.backward(do)
    ref = shared_prompt_attention(q.detach().float(), k.detach().float(), v.detach().float(), layout, backend="reference")
    assert rel(out, ref) < 1e-2
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.cuda
@cuda
def test_gpu_new_lengths_do_not_recompile():
    """Layouts reach the kernels as tensors and descriptor offsets: new lengths and forest shapes
    (a deeper ancestor chain is a longer runtime loop) reuse the compiled kernels."""
    from dualkv_compile.kernels.common.row_statistics import bwd_preprocess_kernel
    from dualkv_compile.kernels.triton.bwd import bwd_dkdv_kernel, bwd_dq_kernel
    from dualkv_compile.kernels.triton.fwd import shared_prompt_fwd_kernel

    kernels = (shared_prompt_fwd_kernel, bwd_preprocess_kernel, bwd_dkdv_kernel, bwd_dq_kernel)

    def compiled():
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())

    counts = []
    layouts = [make_segments(groups, DEVICE) for groups in (
        [(1000, [300, 17])], [(4096, [1024] * 4)], [(777, [5, 1, 333]), (129, [1000])])]
    layouts.append(forest_segments([1000, 300, 17, 1, 500, 64], [-1, 0, 1, 2, 0, -1], DEVICE))
    for segs, T in layouts:
        q, k, v, do = qkv(T, 32, 8, 128, torch.bfloat16, seed=1)
        out, lse = ta.forward(q, k, v, segs, 0.0883)
        ta.backward(do, q, k, v, out, lse, segs, 0.0883)
        counts.append(compiled())
    assert counts[1:] == counts[:1] * 3, counts
