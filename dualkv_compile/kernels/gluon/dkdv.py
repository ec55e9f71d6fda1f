"""Warp-specialised Hopper (sm_90) dK/dV kernel of shared-prompt attention, in Gluon: the backward's KV-major half.

With P recomputed from the saved lse and Delta = rowsum(dO * O): ``dV = P^T dO``, ``dS = P * (dO V^T - Delta)``,
``dK = scale * dS^T Q``. One program owns ``BLOCK_N`` keys of one segment and one kv head (the Triton program's
work, ``triton/bwd.py``) and walks every query block that reads them, for every query head of the kv head: the
diagonal (the segment's own rows, causal), then the run ``[after the diagonal, subtree_end)``, full blocks
unmasked and the ragged last one masked (key c and row r pair iff ``c <= r and r < limit``). A TMA loader warp
fills ``STAGES``-deep rings, two consumer warpgroups compute the transposed scores; with ``ATOMIC_DQ`` the
kernel also adds ``dQ = scale * dS K`` into a float32 ``[Hq * T, D]`` buffer by bulk reductions (how the
partitions meet: docs/design.md, "Gluon kernels").

Assumes what ``fwd.py`` assumes for q, k, v (dO laid out like q); the row statistics ``st_desc`` a float32
``[Hq * T, 4]`` tensor, row ``h * T + t`` = (lse in base 2, 0, Delta, 0), the Triton preprocess kernel's packed
copy (16-byte rows: a bulk copy's innermost coordinate must be 16-byte aligned); ``TILES`` from
``tile_schedule(..., "kv")`` for ``BLOCK_N``; ``SUBTREE_END`` as ``Segments`` gives it.
Guarantees: every valid key row of dK and dV is written once, in their dtypes, and no other row; no atomics and a
fixed order of the sums (deterministic; with ``ATOMIC_DQ`` dQ's float32 adds land in any order). Masked q and dO
rows are zeroed in shared memory and P^T and dS^T selected to zero at masked pairs, so no other segment's value,
an inf or a NaN included, reaches a valid key's dK or dV.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from triton.experimental.gluon.language._core import shared_memory_descriptor

from .walk import _partition_barrier, _tma_add, _tma_load, kv_rings, zero_rows_past

__all__ = ["shared_prompt_dkdv_kernel"]

# A shared-memory view seen with another shape and layout: ``_reinterpret`` up to triton 3.8, ``reinterpret`` from 3.9.
_HAS_REINTERPRET = gl.constexpr(hasattr(shared_memory_descriptor, "reinterpret"))


@gluon.jit
def _row_blocks(seg_start, seg_end, subtree_end, n0, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Per head: ``(n_diag, after_diag, n_run_full, n_run)``: the diagonal blocks start at n0; the run's
    blocks at after_diag, the first ``n_run_full`` of them full, the rest (0 or 1) ragged."""
    n_diag = (gl.minimum(BLOCK_N, seg_end - n0) + BLOCK_M - 1) // BLOCK_M
    after_diag = gl.minimum(n0 + n_diag * BLOCK_M, seg_end)
    rows = gl.maximum(subtree_end - after_diag, 0)
    return n_diag, after_diag, rows // BLOCK_M, (rows + BLOCK_M - 1) // BLOCK_M


# --------------------------------------------------------------------------- the loader partition


