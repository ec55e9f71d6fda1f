"""Tests of the FlexAttention mask's math (dualkv_compile/kernels/flex/).

The BlockMask tables built from the Segments against the dense mask (every
needed block present, FULL blocks only where the whole tile is visible, the
transposed tables the exact transpose), the tree mask_mod against the dense
mask, on two-level groups, hand-written prefix forests and random forests
(depth 1 to 3, several roots, one-token and empty nodes); the same with
sliding and chunked windows on token depth (``dense_mask(segs, T, window,
chunk)``: every block empty, partial or FULL exactly as the dense mask says,
the windowed mask_mod equal to it); and the Triton builder against the torch
builder under the Triton interpreter, with and without windows. The op-level
tests (the custom op, tracing, the CUDA runs) are in tests/ops/test_flex.py.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.register_assert_rewrite("flex_layouts")

from dualkv_compile.kernels import flex  # noqa: E402
from dualkv_compile.layout.segments import dense_mask, token_depth, token_reach  # noqa: E402
from flex_layouts import FIXED_FORESTS, FIXED_LAYOUTS, random_forest_layouts, random_groups  # noqa: E402  (on sys.path)
from segments import forest_segments, make_segments  # noqa: E402  tests/kernels is on sys.path


def _dense_from_ordered(num, idx, nb):
    d = torch.zeros(nb, nb, dtype=torch.bool)
    for r in range(nb):
        n = int(num[0, 0, r])
        d[r, idx[0, 0, r, :n].long()] = True
    return d


def _block_truth(mask: torch.Tensor, T: int, B: int):
    """(any, all) per (query block, kv block) of the token mask; 'all' over valid rows, keys past T unseen."""
    nb = (T + B - 1) // B
    if nb == 0:
        return torch.zeros(0, 0, dtype=torch.bool), torch.zeros(0, 0, dtype=torch.bool)
    pad = torch.zeros(nb * B, nb * B, dtype=torch.bool)
    pad[:T, :T] = mask
    tiles = pad.view(nb, B, nb, B).permute(0, 2, 1, 3)  # [qb, kb, B, B]
    any_ = tiles.any(-1).any(-1)
    all_ = torch.stack([tiles[qb, :, : min(B, T - qb * B)].all(-1).all(-1) for qb in range(nb)])
    return any_, all_


def _all_layouts():
    rng = random.Random(1234)
    groups = FIXED_LAYOUTS + [random_groups(rng) for _ in range(10)]
    return [pytest.param(make_segments(g), id=f"groups{i}") for i, g in enumerate(groups)]


def _all_forests():
    forests = list(FIXED_FORESTS)
    for seed in range(6):  # several seeds, each a few forests; small lengths make blocks meet many nodes
        forests += random_forest_layouts(random.Random(seed), 3, max_len=[40, 300][seed % 2])
    return [pytest.param(forest_segments(*f), id=f"forest{i}") for i, f in enumerate(forests)]


# (window, chunk) against blocks of 128: windows inside a block, one block, across blocks; chunks likewise;
# both; chunks of one token (each token sees only itself).
WINDOWS = [(2, 0), (100, 0), (128, 0), (300, 0), (0, 1), (0, 128), (0, 200), (300, 200), (129, 64)]


def _check_tables(segs, T, window=0, chunk=0):
    tables = flex.block_tables(flex.segment_table(segs, T), T, window=window, chunk=chunk)
    assert len(tables) == 11
    kv_num, kv_idx, fkv_num, fkv_idx, q_num, q_idx, fq_num, fq_idx, reach, depth, limit = tables
    nb = (T + flex.BLOCK - 1) // flex.BLOCK
    assert kv_idx.shape == (1, 1, nb, nb) and kv_num.shape == (1, 1, nb)
    assert reach.shape == depth.shape == limit.shape == (T,)
    assert all(t.dtype == torch.int32 and t.is_contiguous() for t in tables)  # the kernels assume unit strides
    assert torch.equal(reach.long(), token_reach(segs, T))
    assert torch.equal(depth.long(), token_depth(segs, T))
    partial = _dense_from_ordered(kv_num, kv_idx, nb)
    full = _dense_from_ordered(fkv_num, fkv_idx, nb)
    mask = dense_mask(segs, T, window, chunk)
    any_, all_ = _block_truth(mask, T, flex.BLOCK)
    assert not (partial & full).any()
    assert torch.equal(partial | full, any_), "needed blocks must be exactly the blocks with a visible pair"
    assert not (full & ~all_).any(), "a FULL block must be visible in full"
    # Tight: every fully visible block is FULL, except the ragged last kv block (never FULL by design).
    missed = all_ & ~full
    if T % flex.BLOCK:
        missed[:, -1] = False
    assert not missed.any()
    # The backward's tables are the exact transposes.
    assert torch.equal(_dense_from_ordered(q_num, q_idx, nb), partial.t())
    assert torch.equal(_dense_from_ordered(fq_num, fq_idx, nb), full.t())
    # Indices past the counts are still valid block indices (kernels may prefetch them).
    if nb:
        assert int(kv_idx.min()) >= 0 and int(kv_idx.max()) < nb
    # The mask_mod reproduces the dense mask on every pair.
    mm = flex.windowed_mask_mod(reach, depth, limit) if window or chunk else flex.tree_mask_mod(reach)
    qi = torch.arange(T)[:, None]
    ki = torch.arange(T)[None, :]
    assert torch.equal(mm(0, 0, qi, ki), mask)
    return partial, full


@pytest.mark.parametrize("segs_T", _all_layouts())
def test_block_tables_match_dense_mask(segs_T):
    _check_tables(*segs_T)


@pytest.mark.parametrize("segs_T", _all_forests())
def test_block_tables_match_dense_mask_forest(segs_T):
    _check_tables(*segs_T)


def test_block_tables_small_streams():
    """Streams shorter than a block, a single token, and the empty stream."""
    for lens, parents in (([1], [-1]), ([3, 1, 2], [-1, 0, 0]), ([5, 0], [-1, 0]), ([], [])):
        for window, chunk in [(0, 0)] + WINDOWS[:2] + WINDOWS[4:6]:
            _check_tables(*forest_segments(lens, parents), window, chunk)


def _window_layouts():
    rng = random.Random(99)
    specs = [make_segments(g) for g in FIXED_LAYOUTS] + [forest_segments(*f) for f in FIXED_FORESTS]
    specs += [forest_segments(*f) for f in random_forest_layouts(rng, 3, max_len=200)]
    return [pytest.param(s, id=f"layout{i}") for i, s in enumerate(specs)]


@pytest.mark.parametrize("segs_T", _window_layouts())
def test_windowed_block_tables_match_dense_mask(segs_T):
    """Every (query block, kv block) empty, partial or FULL exactly as the windowed dense mask says."""
    for window, chunk in WINDOWS:
        _check_tables(*segs_T, window, chunk)


def test_sliding_window_skips_blocks_behind_it():
    """A prompt of 1024 with a window of 256: each prompt row block reads its diagonal, one FULL block and one
    partial one, nothing older; a response's first block (depths 1024..1151) reads the prompt's block 7 in full
    (depths 896..1023), block 6 in part, and nothing of the other response."""
    segs, T = make_segments([(1024, [256, 256])])
    partial, full = _check_tables(segs, T, 256, 0)
    for qb in range(2, 8):
        assert partial[qb, qb] and full[qb, qb - 1] and partial[qb, qb - 2], qb
        assert not (partial | full)[qb, : qb - 2].any(), qb
    for qb in (8, 10):
        assert (partial | full)[qb].nonzero().flatten().tolist() == [6, 7, qb], qb
        assert full[qb, 7] and partial[qb, 6] and partial[qb, qb], qb


def test_chunks_cut_at_depth_not_position():
    """Chunks of 256 on a prompt of 300, two responses of 400. The first response's rows 384..511 (depths
    384..511) share the chunk [256, 512) with every key of block 2 (prompt depths 256..299, then their own
    response), so block 2 is FULL across the prompt's end and blocks 0 and 1 are skipped. The second
    response's rows 768..895 (depths 368..495) read only the prompt's last 44 keys of block 2, their own
    response's start in block 5, and their diagonal: all three partial."""
    segs, T = make_segments([(300, [400, 400])])
    partial, full = _check_tables(segs, T, 0, 256)
    assert (partial | full)[3].nonzero().flatten().tolist() == [2, 3] and full[3, 2] and partial[3, 3]
    assert partial[6].nonzero().flatten().tolist() == [2, 5, 6] and not full[6].any()


