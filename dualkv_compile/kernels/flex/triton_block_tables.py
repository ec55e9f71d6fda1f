"""The FlexAttention mask's block tables computed by four small Triton kernels (the CUDA builder).

    triton_kernels()                                  -> the four jitted kernels, or None without Triton
    triton_block_tables(table, T, max_seg_len)        -> what ``block_tables.block_tables`` returns

Assumes: ``table`` is ``block_tables.segment_table(segs, T)`` (int32, with its
sentinel column) on the device the kernels run on (CUDA, or CPU under
``TRITON_INTERPRET=1``), and ``max_seg_len`` bounds every segment's length.
The kernels are defined on first use, so importing this module never needs
Triton.

Guarantees: the same tables as the torch builder (counts and per-token
table exactly; index rows equal within their counts, zeros past them, so
they stay valid block indices). The kernels follow the torch builder step
by step: each token's reach (one program per segment and chunk), each kv
block's least and greatest reach, then one program per query block
classifies and compacts its row and one per kv block its column; a whole
``ops.flex.block_mask`` took 0.22 ms at T = 51K (NB = 398) on an H200,
against 0.76 ms with the torch builder. Lengths are not specialised
(``do_not_specialize``): a new layout never recompiles. Every output is its
own allocation (a custom op's outputs may not alias).
"""

from __future__ import annotations

import torch

from ..triton.launch import LAUNCH_OPTIONS
from .block_tables import BLOCK, SENTINEL

__all__ = ["triton_kernels", "triton_block_tables"]

_KERNELS: dict[str, object] = {}


def triton_kernels():
    """The four jitted kernels, defined on first use (None when Triton is missing)."""
    if "k" in _KERNELS:
        return _KERNELS["k"]
    try:
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover
        _KERNELS["k"] = None
        return None

    @triton.jit(do_not_specialize=["T"])
    def tokens_kernel(seg_ptr, stride_seg, reach_ptr, T, CHUNK: tl.constexpr):
        # Program (segment j, chunk c): the reach (subtree end) of the segment's tokens in chunk c.
        j = tl.program_id(0)
        c = tl.program_id(1)
        s = tl.load(seg_ptr + j)
        n = tl.load(seg_ptr + stride_seg + j)
        end = tl.load(seg_ptr + 2 * stride_seg + j)
        within = c * CHUNK + tl.arange(0, CHUNK)
        t = s + within
        m = (within < n) & (t < T)
        tl.store(reach_ptr + t, (within * 0 + end).to(tl.int32), mask=m)

    @triton.jit(do_not_specialize=["T"])
    def kv_blocks_kernel(reach_ptr, min_ptr, max_ptr, T, BLOCK: tl.constexpr, SENTINEL: tl.constexpr):
        # One program per kv block: the least and greatest reach of its keys (ragged tail: no effect).
        kb = tl.program_id(0)
        t = kb * BLOCK + tl.arange(0, BLOCK)
        m = t < T
        lo = tl.min(tl.load(reach_ptr + t, mask=m, other=SENTINEL), 0)
        hi = tl.max(tl.load(reach_ptr + t, mask=m, other=0), 0)
        tl.store(min_ptr + kb, lo)
        tl.store(max_ptr + kb, hi)

    @triton.jit(do_not_specialize=["T", "NB"])
    def rows_kernel(min_ptr, max_ptr, flags_ptr, num_ptr, idx_ptr, fnum_ptr, fidx_ptr, T, NB,
                    BLOCK: tl.constexpr, CHUNK: tl.constexpr):
        # One program per query block: classify every kv block (block_tables.classify), compact the row.
        qb = tl.program_id(0)
        q_lo = qb * BLOCK
        q_hi = tl.minimum(q_lo + BLOCK, T) - 1
        n_part = qb * 0
        n_full = qb * 0
        row = qb.to(tl.int64) * NB
        for c in range(0, NB, CHUNK):
            kb = c + tl.arange(0, CHUNK)
            inb = kb < NB
            k0 = kb * BLOCK
            k1 = tl.minimum(k0 + BLOCK, T) - 1
            complete = (k0 + BLOCK) <= T
            lo = tl.load(min_ptr + kb, mask=inb, other=0)
            hi = tl.load(max_ptr + kb, mask=inb, other=0)
            full = (k1 <= q_lo) & (lo > q_hi) & complete & inb
            part = (k0 <= q_hi) & (hi > q_lo) & (full.to(tl.int32) == 0) & inb
            tl.store(flags_ptr + row + kb, tl.where(full, 2, tl.where(part, 1, 0)).to(tl.int8), mask=inb)
            pi = part.to(tl.int32)
            fi = full.to(tl.int32)
            pc = tl.cumsum(pi, 0)
            fc = tl.cumsum(fi, 0)
            tl.store(idx_ptr + row + n_part + pc - 1, kb, mask=part)
            tl.store(fidx_ptr + row + n_full + fc - 1, kb, mask=full)
            n_part += tl.sum(pi, 0)
            n_full += tl.sum(fi, 0)
        tl.store(num_ptr + qb, n_part)
        tl.store(fnum_ptr + qb, n_full)

    @triton.jit(do_not_specialize=["NB"])
    def cols_kernel(flags_ptr, num_ptr, idx_ptr, fnum_ptr, fidx_ptr, NB, CHUNK: tl.constexpr):
        # One program per kv block: compact its column of the flags (the backward's tables).
        kb = tl.program_id(0)
        col = kb.to(tl.int64) * NB
        n_part = kb * 0
        n_full = kb * 0
        for c in range(0, NB, CHUNK):
            qb = c + tl.arange(0, CHUNK)
            inb = qb < NB
            f = tl.load(flags_ptr + qb.to(tl.int64) * NB + kb, mask=inb, other=0)
            part = f == 1
            full = f == 2
            pi = part.to(tl.int32)
            fi = full.to(tl.int32)
            pc = tl.cumsum(pi, 0)
            fc = tl.cumsum(fi, 0)
            tl.store(idx_ptr + col + n_part + pc - 1, qb, mask=part)
            tl.store(fidx_ptr + col + n_full + fc - 1, qb, mask=full)
            n_part += tl.sum(pi, 0)
            n_full += tl.sum(fi, 0)
        tl.store(num_ptr + kb, n_part)
        tl.store(fnum_ptr + kb, n_full)

    _KERNELS["k"] = (tokens_kernel, kv_blocks_kernel, rows_kernel, cols_kernel)
    return _KERNELS["k"]


