"""The FlexAttention mask's block tables computed by small Triton kernels (the CUDA builder).

    triton_kernels()                                             -> the jitted kernels, or None without Triton
    triton_block_tables(table, T, max_seg_len, window=0, chunk=0) -> what ``block_tables.block_tables`` returns

Assumes: ``table`` is ``block_tables.segment_table(segs, T)`` (int32, with its sentinel column) on the device the
kernels run on (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``max_seg_len`` bounds every segment's length, and
``window`` and ``chunk`` are ints >= 0 (0: none). The kernels are defined on first use, so importing this module
never needs Triton.

Guarantees: the same tables as the torch builder (counts and per-token tables exactly; index rows equal within
their counts, zeros past them, so they stay valid block indices), computed step by step as it computes them
(docs/design.md, "FlexAttention"; its speed: docs/benchmarks.md). Lengths and window sizes are not specialised
(``do_not_specialize``; sizes past ``SENTINEL`` are clamped to it, which changes no limit): a new layout or window
never recompiles; windowed and plain tables are two variants of the row and block kernels (a ``constexpr``).
Every output is its own allocation (a custom op's outputs may not alias).
"""

from __future__ import annotations

import torch

from ..common.launch import LAUNCH_OPTIONS
from .block_tables import BLOCK, SENTINEL

__all__ = ["triton_kernels", "triton_block_tables"]

_KERNELS: dict[str, object] = {}


