"""Warp-specialised Hopper (sm_90) forward kernel of shared-prompt attention, in Gluon.

One program computes ``BLOCK_M`` query rows of one segment for one query head (the Triton program's work,
``triton/fwd.py``). A TMA loader warp copies the query tile once, then K and V of every block of the tile's walk
into ``STAGES``-deep rings; two consumer warpgroups (64 rows each) run S = Q K^T and O += P V on wgmma with the
online softmax in registers (``PINGPONG``: they take turns issuing their products). The walk (``walk.py``, run
by both partitions, so no block list crosses between them): every ancestor's full blocks, the segment's own full
blocks, each ancestor's ragged last block, the diagonal blocks. Full blocks run without a mask; one mask serves
the others: column c is visible to row r iff ``c < min(r + 1, limit)``, ``limit`` the end of the block's
segment (more: docs/design.md, "Gluon kernels").

Assumes q ``[1, Hq, T, D]``, k and v ``[1, Hkv, T, D]``, bf16 or fp16, each with a 2-D TMA view
(``common/tma.tma_geometry``: head h's tile at token t is ``[h * row_h + t, h * col_h]``); ``TILES``,
``SEG_START``, ``SEG_LEN`` and ``WALK`` as for the Triton kernel (``common/schedule.py``), the walk built for
``BLOCK_N``. The walk's first block has a column every row of the tile sees, so the running maximum is finite
before a row meets a block it cannot see, and no NaN arises.
Guarantees: every valid row of the tile is written once (O by masked stores, the lse in natural log), no row of
another segment. A block copied whole holds other segments' keys and values: their scores are -inf before the
softmax and their value rows are zeroed in shared memory before P V, so none of them (an inf or a NaN included)
reaches a product. Softmax statistics and O accumulate in float32.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .walk import kv_rings, loader, program_tile, walk_start, walk_step, zero_rows_past

LN2 = gl.constexpr(0.6931471805599453)


# --------------------------------------------------------------------------- the consumer partitions


@gluon.jit
def _softmax_block(s, m_i, l_i, rows, offs_n, start, limit, qk_scale, MASK: gl.constexpr):
    """One online-softmax step, after the mask when ``MASK`` (column c visible iff c < min(row + 1, limit)):
    ``(p, alpha, m, l)``, all float32."""
    if MASK:
        lim = gl.minimum(rows + 1, limit)
        s = gl.where((start + offs_n)[None, :] < lim[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _my_turn(turn, k, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong (FA3): the two consumer warpgroups issue their products in turns, so one's softmax
    runs while the other's products hold the tensor cores. Warpgroup 0 goes first (a fresh
    barrier passes the parity-1 wait); each turn ends with an arrive on the other's barrier."""
    if PINGPONG:
        mbarrier.wait(turn.index(WG), (k & 1) ^ (1 - WG))