def triton_block_tables(table: torch.Tensor, num_tokens: int, max_seg_len: int) -> tuple[torch.Tensor, ...]:
    """``block_tables`` computed by four Triton launches (the same tables; index rows equal within their counts).

    Every output is its own allocation: a custom op's outputs may not alias.
    """
    tokens_kernel, kv_blocks_kernel, rows_kernel, cols_kernel = triton_kernels()
    T = num_tokens
    NB = (T + BLOCK - 1) // BLOCK
    nseg = table.shape[1] - 1  # without the sentinel
    table = table.contiguous()
    dev = table.device
    i32 = dict(dtype=torch.int32, device=dev)
    reach = torch.empty(T, **i32)
    min_reach, max_reach = torch.empty(NB, **i32), torch.empty(NB, **i32)
    flags = torch.empty(NB, NB, dtype=torch.int8, device=dev)
    nums = [torch.empty(1, 1, NB, **i32) for _ in range(4)]
    # zeros: entries past a row's count stay valid block indices (the kernels may prefetch them)
    idxs = [torch.zeros(1, 1, NB, NB, **i32) for _ in range(4)]
    if NB == 0:  # an empty stream: no launch has anything to do (a zero grid is not launchable)
        return (nums[0], idxs[0], nums[1], idxs[1], nums[2], idxs[2], nums[3], idxs[3], reach)
    chunk = 512 if NB > 256 else 256
    tok_chunk = 1024
    grid_tok = (max(1, nseg), max(1, (max_seg_len + tok_chunk - 1) // tok_chunk))
    tokens_kernel[grid_tok](table, table.stride(0), reach, T, CHUNK=tok_chunk, **LAUNCH_OPTIONS)
    kv_blocks_kernel[(NB,)](reach, min_reach, max_reach, T, BLOCK=BLOCK, SENTINEL=SENTINEL, **LAUNCH_OPTIONS)
    rows_kernel[(NB,)](min_reach, max_reach, flags, nums[0], idxs[0], nums[1], idxs[1], T, NB,
                       BLOCK=BLOCK, CHUNK=chunk, **LAUNCH_OPTIONS)
    cols_kernel[(NB,)](flags, nums[2], idxs[2], nums[3], idxs[3], NB, CHUNK=chunk, **LAUNCH_OPTIONS)
    return (nums[0], idxs[0], nums[1], idxs[1], nums[2], idxs[2], nums[3], idxs[3], reach)