@gluon.jit
def _loader(q_desc, do_desc, k_desc, v_desc, st_desc, q_smem, do_smem, k_smem, v_smem, st_smem, kv_bar,
            q_ready, do_ready, q_empty, do_empty, kv_head, heads_per_kv, q_row_h, q_col_h, do_row_h, do_col_h,
            k_row_h, k_col_h, v_row_h, v_col_h, num_tokens, seg_start, seg_end, subtree_end, n0,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    _tma_load(k_desc, [kv_head * k_row_h + n0, kv_head * k_col_h], kv_bar, k_smem)
    _tma_load(v_desc, [kv_head * v_row_h + n0, kv_head * v_col_h], kv_bar, v_smem)
    n_diag, after_diag, n_run_full, n_run = _row_blocks(seg_start, seg_end, subtree_end, n0, BLOCK_M, BLOCK_N)
    n = n_diag + n_run
    for h in range(heads_per_kv):
        head = kv_head * heads_per_kv + h
        for j in range(n):
            i = h * n + j
            m = gl.where(j < n_diag, n0 + j * BLOCK_M, after_diag + (j - n_diag) * BLOCK_M)
            st = i % STAGES
            ph = (i // STAGES) & 1
            # A slot is free once both consumers released it (a fresh barrier passes the parity-1 wait).
            mbarrier.wait(q_empty.index(st), ph ^ 1)
            mbarrier.expect(q_ready.index(st), q_desc.block_type.nbytes + st_desc.block_type.nbytes)
            _tma_load(q_desc, [head * q_row_h + m, head * q_col_h], q_ready.index(st), q_smem.index(st))
            _tma_load(st_desc, [head * num_tokens + m, 0], q_ready.index(st), st_smem.index(st))
            mbarrier.wait(do_empty.index(st), ph ^ 1)
            mbarrier.expect(do_ready.index(st), do_desc.block_type.nbytes)
            _tma_load(do_desc, [head * do_row_h + m, head * do_col_h], do_ready.index(st), do_smem.index(st))


# --------------------------------------------------------------------------- the consumer partitions


@gluon.jit
def _row_stat(view, col: gl.constexpr, s_layout: gl.constexpr, BLOCK_M: gl.constexpr):
    """Column ``col`` of a block's ``[BLOCK_M, 4]`` row statistics in shared memory (0: lse in base 2,
    2: Delta; the Triton preprocess kernel's packing), as a ``[1, BLOCK_M]`` row in the scores' layout,
    which broadcasts over the keys as is. The rows are unswizzled; seen column-major, row c of the view
    is column c (measured cheaper than pointer loads from global memory: docs/benchmarks.md, "Behind the
    code"). Each column costs 16 registers per thread, so ``_block`` reads Delta only after the exponentials:
    reading both together made ptxas spill in the loop."""
    layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0, 1])
    if _HAS_REINTERPRET:
        by_col = view.reinterpret(gl.float32, [4, BLOCK_M], layout)
    else:
        by_col = view._reinterpret(gl.float32, [4, BLOCK_M], layout)
    return by_col.slice(col, 1).load(s_layout)