@gluon.jit
def _their_turn(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _step(i, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, acc, p, alpha, m_i, l_i, s_zero,
          rows, offs_n, start, limit, qk_scale, MASK: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
          HEAD_DIM: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Block i of the steady state: issue Q K_i^T, rescale and issue P_{i-1} V_{i-1}, block i's softmax
    (FA3's order; the module docstring says how ptxas schedules it), then P_i in the operand layout
    of the next P V."""
    o_rows: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    st = i % STAGES
    prev = (i - 1) % STAGES
    mbarrier.wait(k_ready.index(st), (i // STAGES) & 1)
    _my_turn(turn, i, WG, PINGPONG)
    s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    mbarrier.wait(v_ready.index(prev), ((i - 1) // STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
    _their_turn(turn, WG, PINGPONG)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
    mbarrier.arrive(k_empty.index(st), count=1)
    p_new, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, rows, offs_n, start, limit, qk_scale, MASK)
    p_new = gl.convert_layout(p_new.to(p.dtype), p.type.layout)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(prev), count=1)
    p = p_new
    if MASK:
        if start + BLOCK_N > limit:
            mbarrier.wait(v_ready.index(st), (i // STAGES) & 1)
            zero_rows_past(v_smem.index(st), start, limit, BLOCK_N, HEAD_DIM)
    return acc, p, alpha, m_i, l_i


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, O, LSE,
              head, seg, seg_start, seg_end, m0, SEG_START, SEG_LEN, WALK,
              stride_oh, stride_ot, stride_od, stride_lh, qk_scale,
              ROWS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              STAGES: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr):
    # One warpgroup: the ROWS query rows of the tile from WG * ROWS on.
    row_off: gl.constexpr = WG * ROWS
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype

    q = q_smem.slice(row_off, ROWS)
    rows = m0 + row_off + gl.arange(0, ROWS, layout=s_rows)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    n_af, n_of, n_ar, n_d, diag_start, fa, f_start, f_end, ra = walk_start(
        seg, seg_start, seg_end, m0, SEG_START, SEG_LEN, WALK, BLOCK_M, BLOCK_N)
    n_full = n_af + n_of  # blocks [0, n_full) need no mask, [n_full, n) do
    n = n_full + n_ar + n_d

    # Block 0 (every tile has one: its first diagonal block at least), masked whatever its kind.
    start, limit, fa, f_start, f_end, ra = walk_step(
        0, n_af, n_of, n_ar, seg_start, seg_end, diag_start, fa, f_start, f_end, ra, SEG_START, SEG_LEN, WALK, BLOCK_N)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    _my_turn(turn, 0, WG, PINGPONG)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    _their_turn(turn, WG, PINGPONG)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, s_rows)
    l_i = gl.zeros([ROWS], gl.float32, s_rows)
    p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, rows, offs_n, start, limit, qk_scale, True)
    p = gl.convert_layout(p.to(dtype), p_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    if start + BLOCK_N > limit:
        mbarrier.wait(v_ready.index(0), 0)
        zero_rows_past(v_smem.index(0), start, limit, BLOCK_N, HEAD_DIM)

    # The steady state (``_step``): the full blocks without a mask or a walk, then the masked ones
    # (one loop with a per-element mask ran at 0.7x this speed: register pressure and issue slots).
    # The accumulator takes block i-1's rescale just before its P V is issued (as FA3 does).
    for i in range(1, n_full):
        acc, p, alpha, m_i, l_i = _step(i, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, acc, p, alpha,
                                        m_i, l_i, s_zero, rows, offs_n, 0, 0, qk_scale, False, STAGES, BLOCK_N,
                                        HEAD_DIM, WG, PINGPONG)
    for i in range(gl.maximum(n_full, 1), n):
        start, limit, fa, f_start, f_end, ra = walk_step(
            i, n_af, n_of, n_ar, seg_start, seg_end, diag_start, fa, f_start, f_end, ra, SEG_START, SEG_LEN, WALK,
            BLOCK_N)
        acc, p, alpha, m_i, l_i = _step(i, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, acc, p, alpha,
                                        m_i, l_i, s_zero, rows, offs_n, start, limit, qk_scale, True, STAGES, BLOCK_N,
                                        HEAD_DIM, WG, PINGPONG)

    last = (n - 1) % STAGES
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    mbarrier.wait(v_ready.index(last), ((n - 1) // STAGES) & 1)
    _my_turn(turn, n, WG, PINGPONG)
    acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
    _their_turn(turn, WG, PINGPONG)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(last), count=1)

    l_o = gl.convert_layout(l_i, o_rows)
    out = acc / l_o[:, None]
    rows_o = m0 + row_off + gl.arange(0, ROWS, layout=o_rows)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = O + head.to(gl.int64) * stride_oh + rows_o[:, None] * stride_ot + offs_d[None, :] * stride_od
    gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(rows_o < seg_end)[:, None])
    # m_i is in base-2 units of the scaled score: lse = ln(2) * (m + log2(l)).
    lse = (m_i + gl.log2(l_i)) * LN2
    gl.store(LSE + head.to(gl.int64) * stride_lh + rows, lse, mask=rows < seg_end)


# --------------------------------------------------------------------------- the kernel


# Arguments that follow T get no value specialisation, so a new length never compiles a second variant.
@gluon.jit(do_not_specialize=["num_tiles", "q_row_h", "q_col_h", "k_row_h", "k_col_h", "v_row_h", "v_col_h",
                              "stride_lh"])
def shared_prompt_fwd_kernel(
    q_desc, k_desc, v_desc, O, LSE, TILES, num_tiles,
    q_row_h, q_col_h, k_row_h, k_col_h, v_row_h, v_col_h,
    SEG_START, SEG_LEN, WALK,
    stride_oh, stride_ot, stride_od, stride_lh,
    heads_per_kv, qk_scale,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    LOADER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr,
):
    # Heads vary fastest: the query heads of one kv head run side by side and share K/V in L2.
    head = gl.program_id(0)
    seg, seg_start, seg_end, m0 = program_tile(TILES, num_tiles, SEG_START, SEG_LEN, BLOCK_M)
    if seg < 0:
        return
    kv_head = head // heads_per_kv
    ROWS: gl.constexpr = BLOCK_M // 2

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = kv_rings(k_desc, v_desc, STAGES, BLOCK_N, HEAD_DIM)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)

    gl.warp_specialize(
        [
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, O, LSE,
                         head, seg, seg_start, seg_end, m0, SEG_START, SEG_LEN, WALK,
                         stride_oh, stride_ot, stride_od, stride_lh, qk_scale,
                         ROWS, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, 0, PINGPONG)),
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, O, LSE,
                         head, seg, seg_start, seg_end, m0, SEG_START, SEG_LEN, WALK,
                         stride_oh, stride_ot, stride_od, stride_lh, qk_scale,
                         ROWS, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, 1, PINGPONG)),
            (loader, (q_desc, q_desc, k_desc, v_desc, q_smem, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                      k_empty, v_empty, head * q_row_h, head * q_col_h, 0, 0, kv_head * k_row_h, kv_head * k_col_h,
                      kv_head * v_row_h, kv_head * v_col_h, seg, seg_start, seg_end, m0, SEG_START, SEG_LEN, WALK,
                      BLOCK_M, BLOCK_N, STAGES, False)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )
