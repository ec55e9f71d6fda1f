"""The Q-major dQ kernel of shared-prompt attention's backward (``bwd.py`` has the preprocess and dK/dV kernels).

``bwd_dq_kernel``
    One program per query tile and query head walks the same regions as the
    forward (every ancestor's blocks, through the same ``WALK`` table for its
    ``BLOCK_N``; own blocks causal) and writes dQ = scale * dS K once. No
    running maximum: the saved lse normalises every block.

With ``WINDOW`` (sliding / chunked windows, ``windows.py``) it walks the
forward's windowed regions: ``TILES`` is ``windows.window_schedule``'s, the
ancestors' full blocks are taken from each one's last down and only as far
as the tile's rows see, own blocks only from the first row's lowest key;
blocks some row sees only in part get the window mask. ``window`` and
``chunk`` are runtime ints (none: ``windows.NONE``), never compile-time.

Assumes what ``fwd.py`` assumes, and Delta (``DELTA``) and the lse laid out
alike, ``[Hq, T]`` with head stride ``stride_lh``. Logit softcap as in
``bwd.py``. Guarantees: every valid row of dQ is written once; the
probabilities of masked columns are zero before they reach dQ (exp of a zero
score minus a very negative lse overflows, and inf * 0 is NaN).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import acc_dtype, load_pair, load_tile, lowest_depth, own_band, softcap_tanh, walk_down

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _dq_kv_block(
    dq, q, do, lse2, delta, Kh, Vh, descs, start_n, col_end, rows, lo_cols, offs_n, offs_d, d_ok,
    stride_kt, stride_kd, stride_vt, stride_vd, qk_scale,
    MASK: tl.constexpr,  # 0: full block, 1: ragged columns (zero-loaded), 2: causal diagonal
    WIN: tl.constexpr,  # the window mask: row i sees the columns >= lo_cols[i]
    EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr, SOFTCAP: tl.constexpr,
):
    cols = start_n + offs_n
    col_ok = cols < col_end
    k, v = load_pair(Kh, Vh, descs, start_n, cols, col_ok, offs_d, d_ok, stride_kt, stride_kd, stride_vt, stride_vd,
                     MASK != 0, EVEN_D, UPCAST, TMA)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if SOFTCAP != 0.0:
        tanh = softcap_tanh(s, qk_scale, SOFTCAP, q.dtype == tl.float32, 1.0)
        p = tl.math.exp2(tanh * (SOFTCAP * LOG2E) - lse2[:, None])
    else:
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
    if MASK == 1:
        # k = 0 past the ancestor's end, but p = exp2(0 - lse) can overflow there (and inf * 0 is NaN).
        p = tl.where(col_ok[None, :], p, 0.0)
    if MASK == 2:
        p = tl.where(cols[None, :] <= rows[:, None], p, 0.0)
    if WIN:
        p = tl.where(cols[None, :] >= lo_cols[:, None], p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    if SOFTCAP != 0.0:
        ds = ds * (1.0 - tanh * tanh)
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC, out_dtype=dq.dtype)
    return dq


# As in fwd.py: arguments that follow T, and the window sizes, get no value specialisation.
@triton.jit(do_not_specialize=["num_tiles", "k_row_h", "k_col_h", "v_row_h", "v_col_h", "stride_lh", "window", "chunk"])
def bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, TILES, num_tiles,
    K_DESC, V_DESC, k_row_h, k_col_h, v_row_h, v_col_h,
    SEG_START, SEG_LEN, WALK,
    stride_qh, stride_qt, stride_qd,
    stride_kh, stride_kt, stride_kd,
    stride_vh, stride_vt, stride_vd,
    stride_doh, stride_dot, stride_dod,
    stride_dqh, stride_dqt, stride_dqd,
    stride_lh,
    heads_per_kv, qk_scale, sm_scale,
    PREFIX_LEN, window, chunk,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    TMA: tl.constexpr, SOFTCAP: tl.constexpr = 0.0, WINDOW: tl.constexpr = False,
):
    head = tl.program_id(0)
    t = tl.program_id(1)
    seg = tl.load(TILES + t)
    if seg < 0:
        return
    tile = tl.load(TILES + num_tiles + t)
    seg_start = tl.load(SEG_START + seg)
    seg_end = seg_start + tl.load(SEG_LEN + seg)

    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    ACC: tl.constexpr = acc_dtype(Q.dtype.element_ty)
    m0 = seg_start + tile * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < seg_end
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    kv_head = head // heads_per_kv
    Kh = K + kv_head.to(tl.int64) * stride_kh
    Vh = V + kv_head.to(tl.int64) * stride_vh
    descs = (K_DESC, kv_head * k_row_h, kv_head * k_col_h, V_DESC, kv_head * v_row_h, kv_head * v_col_h)
    q = load_tile(Q + head.to(tl.int64) * stride_qh + rows[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                  row_ok, d_ok, True, EVEN_D, UPCAST)
    do = load_tile(DO + head.to(tl.int64) * stride_doh + rows[:, None] * stride_dot + offs_d[None, :] * stride_dod,
                   row_ok, d_ok, True, EVEN_D, UPCAST)
    # Rows past the segment load q = dO = 0 and lse = Delta = 0: finite, never stored.
    lse2 = tl.load(LSE + head.to(tl.int64) * stride_lh + rows, mask=row_ok, other=0.0) * LOG2E
    delta = tl.load(DELTA + head.to(tl.int64) * stride_lh + rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], ACC)

    # The ancestors as in the forward (all their full blocks, nearest first, then each ragged last
    # block; two flat loops, no branch: see fwd.py), then the own tokens, causal. No running
    # maximum here: the saved lse normalises every block.
    walk = WALK + seg * 4
    diag_start = seg_start + ((m0 - seg_start) // BLOCK_N) * BLOCK_N
    diag_end = tl.minimum(m0 + BLOCK_M, seg_end)
    if WINDOW:
        # The forward's windowed walk, block for block (fwd.py): whole blocks, the band, ragged blocks;
        # then the own tokens from the first row's lowest key, the band masked.
        qoff = tl.load(PREFIX_LEN + seg) - seg_start
        lo_rows = lowest_depth(tl.minimum(rows, seg_end - 1) + qoff, window, chunk)
        n_whole = tl.load(TILES + 2 * num_tiles + t)
        anc, a_start, start_n, koff = walk_down(WALK, SEG_START, SEG_LEN, PREFIX_LEN, seg, seg_start, seg_start,
                                                BLOCK_N)
        for _ in range(0, n_whole):
            dq = _dq_kv_block(dq, q, do, lse2, delta, Kh, Vh, descs, start_n, seg_end, rows, lo_rows, offs_n, offs_d,
                              d_ok, stride_kt, stride_kd, stride_vt, stride_vd, qk_scale, 0, False, EVEN_D, DOT_PREC,
                              UPCAST, TMA, SOFTCAP)
            anc, a_start, start_n, koff = walk_down(WALK, SEG_START, SEG_LEN, PREFIX_LEN, anc, a_start, start_n,
                                                    BLOCK_N)
        for _ in range(n_whole, tl.load(TILES + 3 * num_tiles + t)):
            dq = _dq_kv_block(dq, q, do, lse2, delta, Kh, Vh, descs, start_n, seg_end, rows, lo_rows - koff, offs_n,
                              offs_d, d_ok, stride_kt, stride_kd, stride_vt, stride_vd, qk_scale, 0, True, EVEN_D,
                              DOT_PREC, UPCAST, TMA, SOFTCAP)
            anc, a_start, start_n, koff = walk_down(WALK, SEG_START, SEG_LEN, PREFIX_LEN, anc, a_start, start_n,
                                                    BLOCK_N)
        anc = tl.maximum(tl.load(walk + 3), 0)
        for _ in tl.range(0, tl.load(TILES + 4 * num_tiles + t), num_stages=1):
            a_start = tl.load(SEG_START + anc)
            a_end = a_start + tl.load(SEG_LEN + anc)
            dq = _dq_kv_block(dq, q, do, lse2, delta, Kh, Vh, descs, a_start + ((a_end - a_start) // BLOCK_N) * BLOCK_N,
                              a_end, rows, lo_rows - (tl.load(PREFIX_LEN + anc) - a_start), offs_n, offs_d, d_ok,
                              stride_kt, stride_kd, stride_vt, stride_vd, qk_scale, 1, True, EVEN_D, DOT_PREC, UPCAST,
                              TMA, SOFTCAP)
            anc = tl.maximum(tl.load(WALK + anc * 4 + 3), 0)
        first, band_end = own_band(m0, qoff, seg_start, diag_start, diag_end, window, chunk, BLOCK_N)
        for start_n in range(first, band_end, BLOCK_N):
            dq = _dq_kv_block(dq, q, do, lse2, delta, Kh, Vh, descs, start_n, seg_end, rows, lo_rows - qoff, offs_n,
                              offs_d, d_ok, stride_kt, stride_kd, stride_vt, stride_vd, qk_scale, 0, True, EVEN_D,
                              DOT_PREC, UPCAST, TMA, SOFTCAP)
        for start_n in range(band_end, diag_start, BLOCK_N):
            dq = _dq_kv_block(dq, q, do, lse2, delta, Kh, Vh, descs, start_n, seg_end, rows, lo_rows, offs_n, offs_d,
                              d_ok, stride_kt, stride_kd, stride_vt, stride_vd, qk_scale, 0, False, EVEN_D, DOT_PREC,
                              UPCAST, TMA, SOFTCAP)
        for start_n in range(diag_start, diag_end, BLOCK_N):
            dq = _dq_kv_block(dq, q, do, lse2, delta, Kh, Vh, descs, start_n, seg_end, rows, lo_rows - qoff, offs_n,
                              offs_d, d_ok, stride_kt, stride_kd, stride_vt, stride_vd, qk_scale, 2, True, EVEN_D,
                              DOT_PREC, UPCAST, TMA, SOFTCAP)
    else:
        anc = tl.maximum(tl.load(walk + 2), 0)
        start_n = tl.load(SEG_START + anc)
        full_end = start_n + (tl.load(SEG_LEN + anc) // BLOCK_N) * BLOCK_N
        for _ in range(0, tl.load(walk)):
            dq = _dq_kv_block(dq, q, do, lse2, delta, Kh, Vh, descs, start_n, full_end, rows, rows, offs_n, offs_d,
                              d_ok, stride_kt, stride_kd, stride_vt, stride_vd, qk_scale, 0, False, EVEN_D, DOT_PREC,
                              UPCAST, TMA, SOFTCAP)
            start_n += BLOCK_N
            moved = start_n >= full_end
            anc = tl.where(moved, tl.maximum(tl.load(WALK + anc * 4 + 2), 0), anc)
            a_start = tl.load(SEG_START + anc)
            start_n = tl.where(moved, a_start, start_n)
            full_end = tl.where(moved, a_start + (tl.load(SEG_LEN + anc) // BLOCK_N) * BLOCK_N, full_end)
        anc = tl.maximum(tl.load(walk + 3), 0)
        for _ in tl.range(0, tl.load(walk + 1), num_stages=1):  # one block per ancestor: no pipeline
            a_start = tl.load(SEG_START + anc)
            a_end = a_start + tl.load(SEG_LEN + anc)
            dq = _dq_kv_block(dq, q, do, lse2, delta, Kh, Vh, descs, a_start + ((a_end - a_start) // BLOCK_N) * BLOCK_N,
                              a_end, rows, rows, offs_n, offs_d, d_ok, stride_kt, stride_kd, stride_vt, stride_vd,
                              qk_scale, 1, False, EVEN_D, DOT_PREC, UPCAST, TMA, SOFTCAP)
            anc = tl.maximum(tl.load(WALK + anc * 4 + 3), 0)
        for start_n in range(seg_start, diag_start, BLOCK_N):
            dq = _dq_kv_block(dq, q, do, lse2, delta, Kh, Vh, descs, start_n, seg_end, rows, rows, offs_n, offs_d,
                              d_ok, stride_kt, stride_kd, stride_vt, stride_vd, qk_scale, 0, False, EVEN_D, DOT_PREC,
                              UPCAST, TMA, SOFTCAP)
        for start_n in range(diag_start, diag_end, BLOCK_N):
            dq = _dq_kv_block(dq, q, do, lse2, delta, Kh, Vh, descs, start_n, seg_end, rows, rows, offs_n, offs_d,
                              d_ok, stride_kt, stride_kd, stride_vt, stride_vd, qk_scale, 2, False, EVEN_D, DOT_PREC,
                              UPCAST, TMA, SOFTCAP)

    dq = dq * sm_scale
    dq_ptrs = DQ + head.to(tl.int64) * stride_dqh + rows[:, None] * stride_dqt + offs_d[None, :] * stride_dqd
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