@gluon.jit
def _add_dq(dq, dq_desc, dq_stage, dq_row, dq_col, m, limit, MASK: gl.constexpr, BLOCK_M: gl.constexpr,
            COLUMNS: gl.constexpr):
    """Add a block's dQ rows (``COLUMNS`` columns from ``dq_col``) into the float32 buffer: staged in shared
    memory, then bulk reductions by the copy engine, one per 32 columns (FA3's way; measured much faster than
    per-thread float32 atomics: docs/benchmarks.md, "Behind the code"). The block always
    covers ``BLOCK_M`` rows: with ``MASK`` the rows at or past ``limit`` (another subtree's, or the next
    head's) are set to zero by a select first, so they add nothing, not even a NaN from 0 * inf."""
    if MASK:
        rows = m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq.type.layout))
        dq = gl.where((rows < limit)[:, None], dq, 0.0)
    tma.store_wait(0)  # the previous block's reduction has read the stage
    dq_stage.store(dq)
    fence_async_shared()
    _partition_barrier()
    # One reduction per 32 columns: a swizzled bulk copy moves at most the swizzle's 128 bytes of each row.
    COLS: gl.constexpr = dq_desc.block_type.shape[1]
    for c in gl.static_range(COLUMNS // COLS):
        _tma_add(dq_desc, [dq_row + m, dq_col + c * COLS], dq_stage.slice(c * COLS, COLS, dim=1))


@gluon.jit
def _block(i, k, v, k_cols, q_smem, do_smem, st_smem, ds_smem, ds_full, ds_empty, q_ready, do_ready, q_empty,
           do_empty, dk, dv, s_zero, dq_zero, keys, offs_m, m, limit, qk_scale, dq_desc, dq_stage, dq_row, dq_col,
           sm_scale, MASK: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
           KEYS: gl.constexpr, WG: gl.constexpr, ATOMIC_DQ: gl.constexpr):
    """Query block i (rows from m): S^T and dP^T issued together; P^T (while dP^T runs) into dV; dS^T into dK.
    With ``ATOMIC_DQ`` also this warpgroup's half of dQ's columns, dQ[:, cols] = dS K[:, cols] over the
    whole tile's keys (both warpgroups' dS^T, met in shared memory), added into the float32 buffer.
    Every product is waited for inside the block (see ``dq.py`` on accumulators across the back edge).
    dV is waited for with dP^T, before dS^T is formed: with P^T still in flight (16 registers, and Delta's
    16) the loop spilled, the atomic-dQ variant heavily; so waited, the default loops do not spill."""
    s_layout: gl.constexpr = s_zero.type.layout
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
    st = i % STAGES
    ph = (i // STAGES) & 1
    q = q_smem.index(st)
    do = do_smem.index(st)
    mbarrier.wait(q_ready.index(st), ph)
    if MASK:
        if m + BLOCK_M > limit:  # rows of another subtree would reach dK
            zero_rows_past(q, m, limit, BLOCK_M, HEAD_DIM)
    s_t = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(st), ph)
    if MASK:
        if m + BLOCK_M > limit:  # ... and dV
            zero_rows_past(do, m, limit, BLOCK_M, HEAD_DIM)
    dp_t = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    lse2 = _row_stat(st_smem.index(st), 0, s_layout, BLOCK_M)
    s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t, ))
    p_t = gl.exp2(s_t * qk_scale - lse2)
    if MASK:
        rows = m + offs_m
        keep = (keys[:, None] <= rows[None, :]) & (rows < limit)[None, :]
        p_t = gl.where(keep, p_t, 0.0)
    dv = warpgroup_mma(gl.convert_layout(p_t.to(q.dtype), a_layout), do, dv, is_async=True)
    dp_t, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dp_t, dv))
    delta = _row_stat(st_smem.index(st), 2, s_layout, BLOCK_M)  # read late: fewer registers live at the exponentials
    ds_t = p_t * (dp_t - delta)
    if MASK:  # the statistics past T are zeros, but a masked row's Delta belongs to another row
        ds_t = gl.where(keep, ds_t, 0.0)
    if ATOMIC_DQ:
        # dS^T through shared memory: each warpgroup writes its keys' rows of the tile's [BLOCK_N, BLOCK_M]
        # dS^T (two buffers, so one block's products overlap the next block's writes), fences them for
        # the tensor cores and arrives on ds_full; dQ's product waits for both halves. ds_empty says both
        # warpgroups' products have read a buffer (a fresh barrier passes the parity-1 wait).
        buf = i % 2
        bph = (i // 2) & 1
        ds_all = ds_smem.index(buf)
        ds_bf = ds_t.to(q.dtype)
        mbarrier.wait(ds_empty.index(buf), bph ^ 1)
        ds_all.slice(WG * KEYS, KEYS).store(ds_bf)
        fence_async_shared()
        _partition_barrier()
        mbarrier.arrive(ds_full.index(buf), count=1)
        dk = warpgroup_mma(gl.convert_layout(ds_bf, a_layout), q, dk, is_async=True)
        mbarrier.wait(ds_full.index(buf), bph)
        dq = warpgroup_mma(ds_all.permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True)
        dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dq))
        mbarrier.arrive(ds_empty.index(buf), count=1)
        _add_dq(dq * sm_scale, dq_desc, dq_stage, dq_row, dq_col, m, limit, MASK, BLOCK_M, dq_zero.shape[1])
    else:
        dk = warpgroup_mma(gl.convert_layout(ds_t.to(q.dtype), a_layout), q, dk, is_async=True)
        dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ))
    mbarrier.arrive(q_empty.index(st), count=1)
    mbarrier.arrive(do_empty.index(st), count=1)
    return dk, dv


