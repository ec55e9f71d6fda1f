"""Sliding and chunked windows in the Triton kernels against the per-sequence float64 oracle.

Under the interpreter (no CUDA) on small random forests of depth 1-3 (``window_oracle``), forward and backward
(dQ, dK, dV; deterministic and default modes) with the tile configurations of test_triton_attention.py that reach
the GPU code paths (tensor descriptors, query heads split over programs, dQ by atomics): windows that bind inside
a node and across node boundaries, wider than a key block (full blocks seen whole and the masked band), chunks,
both, GQA, head dims 64 and 128, MLA, softcap, and sinks through the op. The host plans (``windows.py``) against a
walk written out by hand, and the block skipping itself: the query kernels visit exactly the key blocks holding a
visible pair and the dK/dV kernel no query block without one.
"""

from __future__ import annotations

import inspect
import os
import random

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dualkv_compile import shared_prompt_attention  # noqa: E402
from dualkv_compile.kernels.triton import attention as ta  # noqa: E402
from dualkv_compile.kernels.triton import windows  # noqa: E402
from dualkv_compile.layout.segments import dense_mask, host_rows  # noqa: E402
from segments import forest_segments, random_forest  # noqa: E402  tests/kernels is on sys.path
from window_oracle import VARIANTS, inputs, oracle, windowed_forest  # noqa: E402

# The tile configurations (and the skip without kernels) are test_triton_attention.py's, so the windowed walks
# meet the GPU code paths the kernels without windows are tested on.
from test_triton_attention import ATOMIC, DEVICE, INTERP, MIXED, TMA, needs_kernels  # noqa: E402

pytestmark = [needs_kernels, pytest.mark.usefixtures("one_thread")]
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
SCALE = 0.3


def rel(a, b):
    """Relative error, against a floor: with a window of 1 (or chunks of 1) a row sees only itself and dQ, dK are
    exactly 0, which float64 reaches only to ~1e-16 absolute."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-3)).item()


def check(lens, parents, window, chunk, dtype, config, D=32, Dv=None, hq=4, hkv=2, softcap=0.0, seed=0):
    """The kernels' out, lse-consistent output and gradients (both backward modes) against the oracle."""
    if dtype == torch.float64 and DEVICE == "cuda":
        pytest.skip("float64 runs only under the Triton interpreter")
    segs, T = forest_segments(lens, parents, DEVICE)
    # The oracle reads the inputs as the kernels get them (rounded to dtype): the tolerances are the kernels'.
    q, k, v, dout = (t.to(dtype).double() for t in inputs(T, D, Dv or D, seed, hq, hkv)[:4])
    out, *grads, _ = oracle(q, k, v, dout, lens, parents, SCALE, window, chunk, softcap=softcap)
    x = [t.to(DEVICE, dtype) for t in (q, k, v, dout)]
    tol = TOL[dtype]
    o, lse = ta.forward(*x[:3], segs, SCALE, softcap, window, chunk, config=config)
    assert o.shape == out.shape and o.dtype == dtype and torch.isfinite(lse).all()
    assert rel(o, out) < tol, rel(o, out)
    for det in (True, False):
        got = ta.backward(x[3], *x[:3], o, lse, segs, SCALE, det, softcap, window, chunk, config=config)
        for name, a, b, like in zip(("dq", "dk", "dv"), got, grads, x[:3]):
            assert a.shape == like.shape and a.dtype == dtype and torch.isfinite(a).all(), name
            assert rel(a, b) < tol, (name, det, rel(a, b))


