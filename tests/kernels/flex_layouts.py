"""Shared by the FlexAttention tests (tests/kernels/test_flex_block_tables.py, tests/ops/test_flex.py):
packed-stream layouts (two-level groups and prefix forests) and the comparison of two sets of block tables."""

from __future__ import annotations

import random

import torch


def random_groups(rng: random.Random, max_p=600, max_r=400):
    return [
        (rng.randint(1, max_p), [rng.randint(1, max_r) for _ in range(rng.randint(0, 5))])
        for _ in range(rng.randint(1, 4))
    ]


FIXED_LAYOUTS = [
    [(300, [100, 200, 5])],
    [(128, [128, 128])],  # block-aligned
    [(1000, [1, 1, 1, 300]), (5, [1, 2])],  # one-token segments, a tiny group
    [(257, [1000]), (64, [3, 3, 3, 3, 3, 3, 3, 3, 300])],  # many segments in one block
    [(700, [])],  # a lone row
    [(127, [129]), (129, [127, 1])],  # boundaries one off the block size
]


# Prefix forests as (seg_len, parent) in pre-order: deeper than the two-level groups.
FIXED_FORESTS = [
    ([300, 100, 50, 60, 200, 5], [-1, 0, 1, 1, 0, 4]),  # depth 3, ragged
    ([128, 128, 128, 128], [-1, 0, 1, 2]),  # a block-aligned chain (one sequence)
    ([1, 1, 1, 300, 1, 1, 129], [-1, 0, 1, 2, 0, 4, -1]),  # one-token nodes on a chain, a second root
    ([200, 0, 40, 7, 0, 1], [-1, 0, 1, 0, 3, 3]),  # empty nodes (a parent and a leaf)
    ([127, 129, 1, 127, 255], [-1, 0, 1, -1, 3]),  # boundaries one off the block size
]


def random_forest_layouts(rng: random.Random, n: int, max_len: int = 300):
    """``n`` random forests (depth 1 to 3, several roots, one-token nodes likely) as (seg_len, parent)."""
    try:  # imported as tests.kernels.flex_layouts (tests/ops) or as flex_layouts (tests/kernels on sys.path)
        from .segments import random_forest
    except ImportError:
        from segments import random_forest

    return [random_forest(rng, rng.randint(1, 3), max_len=max_len) for _ in range(n)]


def same_tables(a, b):
    """Equal block tables: counts and per-token tables exactly, index rows within their counts."""
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape and x.dtype == y.dtype == torch.int32, i
        assert x.is_contiguous() and y.is_contiguous(), i
        if i in (1, 3, 5, 7):  # index tables: only the first count entries of a row are meaningful
            n = a[i - 1][0, 0].long()
            keep = torch.arange(x.shape[-1], device=x.device)[None, :] < n[:, None]
            assert torch.equal(x[0, 0][keep], y[0, 0][keep]), i
            assert int(y.min()) >= 0 and int(y.max()) < y.shape[-1], i
        else:
            assert torch.equal(x, y), i
