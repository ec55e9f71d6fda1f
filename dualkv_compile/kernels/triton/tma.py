"""Hopper tensor descriptors (TMA) over the Triton kernels' operands, where the hardware and the strides allow.

    interpreting()                      -> whether Triton runs kernels in its CPU interpreter
    tma_view(t, block_rows)             -> (descriptor, row_h, col_h) or None
    descriptors(cfg, block_rows, a, b)  -> (kernel arguments, TMA flag)
    row_stats_descriptor(stats, rows)   -> descriptor over the packed row statistics

Assumes: operands are ``[1, H, T, D]`` views with any strides (one head's
rows addressed as ``row_h``/``col_h`` offsets into one 2-D view:
``common.tma.tma_geometry``, which the Gluon kernels' descriptors share); the
interpreter flag (``TRITON_INTERPRET``) is read at call time.

Guarantees: a descriptor is only returned when every tile of every head it
will be asked for is addressable in it and the copy engine's alignment rules
hold (16-byte base, row stride and row width); otherwise the caller gets
``None`` / the "off" arguments and the kernels load through pointers, with
the same results. Nothing here touches the device's memory.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..common.launch import block_d
from ..common.tma import tma_geometry
from ..device import capability

__all__ = ["interpreting", "tma_view", "descriptors", "row_stats_descriptor"]


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET`` set and not 0)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def tma_view(t: torch.Tensor, block_rows: int) -> Optional[tuple]:
    """``(descriptor, row_h, col_h)``: a 2-D tensor descriptor over ``t`` [1, H, T, D] (``tma_geometry``'s
    view) in which the ``block_rows`` x D tile of head h at token r is ``load([h * row_h + r, h * col_h])``;
    None where the view does not exist.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    geometry = tma_geometry(t)
    if geometry is None:
        return None
    shape, strides, row_h, col_h = geometry
    return TensorDescriptor(t, shape, strides, [block_rows, t.shape[3]]), row_h, col_h


def descriptors(cfg, block_rows: int, a: torch.Tensor, b: torch.Tensor) -> tuple[list, bool]:
    """Kernel arguments ``[A_DESC, B_DESC, a_row_h, a_col_h, b_row_h, b_col_h]`` and the TMA flag.

    ``cfg`` is the launch's ``attention.KernelConfig`` (only its ``tma`` flag is read).

    TMA needs Hopper or newer (or the interpreter, for tests) and an unpadded
    head dim; otherwise, or when either operand has no descriptor view, the
    kernels load through pointers.
    """
    off = [None, None, 0, 0, 0, 0], False
    if not cfg.tma or a.shape[-1] != block_d(a.shape[-1]):
        return off
    if a.device.type == "cuda":
        if capability(a.device)[0] < 9:
            return off
    elif not interpreting():
        return off
    va, vb = tma_view(a, block_rows), tma_view(b, block_rows)
    if va is None or vb is None:
        return off
    return [va[0], vb[0], va[1], va[2], vb[1], vb[2]], True


def row_stats_descriptor(stats: torch.Tensor, block_rows: int):
    """A descriptor over the packed per-row statistics of the dK/dV kernel.

    ``stats`` is ``[H * T, 4]`` float32 (float64 for float64 inputs), written by the preprocess kernel: (lse in
    base 2, 0, Delta, 0) per row, so one bulk copy per block
    (16-byte rows, every copy starting at column 0) replaces two 4-byte pointer
    loads per column that a thread holds.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(stats, list(stats.shape), [4, 1], [block_rows, 4])
