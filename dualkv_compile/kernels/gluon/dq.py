"""Warp-specialised Hopper (sm_90) dQ kernel of shared-prompt attention, in Gluon: the backward's Q-major half.

With P recomputed from the saved lse and Delta = rowsum(dO * O) (the Triton preprocess kernel's):
``dS = P * (dO V^T - Delta)``, ``dQ = scale * dS K``. One program computes dQ for ``BLOCK_M`` query rows of one
segment and one query head, over the forward's key blocks (``walk.py``): the loader warp copies the tile's q and
dO rows once and K and V of every block into the rings; two consumer warpgroups (64 rows each) issue block i's
S = Q K^T and dP = dO V^T and block i-1's dQ += dS K on wgmma, then form block i's dS in registers. Full blocks
run without a mask; the masked ones (ancestors' ragged blocks, the diagonal) keep column c for row r iff
``c < min(r + 1, limit)``.

Assumes what ``fwd.py`` assumes, plus ``LSE`` (natural log) and ``DELTA`` float32 ``[1, Hq, T]`` with the same
head stride, and ``WALK`` built for this kernel's ``BLOCK_N``.
Guarantees: every valid row of dQ is written once, in dQ's dtype, and no row of another segment; no atomics
(deterministic). dS is selected to zero wherever a column is masked and the key rows past a segment are zeroed in
shared memory before dS K reads them, so another segment's keys or values (an inf or a NaN included) never
reach dQ.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .walk import kv_rings, loader, program_tile, walk_start, walk_step, zero_rows_past

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _scores(i, q, do, k_smem, v_smem, k_ready, v_ready, s_zero, start, limit, MASK: gl.constexpr,
            STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Wait for block i's K and V (with ``MASK``, zero its key rows past the segment) and issue
    S = Q K^T and dP = dO V^T; both left running."""
    st = i % STAGES
    mbarrier.wait(k_ready.index(st), (i // STAGES) & 1)
    if MASK:
        if start + BLOCK_N > limit:  # another segment's keys would reach dS K
            zero_rows_past(k_smem.index(st), start, limit, BLOCK_N, HEAD_DIM)
    mbarrier.wait(v_ready.index(st), (i // STAGES) & 1)
    s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp = warpgroup_mma(do, v_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return s, dp


@gluon.jit
def _ds(s, dp, lse2, delta, rows, offs_n, start, limit, qk_scale, MASK: gl.constexpr, dtype: gl.constexpr,
        a_layout: gl.constexpr):
    """dS = P * (dP - Delta) in the A-operand layout of dS K; with ``MASK`` zero (a select: P can overflow
    on a masked column, and dP reads values past the segment) wherever column c is hidden from row r."""
    p = gl.exp2(s * qk_scale - lse2[:, None])
    ds = p * (dp - delta[:, None])
    if MASK:
        ds = gl.where((start + offs_n)[None, :] < gl.minimum(rows + 1, limit)[:, None], ds, 0.0)
    return gl.convert_layout(ds.to(dtype), a_layout)


@gluon.jit
def _dq_block(i, q, do, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, dq, ds, s_zero, lse2, delta,
              rows, offs_n, start, limit, qk_scale, MASK: gl.constexpr, STAGES: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Block i: issue its S and dP, then block i-1's dQ += dS K; block i's dS while that runs. Every
    product is waited for inside the block: an accumulator left in flight across the loop's back
    edge makes ptxas serialise every wgmma of the kernel (seen in the SASS)."""
    prev = (i + STAGES - 1) % STAGES
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq.type.layout, k_width=2)
    s, dp = _scores(i, q, do, k_smem, v_smem, k_ready, v_ready, s_zero, start, limit, MASK, STAGES, BLOCK_N, HEAD_DIM)
    dq = warpgroup_mma(ds, k_smem.index(prev), dq, is_async=True)
    s, dp = warpgroup_mma_wait(num_outstanding=1, deps=(s, dp))
    ds = _ds(s, dp, lse2, delta, rows, offs_n, start, limit, qk_scale, MASK, q.dtype, a_layout)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
    mbarrier.arrive(k_empty.index(prev), count=1)
    mbarrier.arrive(v_empty.index(prev), count=1)
    return dq, ds


@gluon.jit
def _consumer(q_smem, do_smem, k_smem, v_smem, rows_bar, k_ready, v_ready, k_empty, v_empty, DQ, LSE, DELTA,
              head, seg, seg_start, seg_end, m0, SEG_START, SEG_LEN, WALK, stride_dqh, stride_dqt, stride_dqd,
              stride_lh, qk_scale, sm_scale, ROWS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr):
    # One warpgroup: the ROWS query rows of the tile from WG * ROWS on.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    row_off: gl.constexpr = WG * ROWS

    q = q_smem.slice(row_off, ROWS)
    do = do_smem.slice(row_off, ROWS)
    rows = m0 + row_off + gl.arange(0, ROWS, layout=s_rows)
    row_ok = rows < seg_end
    # Rows past the segment read lse = Delta = 0: finite, never stored.
    lse2 = gl.load(LSE + head.to(gl.int64) * stride_lh + rows, mask=row_ok, other=0.0) * LOG2E
    delta = gl.load(DELTA + head.to(gl.int64) * stride_lh + rows, mask=row_ok, other=0.0)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    n_af, n_of, n_ar, n_d, diag_start, fa, f_start, f_end, ra = walk_start(
        seg, seg_start, seg_end, m0, SEG_START, SEG_LEN, WALK, BLOCK_M, BLOCK_N)
    n_full = n_af + n_of
    n = n_full + n_ar + n_d
    mbarrier.wait(rows_bar, 0)
    # Block 0 (every tile has one), masked whatever its kind: its S, dP and dS; its dS K comes with block 1.
    start, limit, fa, f_start, f_end, ra = walk_step(
        0, n_af, n_of, n_ar, seg_start, seg_end, diag_start, fa, f_start, f_end, ra, SEG_START, SEG_LEN, WALK, BLOCK_N)
    s, dp = _scores(0, q, do, k_smem, v_smem, k_ready, v_ready, s_zero, start, limit, True, STAGES, BLOCK_N, HEAD_DIM)
    s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
    ds = _ds(s, dp, lse2, delta, rows, offs_n, start, limit, qk_scale, True, q_smem.dtype, a_layout)
    for i in range(1, n_full):
        dq, ds = _dq_block(i, q, do, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, dq, ds, s_zero, lse2, delta,
                           rows, offs_n, 0, 0, qk_scale, False, STAGES, BLOCK_N, HEAD_DIM)
    for i in range(gl.maximum(n_full, 1), n):
        start, limit, fa, f_start, f_end, ra = walk_step(
            i, n_af, n_of, n_ar, seg_start, seg_end, diag_start, fa, f_start, f_end, ra, SEG_START, SEG_LEN, WALK,
            BLOCK_N)
        dq, ds = _dq_block(i, q, do, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, dq, ds, s_zero, lse2, delta,
                           rows, offs_n, start, limit, qk_scale, True, STAGES, BLOCK_N, HEAD_DIM)
    last = (n - 1) % STAGES
    dq = warpgroup_mma(ds, k_smem.index(last), dq, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
    mbarrier.arrive(k_empty.index(last), count=1)
    mbarrier.arrive(v_empty.index(last), count=1)

    rows_o = m0 + row_off + gl.arange(0, ROWS, layout=o_rows)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    ptrs = DQ + head.to(gl.int64) * stride_dqh + rows_o[:, None] * stride_dqt + offs_d[None, :] * stride_dqd
    gl.store(ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=(rows_o < seg_end)[:, None])


# Arguments that follow T get no value specialisation, so a new length never compiles a second variant.
@gluon.jit(do_not_specialize=["num_tiles", "q_row_h", "q_col_h", "do_row_h", "do_col_h", "k_row_h", "k_col_h",
                              "v_row_h", "v_col_h", "stride_lh"])
def shared_prompt_dq_kernel(
    q_desc, do_desc, k_desc, v_desc, DQ, LSE, DELTA, TILES, num_tiles,
    q_row_h, q_col_h, do_row_h, do_col_h, k_row_h, k_col_h, v_row_h, v_col_h,
    SEG_START, SEG_LEN, WALK,
    stride_dqh, stride_dqt, stride_dqd, stride_lh,
    heads_per_kv, qk_scale, sm_scale,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    LOADER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
    head = gl.program_id(0)
    seg, seg_start, seg_end, m0 = program_tile(TILES, num_tiles, SEG_START, SEG_LEN, BLOCK_M)
    if seg < 0:
        return
    kv_head = head // heads_per_kv
    ROWS: gl.constexpr = BLOCK_M // 2

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [BLOCK_M, HEAD_DIM], do_desc.layout)
    rows_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(rows_bar, count=1)
    k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = kv_rings(k_desc, v_desc, STAGES, BLOCK_N, HEAD_DIM)

    gl.warp_specialize(
        [
            (_consumer, (q_smem, do_smem, k_smem, v_smem, rows_bar, k_ready, v_ready, k_empty, v_empty, DQ, LSE, DELTA,
                         head, seg, seg_start, seg_end, m0, SEG_START, SEG_LEN, WALK, stride_dqh, stride_dqt,
                         stride_dqd, stride_lh, qk_scale, sm_scale, ROWS, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, 0)),
            (_consumer, (q_smem, do_smem, k_smem, v_smem, rows_bar, k_ready, v_ready, k_empty, v_empty, DQ, LSE, DELTA,
                         head, seg, seg_start, seg_end, m0, SEG_START, SEG_LEN, WALK, stride_dqh, stride_dqt,
                         stride_dqd, stride_lh, qk_scale, sm_scale, ROWS, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, 1)),
            (loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, rows_bar, k_ready, v_ready,
                      k_empty, v_empty, head * q_row_h, head * q_col_h, head * do_row_h, head * do_col_h,
                      kv_head * k_row_h, kv_head * k_col_h, kv_head * v_row_h, kv_head * v_col_h,
                      seg, seg_start, seg_end, m0, SEG_START, SEG_LEN, WALK, BLOCK_M, BLOCK_N, STAGES, True)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )
