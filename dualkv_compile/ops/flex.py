"""The FlexAttention backend's op and dispatch: ``dualkv::flex_block_tables``, ``block_mask`` and the protocol.

The math lives in ``kernels/flex`` (the segment table, the torch and Triton block-table builders, the
``mask_mod``s, the FlexAttention calls: ``attention.py``). This module: the opaque custom op
``dualkv::flex_block_tables`` with its fake implementation (small Triton kernels on CUDA, eager torch ops on
CPU), ``block_mask`` (a packed stream's ``BlockMask``, built from the ``Segments`` tensors with no device sync),
and the backend protocol over ``Segments`` (``supports``, ``forward``, ``backward``) plus ``attention``, each a
``block_mask`` and a call into ``kernels.flex.attention``.

Guarantees: ``attention`` runs FlexAttention under autograd, so its own fused backward runs (under an outer
``torch.compile``, AOTAutograd derives it); the protocol's ``backward`` (the opaque ``dualkv::attention_bwd`` with
``backend="flex"``) recomputes the forward: exact, one extra forward. Window sizes, like every length of the
layout, are data: a new layout or window recompiles nothing.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..kernels.flex import attention as flex_math
from ..kernels.flex.attention import compiled_flex, supports
from ..kernels.flex.block_tables import BLOCK, block_tables, segment_table
from ..kernels.flex.triton_block_tables import triton_block_tables, triton_kernels
from ..layout.segments import Segments

__all__ = ["supports", "forward", "backward", "attention", "block_mask", "block_tables", "block_tables_op", "segment_table", "BLOCK",
           "FORCE_TRITON_BUILDER", "compiled_flex"]

FORCE_TRITON_BUILDER = False  # tests: run the Triton builder on CPU tensors (under TRITON_INTERPRET=1)


# The builder runs as one opaque custom op: eager torch ops on CPU (``block_tables``),
# four small Triton kernels on CUDA (``triton_block_tables``). Opaque, it traces
# under torch.compile with dynamic shapes without Inductor having to lower the
# builder, and it never recompiles: the kernels do not specialise on lengths.
@torch.library.custom_op("dualkv::flex_block_tables", mutates_args=())
def block_tables_op(table: torch.Tensor, num_tokens: int, max_seg_len: int, window: int = 0,
                    chunk: int = 0) -> list[torch.Tensor]:
    if (table.device.type == "cuda" or FORCE_TRITON_BUILDER) and triton_kernels() is not None:
        return list(triton_block_tables(table, num_tokens, max_seg_len, window, chunk))
    return list(block_tables(table, num_tokens, window=window, chunk=chunk))


@block_tables_op.register_fake
def _(table, num_tokens, max_seg_len, window=0, chunk=0):
    nb = (num_tokens + BLOCK - 1) // BLOCK
    i32 = dict(dtype=torch.int32)
    nums = [table.new_empty((1, 1, nb), **i32) for _ in range(4)]
    idxs = [table.new_empty((1, 1, nb, nb), **i32) for _ in range(4)]
    per_token = [table.new_empty((num_tokens,), **i32) for _ in range(3)]  # reach, depth, limit
    return [nums[0], idxs[0], nums[1], idxs[1], nums[2], idxs[2], nums[3], idxs[3], *per_token]


def block_mask(segs: Segments, num_tokens: int, *, builder: str = "op", window: int = 0, chunk: int = 0):
    """The prefix-forest ``BlockMask`` of a packed stream of ``num_tokens`` tokens (no device sync).

    ``window`` / ``chunk`` (0: none): the sliding window and chunk size on
    token depth. ``builder="op"`` (default) runs ``dualkv::flex_block_tables``
    (Triton on CUDA); ``builder="torch"`` runs ``block_tables`` with eager
    torch ops.
    """
    if flex_math.IMPORT_ERROR is not None:
        raise RuntimeError(flex_math.IMPORT_ERROR)
    if builder not in ("op", "torch"):
        raise ValueError(f"builder must be 'op' or 'torch', got {builder!r}")
    table = segment_table(segs, num_tokens)
    if builder == "op":
        tables = block_tables_op(table, num_tokens, segs.max_seg_len, window, chunk)
    else:
        tables = block_tables(table, num_tokens, window=window, chunk=chunk)
    return flex_math.mask_of(tables, num_tokens, bool(window or chunk))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segs: Segments, scale: Optional[float] = None,
              softcap: Optional[float] = None, window: int = 0, chunk: int = 0,
              sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Differentiable prefix-forest attention through FlexAttention; returns ``[1, Hq, T, Dv]``.

    ``window`` / ``chunk`` (0: none) narrow the mask on token depth; ``sinks``
    (None or ``[Hq]``) adds each head's sink logit to every row's denominator,
    its gradient included. The backward is FlexAttention's fused backward (no
    recomputed forward), taking the lse's gradient where sinks are set.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    bm = block_mask(segs, q.shape[2], window=window, chunk=chunk)
    return flex_math.attention(q, k, v, bm, scale, softcap, sinks)


def forward(q, k, v, segs: Segments, scale: float, softcap: float = 0.0, window: int = 0, chunk: int = 0):
    """Module protocol: ``(out, lse)``, lse float32 ``[1, Hq, T]`` in natural log."""
    return flex_math.forward(q, k, v, block_mask(segs, q.shape[2], window=window, chunk=chunk), scale, softcap)


def backward(dout, q, k, v, out, lse, segs: Segments, scale: float, deterministic: bool = False, softcap: float = 0.0,
             window: int = 0, chunk: int = 0):
    """Module protocol: ``(dq, dk, dv)`` at the saved ``out`` and ``lse`` by recomputing the forward under autograd
    (``kernels.flex.attention.backward``; ``attention``, the default path of ``shared_prompt_attention``, avoids
    the extra forward). Deterministic whatever ``deterministic`` says: FlexAttention's backward has no atomics."""
    bm = block_mask(segs, q.shape[2], window=window, chunk=chunk)
    return flex_math.backward(dout, q, k, v, out, lse, bm, scale, softcap)
