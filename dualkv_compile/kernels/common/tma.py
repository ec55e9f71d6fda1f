"""The 2-D view of an attention operand that a Hopper tensor descriptor (TMA) needs, where the strides allow.

    tma_geometry(t)   -> (shape, strides, row_h, col_h) of a 2-D view over t [1, H, T, D], or None

Both backends build their descriptors on it: the Triton kernels' (``triton/tma.py``, Triton's host descriptor)
and the Gluon kernels' (``gluon/attention.py``, Gluon's). Assumes operands are ``[1, H, T, D]`` views with any
strides (one head's rows addressed as ``row_h``/``col_h`` offsets into one 2-D view). Guarantees: a geometry
only where every tile of every head is addressable in that view and the copy engine's alignment rules hold
(16-byte base, row stride and row width); otherwise None. Nothing here touches the device's memory.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["tma_geometry"]


def tma_geometry(t: torch.Tensor) -> Optional[tuple]:
    """``(shape, strides, row_h, col_h)`` of a 2-D view over ``t`` [1, H, T, D] in which head h's
    token r starts at ``[h * row_h + r, h * col_h]``; None where no such view exists.

    Two layouts have such a view: head-major (the head stride a multiple of the
    token stride, e.g. contiguous [1, H, T, D]) and token-major (the token
    stride a multiple of the head stride, e.g. a [T, H * D] projection viewed as
    [1, H, T, D]). None for anything else, or where the copy engine's
    alignment rules (16-byte base and row stride) do not hold.
    """
    _, H, T, D = t.shape
    sh, st, sd = t.stride(1), t.stride(2), t.stride(3)
    es = t.element_size()
    if T < 2 or sd != 1 or t.data_ptr() % 16 or (st * es) % 16 or (D * es) % 16:
        return None
    if H == 1:
        return [T, D], [st, 1], 0, 0
    if sh % st == 0:
        return [(H - 1) * (sh // st) + T, D], [st, 1], sh // st, 0
    if st % sh == 0 and sh >= D and (sh * es) % 16 == 0:
        return [T, (H - 1) * sh + D], [st, 1], 0, sh
    return None