def triton_kernels():
    """The five jitted kernels, defined on first use (None when Triton is missing)."""
    if "k" in _KERNELS:
        return _KERNELS["k"]
    try:
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover
        _KERNELS["k"] = None
        return None

    @triton.jit(do_not_specialize=["T", "window", "chunk"])
    def tokens_kernel(seg_ptr, stride_seg, reach_ptr, depth_ptr, limit_ptr, T, window, chunk, CHUNK: tl.constexpr,
                      SENTINEL: tl.constexpr):
        # Program (segment j, chunk c): reach (subtree end), depth and depth limit of the segment's tokens in chunk c.
        j = tl.program_id(0)
        c = tl.program_id(1)
        s = tl.load(seg_ptr + j)
        n = tl.load(seg_ptr + stride_seg + j)
        end = tl.load(seg_ptr + 2 * stride_seg + j)
        pre = tl.load(seg_ptr + 3 * stride_seg + j)
        within = c * CHUNK + tl.arange(0, CHUNK)
        t = s + within
        m = (within < n) & (t < T)
        tl.store(reach_ptr + t, (within * 0 + end).to(tl.int32), mask=m)
        d = pre + within
        tl.store(depth_ptr + t, d.to(tl.int32), mask=m)
        d64 = d.to(tl.int64)
        lim = d64 * 0 + SENTINEL
        lim = tl.where(window > 0, tl.minimum(lim, d64 + window), lim)
        cc = tl.maximum(chunk, 1)  # no division by zero in the lanes the where drops
        lim = tl.where(chunk > 0, tl.minimum(lim, (d64 // cc + 1) * cc), lim)
        tl.store(limit_ptr + t, lim.to(tl.int32), mask=m)

    @triton.jit(do_not_specialize=["T"])
    def blocks_kernel(reach_ptr, depth_ptr, limit_ptr, min_ptr, max_ptr, pmin_ptr, qmax_ptr, lmin_ptr, T,
                      BLOCK: tl.constexpr, SENTINEL: tl.constexpr, WINDOWED: tl.constexpr):
        # One program per block: the least and greatest reach of its keys (ragged tail: no effect); with a
        # window also the least limit of its keys, the greatest depth of its rows and depth's prefix minimum.
        kb = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        t = kb * BLOCK + i
        m = t < T
        tl.store(min_ptr + kb, tl.min(tl.load(reach_ptr + t, mask=m, other=SENTINEL), 0))
        tl.store(max_ptr + kb, tl.max(tl.load(reach_ptr + t, mask=m, other=0), 0))
        if WINDOWED:
            d = tl.load(depth_ptr + t, mask=m, other=SENTINEL)
            tl.store(qmax_ptr + kb, tl.max(tl.where(m, d, -1), 0))
            tl.store(lmin_ptr + kb, tl.min(tl.load(limit_ptr + t, mask=m, other=SENTINEL), 0))
            # prefix minimum over a [BLOCK, BLOCK] tile (no scan: a combine function would have to be a
            # module-level jit function, and this module must import without Triton)
            upto = i[None, :] <= i[:, None]
            pm = tl.min(tl.where(upto, d[None, :], SENTINEL), 1)
            tl.store(pmin_ptr + t, pm, mask=m)

    @triton.jit(do_not_specialize=["T", "NB"])
    def window_kernel(reach_ptr, limit_ptr, pmin_ptr, max_ptr, needed_ptr, T, NB, BLOCK: tl.constexpr,
                      QC: tl.constexpr, SENTINEL: tl.constexpr):
        # One program per kv block: for each query block below it, whether some key sees a row inside its
        # window (block_tables.window_needed), QC query blocks at a time; query blocks past the block's
        # greatest reach see none of its keys.
        kb = tl.program_id(0)
        t = kb * BLOCK + tl.arange(0, BLOCK)
        m = t < T
        r = tl.load(reach_ptr + t, mask=m, other=0)
        lim = tl.load(limit_ptr + t, mask=m, other=0)
        q_end = tl.minimum((tl.load(max_ptr + kb) + BLOCK - 1) // BLOCK, NB)
        for c in range(kb + 1, q_end, QC):
            qb = c + tl.arange(0, QC)
            inq = qb < q_end
            q_lo = qb * BLOCK
            q_hi = tl.minimum(q_lo + BLOCK, T) - 1
            end = tl.minimum(q_hi[:, None], r[None, :] - 1)  # [QC, BLOCK]: the last row each key sees
            ok = (end >= q_lo[:, None]) & m[None, :] & inq[:, None]
            pm = tl.load(pmin_ptr + end, mask=ok, other=SENTINEL)
            hit = tl.max((ok & (pm < lim[None, :])).to(tl.int32), 1)
            tl.store(needed_ptr + qb.to(tl.int64) * NB + kb, hit.to(tl.int8), mask=inq)

    @triton.jit(do_not_specialize=["T", "NB"])
    def rows_kernel(min_ptr, max_ptr, qmax_ptr, lmin_ptr, needed_ptr, flags_ptr, num_ptr, idx_ptr, fnum_ptr, fidx_ptr,
                    T, NB, BLOCK: tl.constexpr, CHUNK: tl.constexpr, WINDOWED: tl.constexpr):
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
            part = (k0 <= q_hi) & (hi > q_lo) & inb
            if WINDOWED:
                lmin = tl.load(lmin_ptr + kb, mask=inb, other=0)
                need = tl.load(needed_ptr + row + kb, mask=inb, other=0)
                full = full & (tl.load(qmax_ptr + qb) < lmin)
                part = part & ((need != 0) | (kb == qb))
            part = part & (full.to(tl.int32) == 0)
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

    _KERNELS["k"] = (tokens_kernel, blocks_kernel, window_kernel, rows_kernel, cols_kernel)
    return _KERNELS["k"]


def triton_block_tables(table: torch.Tensor, num_tokens: int, max_seg_len: int, window: int = 0,
                        chunk: int = 0) -> tuple[torch.Tensor, ...]:
    """``block_tables`` computed by Triton launches (the same tables; index rows equal within their counts).

    Every output is its own allocation: a custom op's outputs may not alias.
    """
    tokens_kernel, blocks_kernel, window_kernel, rows_kernel, cols_kernel = triton_kernels()
    T = num_tokens
    NB = (T + BLOCK - 1) // BLOCK
    windowed = bool(window or chunk)
    nseg = table.shape[1] - 1  # without the sentinel
    table = table.contiguous()
    dev = table.device
    i32 = dict(dtype=torch.int32, device=dev)
    reach, depth, limit = (torch.empty(T, **i32) for _ in range(3))
    min_reach, max_reach = torch.empty(NB, **i32), torch.empty(NB, **i32)
    flags = torch.empty(NB, NB, dtype=torch.int8, device=dev)
    nums = [torch.empty(1, 1, NB, **i32) for _ in range(4)]
    # zeros: entries past a row's count stay valid block indices (the kernels may prefetch them)
    idxs = [torch.zeros(1, 1, NB, NB, **i32) for _ in range(4)]
    out = (nums[0], idxs[0], nums[1], idxs[1], nums[2], idxs[2], nums[3], idxs[3], reach, depth, limit)
    if NB == 0:  # an empty stream: no launch has anything to do (a zero grid is not launchable)
        return out
    if windowed:
        pmin = torch.empty(T, **i32)
        q_max, l_min = torch.empty(NB, **i32), torch.empty(NB, **i32)
        needed = torch.zeros(NB, NB, dtype=torch.int8, device=dev)  # only the pairs below the diagonal are written
    else:  # unread: the plain variants of the kernels take any pointer there
        pmin, q_max, l_min, needed = reach, min_reach, min_reach, flags
    chunk_nb = 512 if NB > 256 else 256
    tok_chunk = 1024
    grid_tok = (max(1, nseg), max(1, (max_seg_len + tok_chunk - 1) // tok_chunk))
    tokens_kernel[grid_tok](table, table.stride(0), reach, depth, limit, T, min(window, SENTINEL),
                            min(chunk, SENTINEL), CHUNK=tok_chunk, SENTINEL=SENTINEL, **LAUNCH_OPTIONS)
    blocks_kernel[(NB,)](reach, depth, limit, min_reach, max_reach, pmin, q_max, l_min, T, BLOCK=BLOCK,
                         SENTINEL=SENTINEL, WINDOWED=windowed, **LAUNCH_OPTIONS)
    if windowed:
        window_kernel[(NB,)](reach, limit, pmin, max_reach, needed, T, NB, BLOCK=BLOCK, QC=8, SENTINEL=SENTINEL,
                             **LAUNCH_OPTIONS)
    rows_kernel[(NB,)](min_reach, max_reach, q_max, l_min, needed, flags, nums[0], idxs[0], nums[1], idxs[1], T, NB,
                       BLOCK=BLOCK, CHUNK=chunk_nb, WINDOWED=windowed, **LAUNCH_OPTIONS)
    cols_kernel[(NB,)](flags, nums[2], idxs[2], nums[3], idxs[3], NB, CHUNK=chunk_nb, **LAUNCH_OPTIONS)
    return out
