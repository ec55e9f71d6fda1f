"""Tests of the FlexAttention mask's math (dualkv_compile/kernels/flex/).

The BlockMask tables built from the Segments against the dense mask (every
needed block present, FULL blocks only where the whole tile is visible, the
transposed tables the exact transpose), the two-region mask_mod against the
dense mask, and the Triton builder against the torch builder under the
Triton interpreter. The op-level tests (the custom op, tracing, the CUDA
runs) are in tests/ops/test_flex.py.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.register_assert_rewrite("flex_layouts")

from dualkv_compile.kernels import flex  # noqa: E402
from dualkv_compile.layout import dense_mask  # noqa: E402
from flex_layouts import FIXED_LAYOUTS, random_groups  # noqa: E402  tests/kernels is on sys.path
from segments import make_segments  # noqa: E402  tests/kernels is on sys.path


def _dense_from_ordered(num, idx, nb):
    d = torch.zeros(nb, nb, dtype=torch.bool)
    for r in range(nb):
        n = int(num[0, 0, r])
        d[r, idx[0, 0, r, :n].long()] = True
    return d


def _block_truth(mask: torch.Tensor, T: int, B: int):
    """(any, all) per (query block, kv block) of the token mask; 'all' over valid rows, keys past T unseen."""
    nb = (T + B - 1) // B
    pad = torch.zeros(nb * B, nb * B, dtype=torch.bool)
    pad[:T, :T] = mask
    tiles = pad.view(nb, B, nb, B).permute(0, 2, 1, 3)  # [qb, kb, B, B]
    any_ = tiles.any(-1).any(-1)
    all_ = torch.stack([tiles[qb, :, : min(B, T - qb * B)].all(-1).all(-1) for qb in range(nb)])
    return any_, all_


def _all_layouts():
    rng = random.Random(1234)
    return FIXED_LAYOUTS + [random_groups(rng) for _ in range(10)]


@pytest.mark.parametrize("groups", _all_layouts())
def test_block_tables_match_dense_mask(groups):
    segs, T = make_segments(groups)
    tables = flex.block_tables(flex.segment_table(segs, T), T)
    kv_num, kv_idx, fkv_num, fkv_idx, q_num, q_idx, fq_num, fq_idx, own_start, pre_start, pre_end = tables
    nb = (T + flex.BLOCK - 1) // flex.BLOCK
    assert kv_idx.shape == (1, 1, nb, nb) and kv_num.shape == (1, 1, nb)
    assert all(t.dtype == torch.int32 and t.is_contiguous() for t in tables)  # the kernels assume unit strides
    partial = _dense_from_ordered(kv_num, kv_idx, nb)
    full = _dense_from_ordered(fkv_num, fkv_idx, nb)
    mask = dense_mask(segs, T)
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
    assert int(kv_idx.min()) >= 0 and int(kv_idx.max()) < nb
    # The mask_mod reproduces the dense mask on every pair.
    mm = flex.two_region_mask_mod(own_start, pre_start, pre_end)
    qi = torch.arange(T)[:, None]
    ki = torch.arange(T)[None, :]
    assert torch.equal(mm(0, 0, qi, ki), mask)


def test_prompt_blocks_are_full():
    """Prompt-region blocks fully inside the prefix are FULL for every response's query blocks."""
    P, N, R = 1024, 3, 512
    segs, T = make_segments([(P, [R] * N)])
    kv_num, kv_idx, fkv_num, fkv_idx, *_ = flex.block_tables(flex.segment_table(segs, T), T)
    nb = T // 128
    full = _dense_from_ordered(fkv_num, fkv_idx, nb)
    for qb in range(P // 128, nb):
        assert full[qb, : P // 128].all()
    # Prompt rows: strictly-below-diagonal blocks are FULL, the diagonal is partial.
    assert full[7, :7].all() and not full[7, 7]
    assert int(kv_num[0, 0, 7]) == 1


_INTERPRET_CHECK = """
import os, random, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
import triton
import triton.language as tl


@triton.jit
def probe(x_ptr):
    n = tl.load(x_ptr)
    acc = n * 0
    for i in range(0, n):
        acc += 1
    tl.store(x_ptr, acc)


try:  # some Triton interpreters cannot loop to a loaded bound; compiled kernels can
    probe[(1,)](torch.tensor([3], dtype=torch.int32))
except Exception as e:
    print("SKIP", type(e).__name__, e)
    sys.exit(0)
sys.path.insert(0, {tests!r})
from flex_layouts import FIXED_LAYOUTS, random_groups, same_tables as _same_tables
from segments import make_segments
from dualkv_compile.kernels import flex
from dualkv_compile.ops import flex as flex_op
rng = random.Random(7)
for groups in FIXED_LAYOUTS + [random_groups(rng) for _ in range(4)]:
    segs, T = make_segments(groups)
    table = flex.segment_table(segs, T)
    want = flex.block_tables(table, T)
    _same_tables(want, flex.triton_block_tables(table, T, segs.max_seg_len))
    flex_op.FORCE_TRITON_BUILDER = True  # through the custom op (outputs must not alias)
    _same_tables(want, flex_op.block_tables_op(table, T, segs.max_seg_len))
    flex_op.FORCE_TRITON_BUILDER = False
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