_INTERPRET_CHECK = """
import os, random, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n"])
def probe(x_ptr, n):
    acc = tl.load(x_ptr) * 0
    for i in range(0, n, 2):
        acc += 1
    tl.store(x_ptr, acc)


try:  # some Triton interpreters (3.6) cannot loop to a runtime bound; compiled kernels can
    probe[(1,)](torch.tensor([3], dtype=torch.int32), 5)
except Exception as e:
    print("SKIP", type(e).__name__, e)
    sys.exit(0)
sys.path.insert(0, {tests!r})
from flex_layouts import FIXED_FORESTS, FIXED_LAYOUTS, random_forest_layouts, random_groups, same_tables as _same_tables
from segments import forest_segments, make_segments
from dualkv_compile.kernels import flex
from dualkv_compile.ops import flex as flex_op
rng = random.Random(7)
layouts = [make_segments(g) for g in FIXED_LAYOUTS + [random_groups(rng) for _ in range(4)]]
layouts += [forest_segments(*f) for f in FIXED_FORESTS + random_forest_layouts(rng, 6)]
windows = [(0, 0)] + [(2, 0), (300, 0), (0, 200), (129, 64)] * (len(layouts) // 4 + 1)
for i, (segs, T) in enumerate(layouts):
    table = flex.segment_table(segs, T)
    # every layout plain and with one of the windows (the windows round-robin over the layouts)
    for window, chunk in ((0, 0), windows[i + 1]):
        want = flex.block_tables(table, T, window=window, chunk=chunk)
        _same_tables(want, flex.triton_block_tables(table, T, segs.max_seg_len, window, chunk))
        flex_op.FORCE_TRITON_BUILDER = True  # through the custom op (outputs must not alias)
        _same_tables(want, flex_op.block_tables_op(table, T, segs.max_seg_len, window, chunk))
        flex_op.FORCE_TRITON_BUILDER = False
# A huge window or chunk is clamped for the kernels' int32 arguments: the same limits as none.
segs, T = layouts[0]
table = flex.segment_table(segs, T)
_same_tables(flex.block_tables(table, T, window=1 << 40, chunk=1 << 35),
             flex.triton_block_tables(table, T, segs.max_seg_len, 1 << 40, 1 << 35))
print("OK")
"""


def test_triton_builder_matches_torch_builder_interpreted():
    """The CUDA builder's Triton kernels, run by the Triton interpreter on CPU, against the torch builder."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    here = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(here.parents[1]), os.environ.get("PYTHONPATH", "")]))
    code = _INTERPRET_CHECK.format(tests=str(here))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if res.returncode == 0 and res.stdout.startswith("SKIP"):
        pytest.skip(f"this Triton interpreter cannot run the builder: {res.stdout.strip()}")
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]