@gluon.jit
def _consumer(k_smem, v_smem, q_smem, do_smem, st_smem, ds_smem, ds_full, ds_empty, dq_smem, kv_bar, q_ready,
              do_ready, q_empty, do_empty, DK, DV, dq_desc, kv_head, heads_per_kv, num_tokens, seg_start, seg_end,
              subtree_end, n0, stride_dkh, stride_dkt, stride_dkd, stride_dvh, stride_dvt, stride_dvd, qk_scale,
              sm_scale, KEYS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              STAGES: gl.constexpr, WG: gl.constexpr, ATOMIC_DQ: gl.constexpr):
    # One warpgroup: the KEYS keys of the tile from WG * KEYS on.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    # dQ: this warpgroup's half of the head dim, over all BLOCK_N keys.
    HALF_D: gl.constexpr = HEAD_DIM // 2
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF_D, 16])
    key_off: gl.constexpr = WG * KEYS
    k = k_smem.slice(key_off, KEYS)
    v = v_smem.slice(key_off, KEYS)
    if ATOMIC_DQ:
        k_cols = k_smem.slice(WG * HALF_D, HALF_D, dim=1)
    else:
        k_cols = k
    dq_stage = dq_smem.index(WG)
    keys = n0 + key_off + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout)
    dq_zero = gl.zeros([BLOCK_M, HALF_D], gl.float32, dq_layout)
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, o_layout)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, o_layout)
    n_diag, after_diag, n_run_full, n_run = _row_blocks(seg_start, seg_end, subtree_end, n0, BLOCK_M, BLOCK_N)
    n = n_diag + n_run
    mbarrier.wait(kv_bar, 0)
    if ATOMIC_DQ:
        # dS K reads every key row: past the segment they must be zeros (and dP^T's V rows too, so dS is
        # finite there), or another segment's keys, an inf or a NaN among them, would reach dQ. The other
        # warpgroup reads these rows only after this one's first arrive on ds_full.
        if n0 + key_off + KEYS > seg_end:
            zero_rows_past(k, n0 + key_off, seg_end, KEYS, HEAD_DIM)
            zero_rows_past(v, n0 + key_off, seg_end, KEYS, HEAD_DIM)
    for h in range(heads_per_kv):
        base = h * n
        dq_row = (kv_head * heads_per_kv + h) * num_tokens
        for j in range(n_diag):
            dk, dv = _block(base + j, k, v, k_cols, q_smem, do_smem, st_smem, ds_smem, ds_full, ds_empty, q_ready,
                            do_ready, q_empty, do_empty, dk, dv, s_zero, dq_zero, keys, offs_m,
                            n0 + j * BLOCK_M, seg_end, qk_scale, dq_desc, dq_stage, dq_row, WG * HALF_D,
                            sm_scale, True, STAGES, BLOCK_M, HEAD_DIM, KEYS, WG, ATOMIC_DQ)
        base += n_diag
        for j in range(n_run_full):
            dk, dv = _block(base + j, k, v, k_cols, q_smem, do_smem, st_smem, ds_smem, ds_full, ds_empty, q_ready,
                            do_ready, q_empty, do_empty, dk, dv, s_zero, dq_zero, keys, offs_m,
                            after_diag + j * BLOCK_M, subtree_end, qk_scale, dq_desc, dq_stage, dq_row, WG * HALF_D,
                            sm_scale, False, STAGES, BLOCK_M, HEAD_DIM, KEYS, WG, ATOMIC_DQ)
        for j in range(n_run_full, n_run):  # the ragged last block of the run, if any
            dk, dv = _block(base + j, k, v, k_cols, q_smem, do_smem, st_smem, ds_smem, ds_full, ds_empty, q_ready,
                            do_ready, q_empty, do_empty, dk, dv, s_zero, dq_zero, keys, offs_m,
                            after_diag + j * BLOCK_M, subtree_end, qk_scale, dq_desc, dq_stage, dq_row, WG * HALF_D,
                            sm_scale, True, STAGES, BLOCK_M, HEAD_DIM, KEYS, WG, ATOMIC_DQ)

    if ATOMIC_DQ:
        tma.store_wait(0)  # the last reduction has read its stage before the program's memory goes
    keys_o = n0 + key_off + gl.arange(0, KEYS, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    ok = (keys_o < seg_end)[:, None]
    dk_ptrs = DK + kv_head.to(gl.int64) * stride_dkh + keys_o[:, None] * stride_dkt + offs_d[None, :] * stride_dkd
    gl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=ok)
    dv_ptrs = DV + kv_head.to(gl.int64) * stride_dvh + keys_o[:, None] * stride_dvt + offs_d[None, :] * stride_dvd
    gl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------- the kernel