@pytest.mark.parametrize("seed, max_len, window, chunk, dtype, config, D, hq, hkv, softcap", [
    # nodes under one key block (ragged blocks only), depth 2-3: VARIANTS' windows (2 and 5: binding inside nodes
    # and across them; chunks of 4; both), one tile configuration each
    *[(seed, 12, window, chunk, torch.float64, config, 32, 4, hkv, 0.0) for seed, (window, chunk), config, hkv
      in zip((2, 5, 10, 11), VARIANTS[1:], (INTERP, MIXED, ATOMIC, TMA), (2, 2, 1, 1))],
    # nodes of several blocks, depth 1-3: windows wider than a block (ancestors' full blocks seen whole, then the
    # band), chunks wider than one too
    (14, 40, 20, 0, torch.float64, INTERP, 32, 4, 2, 2.0),
    (16, 40, 0, 24, torch.float32, TMA, 32, 4, 2, 0.0),
    (22, 40, 17, 0, torch.float32, MIXED, 64, 4, 2, 0.0),
    (4, 40, 33, 8, torch.bfloat16, INTERP, 128, 2, 1, 0.0),
    (13, 40, 9, 0, torch.float16, ATOMIC, 64, 4, 1, 1.0),
    (12, 40, 6, 0, torch.float64, TMA, 32, 4, 2, 0.0),
])
def test_matches_oracle(seed, max_len, window, chunk, dtype, config, D, hq, hkv, softcap):
    lens, parents = windowed_forest(seed, max_len)
    check(lens, parents, window, chunk, dtype, config if DEVICE == "cpu" else None, D, None, hq, hkv, softcap, seed)


def test_mla_head_dims():
    """v's head dim differs (zero-padded to the larger, as without windows)."""
    check([14, 9, 20, 5], [-1, 0, 0, 2], 6, 0, torch.float64, MIXED if DEVICE == "cpu" else None, D=24, Dv=16)


def test_many_readers_keep_the_two_level_sum():
    """A prompt's last key tile read by the first rows of 18 children: more query blocks than one partial sum
    (float32: ``tiles.key_sum_chunk``, 16), counted across the children's separate row ranges."""
    lens, parents = [20] + [3] * 18, [-1] + [0] * 18
    check(lens, parents, 24, 0, torch.float32, INTERP if DEVICE == "cpu" else None, hq=2, hkv=1)


@pytest.mark.parametrize("window, chunk", [(3, 0), (0, 4), (5, 4)])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_sinks_through_the_op(window, chunk, dtype, tol):
    """out and every gradient (q, k, v and the sinks) through ``shared_prompt_attention(backend="triton")``."""
    if dtype == torch.float64 and DEVICE == "cuda":
        pytest.skip("float64 runs only under the Triton interpreter")
    lens, parents = windowed_forest(4)
    segs, T = forest_segments(lens, parents, DEVICE)
    q, k, v, dout, sinks = inputs(T, 16, 16, seed=4)
    out, *grads, dsinks = oracle(q, k, v, dout, lens, parents, SCALE, window, chunk, sinks)
    x = [t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v, sinks)]
    o = shared_prompt_attention(*x[:3], segs, SCALE, backend="triton", window=window, chunk=chunk, sinks=x[3])
    assert rel(o, out) < tol
    o.backward(dout.to(DEVICE, dtype))
    for name, t, b in zip(("q", "k", "v", "sinks"), x, (*grads, dsinks)):
        assert rel(t.grad, b) < tol, (name, rel(t.grad, b))


def test_supports_windows_and_refuses_bad_ones():
    q = torch.empty(1, 2, 4, 64, device=DEVICE, dtype=torch.bfloat16)
    assert ta.supports(q, window=128, chunk=0, sinks=True) is None and ta.supports(q, chunk=8192) is None
    segs, T = forest_segments([4, 2], [-1, 0], DEVICE)
    x = torch.zeros(1, 1, T, 16, device=DEVICE)
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        ta.forward(x, x, x, segs, SCALE, window=-1)


# --------------------------------------------------------------------------- the host plans


