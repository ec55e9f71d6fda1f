"""Forward Triton kernel of shared-prompt attention on the packed stream.

One program computes ``BLOCK_M`` query rows of one segment for one query head, over two kinds of key/value
regions with ONE online softmax: every ancestor segment, every key visible (first the full blocks of all of them,
with no mask arithmetic, then each one's ragged last block, masked past its end), then the segment's own tokens
up to the tile (full blocks left of the diagonal, the diagonal blocks causal). With ``WINDOW`` (runtime
``window`` and ``chunk`` on token depth; the flag is the only compile-time part) the regions shrink to what the
tile's rows see: each ancestor's full blocks walked from its last one down, ``TILES`` (then
``windows.window_schedule``'s) saying how many every row sees whole and how many any row sees (masked per
element), the chain below never loaded. It writes the output and the lse (natural log of the sum of
``exp(scale * q.k)``), which the backward reuses; ``SOFTCAP`` (compile-time, 0.0: none) caps the scaled score
(``SOFTCAP * tanh(s / SOFTCAP)``) before the masks, the lse over the capped scores.

Assumes
    * q ``[1, Hq, T, D]``, k and v ``[1, Hkv, T, D]``, o like q, any strides; query head h reads kv head h // (Hq/Hkv).
    * ``TILES`` from ``schedule.tile_schedule``: ``TILES[0, t]`` program t's segment (-1: grid padding), ``TILES[1,
      t]`` its tile in the segment, heaviest first; ``SEG_START``, ``SEG_LEN`` the ``Segments`` columns; ``WALK``
      the ancestor walk for ``BLOCK_N`` (``schedule.ancestor_walk``); ``PREFIX_LEN`` read only with ``WINDOW``.
      Lengths and the forest's shape reach the kernel only as tensors: a new layout never recompiles it.
    * With ``TMA``, ``K_DESC`` / ``V_DESC`` are tensor descriptors over K / V (``tma.tma_view``: kv head h's rows
      from token t at ``[h * row_h + t, h * col_h]``), for full blocks only; masked blocks keep masked loads.
Guarantees: every valid query row of every segment is written exactly once, rows of other segments never; no
value outside a segment enters a product; softmax statistics, accumulator and lse are float32 (``ACC``; float64
for float64 inputs), the scores in base 2 with ``scale * log2(e)`` folded into one multiply-add.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import acc_dtype, load_pair, load_tile, lowest_depth, own_band, softcap_tanh, walk_down

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _fwd_kv_block(
    acc, l_i, m_i, q, K, V, descs, start_n, col_end, rows, lo_cols,
    offs_n, offs_d, d_ok, stride_kt, stride_kd, stride_vt, stride_vd, qk_scale,
    MASK: tl.constexpr,  # 0: full block, 1: ragged columns (>= col_end hidden), 2: causal diagonal
    WIN: tl.constexpr,  # the window mask: row i sees the columns >= lo_cols[i] (its lowest depth, as an index)
    EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    cols = start_n + offs_n
    col_ok = cols < col_end
    k, v = load_pair(K, V, descs, start_n, cols, col_ok, offs_d, d_ok, stride_kt, stride_kd, stride_vt, stride_vd,
                     MASK != 0, EVEN_D, UPCAST, TMA)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if SOFTCAP != 0.0:
        # The capped score, scaled, in base 2 (the scale is inside: no qk_scale below); before the masks.
        s = softcap_tanh(s, qk_scale, SOFTCAP, q.dtype == tl.float32, SOFTCAP * LOG2E)
    if MASK == 1:
        s = tl.where(col_ok[None, :], s, float("-inf"))
    if MASK == 2:
        # Columns past the segment end only pass for rows past it too (never stored).
        s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
    if WIN:
        s = tl.where(cols[None, :] >= lo_cols[:, None], s, float("-inf"))
    # Without a window every row has seen a finite score before any all-masked block, so m_new is
    # finite and no NaN appears: the walk's first block is an ancestor's full block, else (no ancestor
    # has one) an ancestor's ragged block, at least one column of it visible, else (no ancestor has a
    # token) the segment's own first block, whose column seg_start every row sees. A window can hide a
    # whole block from a row that has seen nothing yet: its maximum stays -inf, and the exponentials
    # subtract 0 instead (p = exp2(-inf) = 0, alpha = 0), so its sums stay 0 until its first visible key.
    if SOFTCAP != 0.0:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_sub = m_new
    if WIN:
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    if SOFTCAP != 0.0:
        p = tl.math.exp2(s - m_sub[:, None])
    else:
        p = tl.math.exp2(s * qk_scale - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC, out_dtype=acc.dtype)
    return acc, l_i, m_new


# Arguments that follow T (the tile count, the lse head stride, the descriptors' row and column offsets)
# get no value specialisation (divisible by 16 or not), so a new length never compiles a second variant;
# nor do the window and chunk sizes (a runtime int each: one compiled variant for every window).
@triton.jit(do_not_specialize=["num_tiles", "k_row_h", "k_col_h", "v_row_h", "v_col_h", "stride_lh", "window", "chunk"])
def shared_prompt_fwd_kernel(
    Q, K, V, O, LSE, TILES, num_tiles,
    K_DESC, V_DESC, k_row_h, k_col_h, v_row_h, v_col_h,
    SEG_START, SEG_LEN, WALK,
    stride_qh, stride_qt, stride_qd,
    stride_kh, stride_kt, stride_kd,
    stride_vh, stride_vt, stride_vd,
    stride_oh, stride_ot, stride_od,
    stride_lh,
    heads_per_kv, qk_scale,
    PREFIX_LEN, window, chunk,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    TMA: tl.constexpr, SOFTCAP: tl.constexpr = 0.0, WINDOW: tl.constexpr = False,
):
    # Heads vary fastest so the query heads of one kv head (and of one tile) run
    # side by side and share the k/v blocks in L2.
    head = tl.program_id(0)
    t = tl.program_id(1)
    seg = tl.load(TILES + t)
    if seg < 0:
        return
    tile = tl.load(TILES + num_tiles + t)
    seg_start = tl.load(SEG_START + seg)
    seg_end = seg_start + tl.load(SEG_LEN + seg)

    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    ACC: tl.constexpr = acc_dtype(Q.dtype.element_ty)  # float32; float64 for float64 inputs (interpreter only)
    m0 = seg_start + tile * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < seg_end
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    kv_head = head // heads_per_kv
    Qh = Q + head.to(tl.int64) * stride_qh
    Kh = K + kv_head.to(tl.int64) * stride_kh
    Vh = V + kv_head.to(tl.int64) * stride_vh
    descs = (K_DESC, kv_head * k_row_h, kv_head * k_col_h, V_DESC, kv_head * v_row_h, kv_head * v_col_h)
    q = load_tile(Qh + rows[:, None] * stride_qt + offs_d[None, :] * stride_qd, row_ok, d_ok, True, EVEN_D, UPCAST)

    m_i = tl.full([BLOCK_M], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC)

    # Region 1: the ancestors, fully visible: the full blocks of all of them (nearest ancestor
    # first), then each one's ragged last block. Two flat loops without a branch inside: a loop
    # nest or a branch around the accumulator makes ptxas serialise every wgmma of the kernel
    # (sm_90, "C7515", seen with benchmarks/tuning/sm90_resources.py), so the chain is walked through
    # WALK with selects. The order of the blocks is free: the online softmax is one sum.
    # Ancestor ids are clamped to 0: a -1 only appears once no block is left, and then the
    # loads of segment 0 are in bounds and unused.
    walk = WALK + seg * 4
    diag_start = seg_start + ((m0 - seg_start) // BLOCK_N) * BLOCK_N
    diag_end = tl.minimum(m0 + BLOCK_M, seg_end)
    if WINDOW:
        # Sliding / chunked windows (windows.py): row i sees the keys of depth >= its lowest, lo_rows[i]
        # (rows past the segment take the last row's: never stored, and never without a visible key).
        # The walk takes each ancestor's full blocks from its last down, so depth only descends:
        # TILES' row 2 counts the blocks every row sees whole, row 3 those any row sees (the rest of
        # the chain, below every row's window, is never loaded); row 4 the ragged blocks any row sees.
        qoff = tl.load(PREFIX_LEN + seg) - seg_start  # own token index -> depth
        lo_rows = lowest_depth(tl.minimum(rows, seg_end - 1) + qoff, window, chunk)
        n_whole = tl.load(TILES + 2 * num_tiles + t)
        # Leaving the segment itself, as if from its first block, lands on the nearest ancestor's last one.
        anc, a_start, start_n, koff = walk_down(WALK, SEG_START, SEG_LEN, PREFIX_LEN, seg, seg_start, seg_start,
                                                BLOCK_N)
        for _ in range(0, n_whole):
            acc, l_i, m_i = _fwd_kv_block(
                acc, l_i, m_i, q, Kh, Vh, descs, start_n, seg_end, rows, lo_rows, offs_n, offs_d, d_ok,
                stride_kt, stride_kd, stride_vt, stride_vd, qk_scale, 0, False, EVEN_D, DOT_PREC, UPCAST, TMA,
                SOFTCAP)
            anc, a_start, start_n, koff = walk_down(WALK, SEG_START, SEG_LEN, PREFIX_LEN, anc, a_start, start_n,
                                                    BLOCK_N)
        for _ in range(n_whole, tl.load(TILES + 3 * num_tiles + t)):
            acc, l_i, m_i = _fwd_kv_block(
                acc, l_i, m_i, q, Kh, Vh, descs, start_n, seg_end, rows, lo_rows - koff, offs_n, offs_d, d_ok,
                stride_kt, stride_kd, stride_vt, stride_vd, qk_scale, 0, True, EVEN_D, DOT_PREC, UPCAST, TMA,
                SOFTCAP)
            anc, a_start, start_n, koff = walk_down(WALK, SEG_START, SEG_LEN, PREFIX_LEN, anc, a_start, start_n,
                                                    BLOCK_N)
        anc = tl.maximum(tl.load(walk + 3), 0)
        for _ in tl.range(0, tl.load(TILES + 4 * num_tiles + t), num_stages=1):
            a_start = tl.load(SEG_START + anc)
            a_end = a_start + tl.load(SEG_LEN + anc)
            acc, l_i, m_i = _fwd_kv_block(
                acc, l_i, m_i, q, Kh, Vh, descs, a_start + ((a_end - a_start) // BLOCK_N) * BLOCK_N, a_end, rows,
                lo_rows - (tl.load(PREFIX_LEN + anc) - a_start), offs_n, offs_d, d_ok, stride_kt, stride_kd,
                stride_vt, stride_vd, qk_scale, 1, True, EVEN_D, DOT_PREC, UPCAST, TMA, SOFTCAP)
            anc = tl.maximum(tl.load(WALK + anc * 4 + 3), 0)
        # Own tokens: from the block of the first row's lowest key; the blocks below the last row's lowest
        # key (the band) masked, then full ones up to the diagonal, whose blocks get both masks.
        first, band_end = own_band(m0, qoff, seg_start, diag_start, diag_end, window, chunk, BLOCK_N)
        for start_n in range(first, band_end, BLOCK_N):
            acc, l_i, m_i = _fwd_kv_block(
                acc, l_i, m_i, q, Kh, Vh, descs, start_n, seg_end, rows, lo_rows - qoff, offs_n, offs_d, d_ok,
                stride_kt, stride_kd, stride_vt, stride_vd, qk_scale, 0, True, EVEN_D, DOT_PREC, UPCAST, TMA,
                SOFTCAP)
        for start_n in range(band_end, diag_start, BLOCK_N):
            acc, l_i, m_i = _fwd_kv_block(
                acc, l_i, m_i, q, Kh, Vh, descs, start_n, seg_end, rows, lo_rows, offs_n, offs_d, d_ok,
                stride_kt, stride_kd, stride_vt, stride_vd, qk_scale, 0, False, EVEN_D, DOT_PREC, UPCAST, TMA,
                SOFTCAP)
        for start_n in range(diag_start, diag_end, BLOCK_N):
            acc, l_i, m_i = _fwd_kv_block(
                acc, l_i, m_i, q, Kh, Vh, descs, start_n, seg_end, rows, lo_rows - qoff, offs_n, offs_d, d_ok,
                stride_kt, stride_kd, stride_vt, stride_vd, qk_scale, 2, True, EVEN_D, DOT_PREC, UPCAST, TMA,
                SOFTCAP)
    else:
        anc = tl.maximum(tl.load(walk + 2), 0)
        start_n = tl.load(SEG_START + anc)
        full_end = start_n + (tl.load(SEG_LEN + anc) // BLOCK_N) * BLOCK_N
        for _ in range(0, tl.load(walk)):
            acc, l_i, m_i = _fwd_kv_block(
                acc, l_i, m_i, q, Kh, Vh, descs, start_n, full_end, rows, rows, offs_n, offs_d, d_ok,
                stride_kt, stride_kd, stride_vt, stride_vd, qk_scale, 0, False, EVEN_D, DOT_PREC, UPCAST, TMA,
                SOFTCAP)
            start_n += BLOCK_N
            # Past this ancestor's full blocks: on to the next ancestor that has some.
            moved = start_n >= full_end
            anc = tl.where(moved, tl.maximum(tl.load(WALK + anc * 4 + 2), 0), anc)
            a_start = tl.load(SEG_START + anc)
            start_n = tl.where(moved, a_start, start_n)
            full_end = tl.where(moved, a_start + (tl.load(SEG_LEN + anc) // BLOCK_N) * BLOCK_N, full_end)
        anc = tl.maximum(tl.load(walk + 3), 0)
        # At most one block per ancestor: not worth the shared memory and registers of a pipeline.
        for _ in tl.range(0, tl.load(walk + 1), num_stages=1):
            a_start = tl.load(SEG_START + anc)
            a_end = a_start + tl.load(SEG_LEN + anc)
            acc, l_i, m_i = _fwd_kv_block(
                acc, l_i, m_i, q, Kh, Vh, descs, a_start + ((a_end - a_start) // BLOCK_N) * BLOCK_N, a_end, rows,
                rows, offs_n, offs_d, d_ok, stride_kt, stride_kd, stride_vt, stride_vd, qk_scale, 1, False, EVEN_D,
                DOT_PREC, UPCAST, TMA, SOFTCAP)
            anc = tl.maximum(tl.load(WALK + anc * 4 + 3), 0)

        # Region 2: the segment's own tokens, causal. Blocks ending at or before the
        # tile's first row are full; the rest straddle the diagonal.
        for start_n in range(seg_start, diag_start, BLOCK_N):
            acc, l_i, m_i = _fwd_kv_block(
                acc, l_i, m_i, q, Kh, Vh, descs, start_n, seg_end, rows, rows,
                offs_n, offs_d, d_ok, stride_kt, stride_kd, stride_vt, stride_vd, qk_scale, 0, False, EVEN_D, DOT_PREC,
                UPCAST, TMA, SOFTCAP)
        for start_n in range(diag_start, diag_end, BLOCK_N):
            acc, l_i, m_i = _fwd_kv_block(
                acc, l_i, m_i, q, Kh, Vh, descs, start_n, seg_end, rows, rows,
                offs_n, offs_d, d_ok, stride_kt, stride_kd, stride_vt, stride_vd, qk_scale, 2, False, EVEN_D, DOT_PREC,
                UPCAST, TMA, SOFTCAP)

    out = acc / l_i[:, None]
    Oh = O + head.to(tl.int64) * stride_oh
    o_ptrs = Oh + rows[:, None] * stride_ot + offs_d[None, :] * stride_od
    if EVEN_D:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    # m_i is in base-2 units of the scaled score: lse = ln(2) * (m + log2(l)).
    lse = (m_i + tl.math.log2(l_i)) * LN2
    tl.store(LSE + head.to(tl.int64) * stride_lh + rows, lse, mask=row_ok)
