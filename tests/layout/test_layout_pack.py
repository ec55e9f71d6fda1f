"""Tests of dualkv_compile.layout.pack / unpack by hand: values, trailing dims and dtypes, gradients.

Which sequence a shared node is read from, how unpack's backward sums the
shared copies, and gradcheck of both on the veRL and mixed cases of
``layout_cases.py``.
"""

from __future__ import annotations

import pytest
import torch

from dualkv_compile.layout import detect, pack, unpack

from .layout_cases import MIXED_IDS, MIXED_MASK, VERL_IDS, VERL_MASK


pytestmark = pytest.mark.usefixtures("one_thread")


def test_pack_unpack_by_hand():
    L = detect(VERL_IDS, VERL_MASK)
    x = torch.arange(21.0).view(3, 7) + 100
    x[1:, 1:4] = x[0, 1:4]  # the shared columns agree across the sequences
    p = pack(x, L)
    assert p.tolist() == [101, 102, 103, 104, 105, 106, 111]
    assert unpack(p, L).tolist() == [
        [0, 101, 102, 103, 104, 105, 106],
        [0, 101, 102, 103, 111, 0, 0],
        [0, 101, 102, 103, 0, 0, 0],
    ]


def test_pack_unpack_trailing_dims_and_dtypes():
    L = detect(VERL_IDS, VERL_MASK)
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        x = torch.ones(3, 7, 2, 3, dtype=dtype)
        p = pack(x, L)
        assert p.shape == (7, 2, 3) and p.dtype == dtype
        u = unpack(p, L)
        assert u.shape == (3, 7, 2, 3) and u.dtype == dtype
        assert u.to(torch.long).sum(dim=(2, 3)).tolist() == (VERL_MASK * 6).tolist()


def test_pack_reads_each_node_from_its_first_sequence():
    # The docstring's guarantee: a shared node comes from the first sequence that holds it.
    L = detect(VERL_IDS, VERL_MASK)
    x = torch.arange(21.0, dtype=torch.float64).view(3, 7).requires_grad_()
    g = torch.arange(1.0, 8.0, dtype=torch.float64)
    pack(x, L).backward(g)
    assert x.grad.tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 7, 0, 0], [0, 0, 0, 0, 0, 0, 0]]


def test_unpack_gradient_sums_shared_copies_by_hand():
    L = detect(VERL_IDS, VERL_MASK)
    y = torch.zeros(7, dtype=torch.float64, requires_grad=True)
    g = torch.tensor(
        [
            [1000.0, 1, 2, 4, 8, 16, 32],
            [2000.0, 64, 128, 256, 512, 3000, 4000],
            [5000.0, 1024, 2048, 4096, 6000, 7000, 8000],
        ],
        dtype=torch.float64,
    )  # the large values sit at padding: they must not reach y
    unpack(y, L).backward(g)
    assert y.grad.tolist() == [1 + 64 + 1024, 2 + 128 + 2048, 4 + 256 + 4096, 8, 16, 32, 512]


def test_gradcheck_pack_and_unpack():
    L = detect(MIXED_IDS, MIXED_MASK)
    y = torch.randn(L.num_tokens, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: unpack(t, L), (y,))
    assert torch.autograd.gradgradcheck(lambda t: unpack(t, L), (y,))
    x = torch.randn(6, 6, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: pack(t, L), (x,))
    L = detect(VERL_IDS, VERL_MASK)
    y = torch.randn(L.num_tokens, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: unpack(t, L), (y,))