def _lowest(d, window, chunk):
    return max(d - (window or windows.NONE) + 1, d // (chunk or windows.NONE) * (chunk or windows.NONE))


@pytest.mark.parametrize("seed", range(3))
def test_window_schedule_counts_the_walk(seed):
    """Rows 2-4 of ``window_schedule``: the ancestors' full blocks in the walk's order (nearest ancestor first,
    each one's last block first) seen whole by every row, seen by any row (prefixes of that order), and the
    ragged blocks seen by any row, counted here block by block; empty segments included."""
    rng = random.Random(seed)
    for _ in range(20):
        lens, parents = random_forest(rng, max_depth=4, max_len=rng.choice([5, 20, 50]), max_children=3)
        lens = [0 if rng.random() < 0.1 else n for n in lens]
        segs, T = forest_segments(lens, parents)
        rows = host_rows(lens, parents)
        for bm, bn in ((16, 16), (32, 16), (16, 32)):
            for window, chunk in ((3, 0), (17, 0), (0, 33), (5, 7), (1, 0)):
                table = windows.window_schedule(segs, T, bm, bn, window, chunk).tolist()
                for seg, tile, *got in zip(*table):
                    if seg < 0:
                        assert got == [0, 0, 0]
                        continue
                    _, n, parent, prefix, _ = rows[seg]
                    lo = _lowest(prefix + tile * bm, window, chunk)
                    hi = _lowest(prefix + min((tile + 1) * bm, n) - 1, window, chunk)
                    full, ragged, a = [], [], parent
                    while a >= 0:
                        _, na, pa, da, _ = rows[a]
                        full += [(da + j * bn, da + j * bn + bn - 1) for j in reversed(range(na // bn))]
                        ragged += [(da + na // bn * bn, da + na - 1)] if na % bn else []
                        a = pa
                    whole = [first >= hi for first, _ in full]
                    seen = [last >= lo for _, last in full]
                    seen_ragged = [last >= lo for _, last in ragged]
                    for flags in (whole, seen, seen_ragged):  # what the kernels take is a prefix of the walk
                        assert flags == sorted(flags, reverse=True)
                    assert got == [sum(whole), sum(seen), sum(seen_ragged)], (lens, parents, seg, tile)


def test_subtree_next_skips_exactly_a_subtree():
    rng = random.Random(5)
    for _ in range(30):
        lens, parents = random_forest(rng, max_depth=4, max_len=6, max_children=3)
        lens = [0 if rng.random() < 0.2 else n for n in lens]
        nxt = windows.subtree_next(forest_segments(lens, parents)[0]).tolist()
        for s in range(len(lens)):
            below = {j for j in range(len(lens)) if _is_descendant(parents, j, s)}
            assert nxt[s] > s and set(range(s + 1, nxt[s])) <= below
            # what it jumps over of the subtree holds no token
            assert all(lens[j] == 0 for j in below if j >= nxt[s]), (lens, parents, s)


def _is_descendant(parents, j, s):
    while j >= 0:
        j = parents[j]
        if j == s:
            return True
    return False


# --------------------------------------------------------------------------- block skipping


def _value(x):
    return np.asarray(x.handle.data if hasattr(x, "handle") else x).reshape(-1)


class _Blocks:
    """Records the arguments of every call of a kernel module's block function (the interpreter looks the
    function up in the module's globals at each call)."""

    def __init__(self, module, name):
        self.module, self.name, self.calls = module, name, []
        self.orig = getattr(module, name)
        self.params = inspect.signature(self.orig.fn).parameters

    def __enter__(self):
        def record(*args, **kwargs):
            self.calls.append({k: _value(v) for k, v in zip(self.params, args)
                               if k in ("start_n", "col_end", "rows", "offs_n", "col_ok", "start_m", "row_end")})
            return self.orig(*args, **kwargs)

        setattr(self.module, self.name, record)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.orig)


def _segment_end(starts, lens, row):
    i = int(np.searchsorted(starts, row, side="right")) - 1
    while lens[i] == 0:  # empty segments start where the next one does
        i -= 1
    return starts[i] + lens[i]


@pytest.mark.skipif(DEVICE == "cuda", reason="counts the interpreter's calls")
def test_blocks_outside_the_window_are_never_computed():
    """The forward and dQ kernels visit exactly the key blocks that hold a pair some row of the tile sees (the
    rest of the ancestor chain and of the own segment is never loaded); the dK/dV kernel visits no query block
    without a pair; with the window off, each visits many more."""
    from dualkv_compile.kernels.triton import bwd, bwd_dq, fwd

    lens, parents = [70, 40, 9, 33, 50], [-1, 0, 1, 1, -1]
    segs, T = forest_segments(lens, parents)
    starts, seg_lens = segs.seg_start.numpy(), segs.seg_len.numpy()
    q, k, v, dout, _ = inputs(T, 16, 16, seed=3, hq=1, hkv=1)
    bn, counts = 16, {}
    for window, chunk in ((0, 0), (6, 0), (0, 20)):
        mask = dense_mask(segs, T, window, chunk).numpy()
        with _Blocks(fwd, "_fwd_kv_block") as f, _Blocks(bwd_dq, "_dq_kv_block") as d, \
                _Blocks(bwd, "_dkdv_q_block") as kv:
            o, lse = ta.forward(q, k, v, segs, SCALE, 0.0, window, chunk, config=INTERP)
            ta.backward(dout, q, k, v, o, lse, segs, SCALE, True, 0.0, window, chunk, config=INTERP)
        counts[window, chunk] = [len(f.calls), len(d.calls), len(kv.calls)]
        # Every (query tile, key block) of the kernels' partition (blocks from each segment's start) with a pair.
        key_blocks = [range(s, min(s + bn, s0 + n)) for s0, n in zip(starts, seg_lens) for s in range(s0, s0 + n, bn)]
        tiles = [range(s, min(s + 16, s0 + n)) for s0, n in zip(starts, seg_lens) for s in range(s0, s0 + n, 16)]
        needed = sorted((t[0], b[0]) for t in tiles for b in key_blocks if mask[np.ix_(list(t), list(b))].any())
        for calls in (f.calls, d.calls):
            visited = sorted((int(c["rows"][0]), int(c["start_n"][0])) for c in calls)
            assert visited == needed, (window, chunk)
        for c in kv.calls:  # the dK/dV kernel's query blocks start anywhere: each one holds a visible pair
            keys = c["offs_n"][c["col_ok"]]
            start, end = int(c["start_m"][0]), int(c["row_end"][0])
            rows = start + np.arange(16)
            rows = rows[rows < min(end, _segment_end(starts, seg_lens, start))]
            assert mask[np.ix_(rows, keys)].any(), (window, chunk, start, keys)
    full = counts[0, 0]
    for window_chunk in ((6, 0), (0, 20)):
        assert all(2 * a < b for a, b in zip(counts[window_chunk], full)), counts


# --------------------------------------------------------------------------- GPU, realistic sizes

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_windows_realistic_and_compiled_once(D):
    """An 8K prompt with responses, bf16, the tuning table's tiles, gpt-oss's window (128), Gemma's (4096),
    Llama 4's chunks (8192) and a small odd pair: against the float32 reference on one kv head's query heads;
    the window sizes and a second layout reuse the windowed kernels (one compiled variant each)."""
    from dualkv_compile.kernels import reference
    from dualkv_compile.kernels.common.row_statistics import bwd_preprocess_kernel
    from dualkv_compile.kernels.triton.bwd import bwd_dkdv_kernel, bwd_dq_kernel
    from dualkv_compile.kernels.triton.fwd import shared_prompt_fwd_kernel

    kernels = (shared_prompt_fwd_kernel, bwd_preprocess_kernel, bwd_dkdv_kernel, bwd_dq_kernel)

    def compiled():
        return sum(len(cache[0]) for kern in kernels for cache in kern.device_caches.values())

    counts = []
    for i, (lens, parents, window, chunk) in enumerate([
            ([8192, 1000, 517, 1, 700], [-1, 0, 0, 0, 0], 128, 0),
            ([8192, 1000, 517, 1, 700], [-1, 0, 0, 0, 0], 4096, 0),
            ([3000, 5000, 800, 300, 1200], [-1, 0, 1, 1, 0], 0, 8192),
            ([3000, 5000, 800, 300, 1200], [-1, 0, 1, 1, 0], 100, 7)]):
        segs, T = forest_segments(lens, parents, DEVICE)
        g = torch.Generator().manual_seed(i)
        q, k, v, do = (torch.randn(1, h, T, D, generator=g).to(DEVICE, torch.bfloat16) for h in (8, 2, 2, 8))
        scale = D ** -0.5
        out, lse = ta.forward(q, k, v, segs, scale, 0.0, window, chunk)
        grads = ta.backward(do, q, k, v, out, lse, segs, scale, True, 0.0, window, chunk)
        counts.append(compiled())
        x = [t[:, :4].float() for t in (q, do)] + [t[:, :1].float() for t in (k, v)]  # kv head 0, its query heads
        ro, rl = reference.reference_forward(x[0], x[2], x[3], segs, scale, window=window, chunk=chunk)
        rg = reference.reference_backward(x[1], x[0], x[2], x[3], ro, rl, segs, scale, window=window, chunk=chunk)
        assert rel(out[:, :4], ro) < 1e-2 and rel(lse[:, :4], rl) < 1e-4
        for a, b in zip((grads[0][:, :4], grads[1][:, :1], grads[2][:, :1]), rg):
            assert rel(a, b) < 1e-2
    assert counts[1:] == counts[:1] * 3, counts