# Arguments that follow T get no value specialisation, so a new length never compiles a second variant.
@gluon.jit(do_not_specialize=["num_tiles", "q_row_h", "q_col_h", "do_row_h", "do_col_h", "k_row_h", "k_col_h",
                              "v_row_h", "v_col_h", "num_tokens"])
def shared_prompt_dkdv_kernel(
    q_desc, do_desc, k_desc, v_desc, st_desc, DK, DV, dq_desc, TILES, num_tiles,
    q_row_h, q_col_h, do_row_h, do_col_h, k_row_h, k_col_h, v_row_h, v_col_h, num_tokens,
    SEG_START, SEG_LEN, SUBTREE_END,
    stride_dkh, stride_dkt, stride_dkd, stride_dvh, stride_dvt, stride_dvd,
    heads_per_kv, qk_scale, sm_scale,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    LOADER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, ATOMIC_DQ: gl.constexpr, DS_LAYOUT: gl.constexpr,
):
    kv_head = gl.program_id(0)
    # walk.program_tile computes the same four values, but with it triton 3.6's ptxas spilled in the
    # unmasked loop (3 -> 12 local loads, 0 -> 8 stores per block: sm90_resources.py --gluon).
    t = gl.program_id(1)
    seg = gl.load(TILES + t)
    if seg < 0:
        return
    seg_start = gl.load(SEG_START + seg)
    n0 = seg_start + gl.load(TILES + num_tiles + t) * BLOCK_N
    seg_end = seg_start + gl.load(SEG_LEN + seg)
    subtree_end = gl.load(SUBTREE_END + seg)
    KEYS: gl.constexpr = BLOCK_N // 2

    k_smem = gl.allocate_shared_memory(k_desc.dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    q_smem, do_smem, q_ready, do_ready, q_empty, do_empty = kv_rings(q_desc, do_desc, STAGES, BLOCK_M, HEAD_DIM)
    st_smem = gl.allocate_shared_memory(st_desc.dtype, [STAGES, BLOCK_M, 4], st_desc.layout)
    # With ATOMIC_DQ: two buffers of the tile's dS^T (both consumers write their keys' rows), their
    # full / empty barriers (one arrive per consumer), and each consumer's float32 dQ half-block for the
    # bulk reduction. Without it, 8-row stand-ins that are never used.
    ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_N if ATOMIC_DQ else 8, BLOCK_M], DS_LAYOUT)
    if ATOMIC_DQ:
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM // 2], dq_desc.layout)
    else:
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, 8, HEAD_DIM // 2], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(ds_full.index(b), count=2)
        mbarrier.init(ds_empty.index(b), count=2)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)

    gl.warp_specialize(
        [
            (_consumer, (k_smem, v_smem, q_smem, do_smem, st_smem, ds_smem, ds_full, ds_empty, dq_smem, kv_bar,
                         q_ready, do_ready, q_empty, do_empty, DK, DV, dq_desc, kv_head, heads_per_kv, num_tokens,
                         seg_start, seg_end, subtree_end, n0, stride_dkh, stride_dkt, stride_dkd, stride_dvh,
                         stride_dvt, stride_dvd, qk_scale, sm_scale, KEYS, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, 0,
                         ATOMIC_DQ)),
            (_consumer, (k_smem, v_smem, q_smem, do_smem, st_smem, ds_smem, ds_full, ds_empty, dq_smem, kv_bar,
                         q_ready, do_ready, q_empty, do_empty, DK, DV, dq_desc, kv_head, heads_per_kv, num_tokens,
                         seg_start, seg_end, subtree_end, n0, stride_dkh, stride_dkt, stride_dkd, stride_dvh,
                         stride_dvt, stride_dvd, qk_scale, sm_scale, KEYS, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, 1,
                         ATOMIC_DQ)),
            (_loader, (q_desc, do_desc, k_desc, v_desc, st_desc, q_smem, do_smem, k_smem, v_smem, st_smem, kv_bar,
                       q_ready, do_ready, q_empty, do_empty, kv_head, heads_per_kv, q_row_h, q_col_h, do_row_h,
                       do_col_h, k_row_h, k_col_h, v_row_h, v_col_h, num_tokens, seg_start, seg_end, subtree_end, n0,
                       BLOCK_M, BLOCK_N, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )
