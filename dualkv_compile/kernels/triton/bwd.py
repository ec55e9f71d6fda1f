"""Backward Triton kernels of shared-prompt attention on the packed stream: the dK/dV kernel.

With P the softmax (recomputed from q, k and the saved log-sum-exp) and Delta = rowsum(dO * O): ``dV = P^T dO``,
``dS = P * (dO V^T - Delta)``, ``dQ = scale * dS K``, ``dK = scale * dS^T Q``.

The preprocess kernel before it (Delta per query row and head, with the packed row statistics the dK/dV kernel
reads with one bulk copy per block under ``STATS_TMA``) is shared with the Gluon backward: ``common/row_statistics.py``.
``bwd_dkdv_kernel`` (KV-major): one program owns ``BLOCK_N`` keys of one segment and one kv head and loops over
every query block that reads them (the diagonal, causal and masked; then the run ``[after the diagonal,
subtree_end)``, full blocks in one pipelined loop and the ragged last one) for the ``heads_per_kv`` query heads
of the kv head. dK and dV accumulate in registers and are written once: no atomics, a fixed order
(deterministic); for float32 inputs in two levels (``tiles.key_sum_chunk``). ``HEAD_SPLIT > 1`` spreads the
query heads over programs adding into float32 buffers with atomics; ``ATOMIC_DQ`` also adds dS K into a float32
dQ buffer (neither bitwise reproducible). ``bwd_dq_kernel`` (Q-major) lives in ``bwd_dq.py`` (importable here).
With ``WINDOW`` (runtime ``window`` and ``chunk``) a key tile at depths klo..khi reads only the query rows of
depth <= ``last_reader(khi)`` (``windows.py``; docs/design.md, "Triton kernels"). ``SOFTCAP`` (compile-time;
0.0: the kernels without it): P from the capped scores, dS times the cap's derivative ``1 - tanh^2``.

Assumes what ``fwd.py`` assumes, plus ``Segments`` in pre-order, so ``SUBTREE_END[s]`` ends the one run holding s
and its descendants. With ``TMA`` the loop-carried operands' full blocks load through tensor descriptors.
Guarantees: every valid row of dQ and every valid key row of dK/dV is written (atomic modes: added into zeroed
float32 buffers; every float32 here is the compile-time ``ACC``, float64 for float64 inputs); contributions of
rows or columns outside a segment are exactly zero: masked loads give zeros, and the probabilities of masked
columns are zero wherever they reach dQ (exp of a zero score minus a very negative lse overflows; inf * 0 is NaN).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .bwd_dq import bwd_dq_kernel  # noqa: F401  (the dQ kernel's module; importable from here as before)
from .tiles import acc_dtype, key_sum_chunk, last_reader, load_pair, load_tile, softcap_tanh

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _dkdv_q_block(
    dk, dv, k, v, Qh, DOh, LSEh, DELTAh, DQh, descs, start_m, row_end, offs_n, col_ok, offs_d, d_ok,
    stride_qt, stride_qd, stride_dot, stride_dod, stride_dqt, stride_dqd, qk_scale, sm_scale,
    BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, ROW_MASK: tl.constexpr,
    EVEN_D: tl.constexpr, ATOMIC_DQ: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
    STATS_TMA: tl.constexpr, SOFTCAP: tl.constexpr,
    WIN: tl.constexpr = False, qoff=0, last_q=0,
):
    # WIN: the window mask, key i is read by the query rows r of depth r + qoff <= last_q[i] (its last reader's).
    rows = start_m + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    # descs: (q descriptor, this head's row and column in it, the same for dO,
    #         the packed row statistics' descriptor, this head's first row in it)
    q, do = load_pair(Qh, DOh, descs, start_m, rows, row_ok, offs_d, d_ok, stride_qt, stride_qd, stride_dot,
                      stride_dod, ROW_MASK, EVEN_D, UPCAST, TMA)
    if ROW_MASK:
        lse2 = tl.load(LSEh + rows, mask=row_ok, other=0.0) * LOG2E
        delta = tl.load(DELTAh + rows, mask=row_ok, other=0.0)
    elif STATS_TMA:
        # One bulk copy of the packed rows: pointer loads here cost one 4-byte copy (and a
        # 64-bit address) per column each thread holds, which pushed the kernel into spills.
        packed = tl.reshape(descs[6].load([descs[7] + start_m, 0]), [BLOCK_M, 2, 2])
        lse2, delta = tl.split(tl.split(packed)[0])
    else:
        lse2 = tl.load(LSEh + rows) * LOG2E
        delta = tl.load(DELTAh + rows)
    # Work on the transposed scores [BLOCK_N, BLOCK_M] so dK and dV come out
    # of the dots in the tile's own row order. dP is issued right after S so the
    # tensor cores compute it while the exponentials of P run (sm_90 SASS: the
    # exp2s interleave with dP's matrix instructions instead of waiting between them).
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    if SOFTCAP != 0.0:
        tanh_t = softcap_tanh(s_t, qk_scale, SOFTCAP, q.dtype == tl.float32, 1.0)
        p_t = tl.math.exp2(tanh_t * (SOFTCAP * LOG2E) - lse2[None, :])
    else:
        p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
    if CAUSAL:
        p_t = tl.where(offs_n[:, None] <= rows[None, :], p_t, 0.0)
    if WIN:
        p_t = tl.where((rows + qoff)[None, :] <= last_q[:, None], p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC, out_dtype=dv.dtype)
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFTCAP != 0.0:
        ds_t = ds_t * (1.0 - tanh_t * tanh_t)
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC, out_dtype=dk.dtype)
    if ATOMIC_DQ:
        # Columns past the segment hold k = 0, but p can overflow there: zero them before dS reaches dQ.
        ds_t = tl.where(col_ok[:, None], ds_t, 0.0)
        dq = tl.dot(tl.trans(ds_t).to(k.dtype), k, input_precision=DOT_PREC) * sm_scale
        dq_ptrs = DQh + rows[:, None] * stride_dqt + offs_d[None, :] * stride_dqd
        tl.atomic_add(dq_ptrs, dq, mask=row_ok[:, None] & d_ok[None, :], sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_rows(
    dk, dv, k, v, Qh, DOh, LSEh, DELTAh, DQh, descs, row_start, row_end, offs_n, col_ok, offs_d, d_ok,
    stride_qt, stride_qd, stride_dot, stride_dod, stride_dqt, stride_dqd, qk_scale, sm_scale,
    BLOCK_M: tl.constexpr, EVEN_D: tl.constexpr, ATOMIC_DQ: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr, TMA: tl.constexpr, STATS_TMA: tl.constexpr, SOFTCAP: tl.constexpr, CHUNK: tl.constexpr,
):
    # Query rows [row_start, row_end) that see every column of the tile: full
    # blocks, then the ragged tail with row masks on the loads only.
    full_end = row_start + ((row_end - row_start) // BLOCK_M) * BLOCK_M
    if CHUNK == 0:
        for start_m in range(row_start, full_end, BLOCK_M):
            dk, dv = _dkdv_q_block(
                dk, dv, k, v, Qh, DOh, LSEh, DELTAh, DQh, descs, start_m, row_end, offs_n, col_ok, offs_d, d_ok,
                stride_qt, stride_qd, stride_dot, stride_dod, stride_dqt, stride_dqd, qk_scale, sm_scale,
                BLOCK_M, False, False, EVEN_D, ATOMIC_DQ, DOT_PREC, UPCAST, TMA, STATS_TMA, SOFTCAP)
    else:
        # Two-level sum (float32 inputs, tiles.key_sum_chunk): CHUNK blocks at a time into a zeroed partial
        # sum, each partial then added to the total, so the error grows like CHUNK + blocks / CHUNK, not blocks.
        for chunk_m in range(row_start, full_end, CHUNK * BLOCK_M):
            part_k = tl.zeros(dk.shape, dk.dtype)
            part_v = tl.zeros(dv.shape, dv.dtype)
            for start_m in range(chunk_m, tl.minimum(chunk_m + CHUNK * BLOCK_M, full_end), BLOCK_M):
                part_k, part_v = _dkdv_q_block(
                    part_k, part_v, k, v, Qh, DOh, LSEh, DELTAh, DQh, descs, start_m, row_end, offs_n, col_ok,
                    offs_d, d_ok, stride_qt, stride_qd, stride_dot, stride_dod, stride_dqt, stride_dqd, qk_scale,
                    sm_scale, BLOCK_M, False, False, EVEN_D, ATOMIC_DQ, DOT_PREC, UPCAST, TMA, STATS_TMA, SOFTCAP)
            dk += part_k
            dv += part_v
    if full_end < row_end:
        dk, dv = _dkdv_q_block(
            dk, dv, k, v, Qh, DOh, LSEh, DELTAh, DQh, descs, full_end, row_end, offs_n, col_ok, offs_d, d_ok,
            stride_qt, stride_qd, stride_dot, stride_dod, stride_dqt, stride_dqd, qk_scale, sm_scale,
            BLOCK_M, False, True, EVEN_D, ATOMIC_DQ, DOT_PREC, UPCAST, TMA, STATS_TMA, SOFTCAP)
    return dk, dv


@triton.jit
def _dkdv_win_block(
    dk, dv, pk, pv, cnt, k, v, Qh, DOh, LSEh, DELTAh, DQh, descs, start_m, row_end, offs_n, col_ok, offs_d, d_ok,
    stride_qt, stride_qd, stride_dot, stride_dod, stride_dqt, stride_dqd, qk_scale, sm_scale, qoff, last_q,
    BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, ROW_MASK: tl.constexpr, WIN: tl.constexpr, EVEN_D: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
    STATS_TMA: tl.constexpr, SOFTCAP: tl.constexpr, CHUNK: tl.constexpr,
):
    # One query block under the windows. With CHUNK (float32: tiles.key_sum_chunk) it goes into the partial
    # sums pk, pv, added to dk, dv every CHUNK blocks as counted over all of the tile's row ranges (cnt): the
    # two-level sum's error bound however many readers' segments the blocks come from.
    if CHUNK == 0:
        dk, dv = _dkdv_q_block(
            dk, dv, k, v, Qh, DOh, LSEh, DELTAh, DQh, descs, start_m, row_end, offs_n, col_ok, offs_d, d_ok,
            stride_qt, stride_qd, stride_dot, stride_dod, stride_dqt, stride_dqd, qk_scale, sm_scale,
            BLOCK_M, CAUSAL, ROW_MASK, EVEN_D, ATOMIC_DQ, DOT_PREC, UPCAST, TMA, STATS_TMA, SOFTCAP,
            WIN, qoff, last_q)
    else:
        pk, pv = _dkdv_q_block(
            pk, pv, k, v, Qh, DOh, LSEh, DELTAh, DQh, descs, start_m, row_end, offs_n, col_ok, offs_d, d_ok,
            stride_qt, stride_qd, stride_dot, stride_dod, stride_dqt, stride_dqd, qk_scale, sm_scale,
            BLOCK_M, CAUSAL, ROW_MASK, EVEN_D, ATOMIC_DQ, DOT_PREC, UPCAST, TMA, STATS_TMA, SOFTCAP,
            WIN, qoff, last_q)
        cnt += 1
        flush = cnt % CHUNK == 0  # selects, not a branch around the accumulators
        dk = tl.where(flush, dk + pk, dk)
        dv = tl.where(flush, dv + pv, dv)
        pk = tl.where(flush, 0.0, pk)
        pv = tl.where(flush, 0.0, pv)
    return dk, dv, pk, pv, cnt


@triton.jit
def _dkdv_win_rows(
    dk, dv, pk, pv, cnt, k, v, Qh, DOh, LSEh, DELTAh, DQh, descs, row_start, row_end, offs_n, col_ok, offs_d, d_ok,
    stride_qt, stride_qd, stride_dot, stride_dod, stride_dqt, stride_dqd, qk_scale, sm_scale, qoff, last_q,
    BLOCK_M: tl.constexpr, WIN: tl.constexpr, EVEN_D: tl.constexpr, ATOMIC_DQ: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr, TMA: tl.constexpr, STATS_TMA: tl.constexpr, SOFTCAP: tl.constexpr, CHUNK: tl.constexpr,
):
    # Query rows [row_start, row_end) of one segment, after the tile's diagonal: full blocks (unmasked loads,
    # the copy engine's), then the ragged tail with row masks.
    full_end = row_start + ((row_end - row_start) // BLOCK_M) * BLOCK_M
    for start_m in range(row_start, full_end, BLOCK_M):
        dk, dv, pk, pv, cnt = _dkdv_win_block(
            dk, dv, pk, pv, cnt, k, v, Qh, DOh, LSEh, DELTAh, DQh, descs, start_m, row_end, offs_n, col_ok, offs_d,
            d_ok, stride_qt, stride_qd, stride_dot, stride_dod, stride_dqt, stride_dqd, qk_scale, sm_scale, qoff,
            last_q, BLOCK_M, False, False, WIN, EVEN_D, ATOMIC_DQ, DOT_PREC, UPCAST, TMA, STATS_TMA, SOFTCAP,
            CHUNK)
    if full_end < row_end:
        dk, dv, pk, pv, cnt = _dkdv_win_block(
            dk, dv, pk, pv, cnt, k, v, Qh, DOh, LSEh, DELTAh, DQh, descs, full_end, row_end, offs_n, col_ok, offs_d,
            d_ok, stride_qt, stride_qd, stride_dot, stride_dod, stride_dqt, stride_dqd, qk_scale, sm_scale, qoff,
            last_q, BLOCK_M, False, True, WIN, EVEN_D, ATOMIC_DQ, DOT_PREC, UPCAST, TMA, STATS_TMA, SOFTCAP,
            CHUNK)
    return dk, dv, pk, pv, cnt


@triton.jit(do_not_specialize=["num_tiles", "q_row_h", "q_col_h", "do_row_h", "do_col_h", "stats_row_h", "stride_lh",
                               "window", "chunk"])
def bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, TILES, num_tiles,
    Q_DESC, DO_DESC, q_row_h, q_col_h, do_row_h, do_col_h, STATS_DESC, stats_row_h,
    SEG_START, SEG_LEN, SUBTREE_END,
    stride_qh, stride_qt, stride_qd,
    stride_kh, stride_kt, stride_kd,
    stride_vh, stride_vt, stride_vd,
    stride_doh, stride_dot, stride_dod,
    stride_dkh, stride_dkt, stride_dkd,
    stride_dvh, stride_dvt, stride_dvd,
    stride_dqh, stride_dqt, stride_dqd,
    stride_lh,
    heads_per_kv, qk_scale, sm_scale,
    PREFIX_LEN, SUBTREE_NEXT, window, chunk,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_SPLIT: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
    STATS_TMA: tl.constexpr, SOFTCAP: tl.constexpr = 0.0, WINDOW: tl.constexpr = False,
):
    pid_h = tl.program_id(0)
    t = tl.program_id(1)
    seg = tl.load(TILES + t)
    if seg < 0:
        return
    tile = tl.load(TILES + num_tiles + t)
    kv_head = pid_h // HEAD_SPLIT
    split = pid_h % HEAD_SPLIT
    seg_start = tl.load(SEG_START + seg)
    seg_end = seg_start + tl.load(SEG_LEN + seg)
    subtree_end = tl.load(SUBTREE_END + seg)

    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    ACC: tl.constexpr = acc_dtype(Q.dtype.element_ty)
    n0 = seg_start + tile * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    col_ok = offs_n < seg_end
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    k = load_tile(K + kv_head.to(tl.int64) * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                  col_ok, d_ok, True, EVEN_D, UPCAST)
    v = load_tile(V + kv_head.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                  col_ok, d_ok, True, EVEN_D, UPCAST)
    dk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_D], ACC)

    # Own rows on the diagonal: blocks starting at n0 until they pass the
    # tile's last column; then the rows after the tile see all of it, and so
    # does every row of every descendant, which pre-order puts right after the
    # segment: one range [after_diag, subtree_end), one pipelined loop, and a
    # fixed order of the sum over all readers (deterministic).
    n_diag = tl.cdiv(tl.minimum(BLOCK_N, seg_end - n0), BLOCK_M)
    after_diag = tl.minimum(n0 + n_diag * BLOCK_M, seg_end)
    heads_per_prog = heads_per_kv // HEAD_SPLIT
    CHUNK: tl.constexpr = key_sum_chunk(Q.dtype.element_ty)
    if WINDOW:
        # Sliding / chunked windows (windows.py): the tile's keys (depths klo..khi) are read by the queries
        # of depth <= last_reader(khi), and whole by those of depth <= last_reader(klo); the rest get the
        # window mask, the deeper ones are never loaded. Own rows by index; the subtree's readers are a run
        # per descendant segment (its first rows), walked in pre-order, a segment the window does not
        # reach skipped with all its descendants (SUBTREE_NEXT; windows.subtree_next).
        koff = tl.load(PREFIX_LEN + seg) - seg_start  # own token index -> depth
        last_q = last_reader(offs_n + koff, window, chunk)  # per key: the deepest query that sees it
        whole_to = last_reader(n0 + koff, window, chunk)
        seen_to = last_reader(tl.minimum(n0 + BLOCK_N, seg_end) - 1 + koff, window, chunk)
        # The readers' walk: the own rows after the diagonal, then (when the window reaches the children,
        # which start at depth seg_end + koff) the subtree's segments.
        stop = tl.where(seg_end + koff <= seen_to, tl.load(SUBTREE_NEXT + seg), seg + 1)
        if CHUNK == 0:  # no partial sums: stand-ins that stay untouched
            pk = tl.zeros([1, 1], ACC)
            pv = tl.zeros([1, 1], ACC)
        else:
            pk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
            pv = tl.zeros([BLOCK_N, BLOCK_D], ACC)
        cnt = n0 * 0
    for i in range(0, heads_per_prog):
        head = kv_head * heads_per_kv + split * heads_per_prog + i
        Qh = Q + head.to(tl.int64) * stride_qh
        DOh = DO + head.to(tl.int64) * stride_doh
        LSEh = LSE + head.to(tl.int64) * stride_lh
        DELTAh = DELTA + head.to(tl.int64) * stride_lh
        DQh = DQ + head.to(tl.int64) * stride_dqh
        descs = (Q_DESC, head * q_row_h, head * q_col_h, DO_DESC, head * do_row_h, head * do_col_h,
                 STATS_DESC, head * stats_row_h)
        if WINDOW:
            for j in range(0, n_diag):
                dk, dv, pk, pv, cnt = _dkdv_win_block(
                    dk, dv, pk, pv, cnt, k, v, Qh, DOh, LSEh, DELTAh, DQh, descs, n0 + j * BLOCK_M, seg_end, offs_n,
                    col_ok, offs_d, d_ok, stride_qt, stride_qd, stride_dot, stride_dod, stride_dqt, stride_dqd,
                    qk_scale, sm_scale, koff, last_q, BLOCK_M, True, True, True, EVEN_D, ATOMIC_DQ,
                    DOT_PREC, UPCAST, TMA, STATS_TMA, SOFTCAP, CHUNK)
            reader = seg
            while reader < stop:
                own = reader == seg
                r0 = tl.where(own, after_diag, tl.load(SEG_START + reader))
                d0 = tl.where(own, after_diag + koff, tl.load(PREFIX_LEN + reader))  # the depth of row r0
                n = tl.where(own, seg_end - after_diag, tl.load(SEG_LEN + reader))
                r_whole = r0 + tl.minimum(tl.maximum(whole_to - d0 + 1, 0), n)
                r_seen = r0 + tl.minimum(tl.maximum(seen_to - d0 + 1, 0), n)
                dk, dv, pk, pv, cnt = _dkdv_win_rows(
                    dk, dv, pk, pv, cnt, k, v, Qh, DOh, LSEh, DELTAh, DQh, descs, r0, r_whole, offs_n, col_ok,
                    offs_d, d_ok, stride_qt, stride_qd, stride_dot, stride_dod, stride_dqt, stride_dqd, qk_scale,
                    sm_scale, d0 - r0, last_q, BLOCK_M, False, EVEN_D, ATOMIC_DQ, DOT_PREC, UPCAST, TMA,
                    STATS_TMA, SOFTCAP, CHUNK)
                dk, dv, pk, pv, cnt = _dkdv_win_rows(
                    dk, dv, pk, pv, cnt, k, v, Qh, DOh, LSEh, DELTAh, DQh, descs, r_whole, r_seen, offs_n, col_ok,
                    offs_d, d_ok, stride_qt, stride_qd, stride_dot, stride_dod, stride_dqt, stride_dqd, qk_scale,
                    sm_scale, d0 - r0, last_q, BLOCK_M, True, EVEN_D, ATOMIC_DQ, DOT_PREC, UPCAST, TMA,
                    STATS_TMA, SOFTCAP, CHUNK)
                # Reached (or the own rows): on to the next segment, its first child if it has one; else past
                # its whole subtree, which lies deeper still.
                reader = tl.where(own | (d0 <= seen_to), reader + 1, tl.load(SUBTREE_NEXT + reader))
        else:
            for j in range(0, n_diag):
                dk, dv = _dkdv_q_block(
                    dk, dv, k, v, Qh, DOh, LSEh, DELTAh, DQh, descs, n0 + j * BLOCK_M, seg_end, offs_n, col_ok, offs_d,
                    d_ok, stride_qt, stride_qd, stride_dot, stride_dod, stride_dqt, stride_dqd, qk_scale, sm_scale,
                    BLOCK_M, True, True, EVEN_D, ATOMIC_DQ, DOT_PREC, UPCAST, TMA, STATS_TMA, SOFTCAP)
            dk, dv = _dkdv_rows(
                dk, dv, k, v, Qh, DOh, LSEh, DELTAh, DQh, descs, after_diag, subtree_end, offs_n, col_ok, offs_d, d_ok,
                stride_qt, stride_qd, stride_dot, stride_dod, stride_dqt, stride_dqd, qk_scale, sm_scale,
                BLOCK_M, EVEN_D, ATOMIC_DQ, DOT_PREC, UPCAST, TMA, STATS_TMA, SOFTCAP, CHUNK)
    if WINDOW:
        if CHUNK != 0:
            dk += pk
            dv += pv

    dk = dk * sm_scale
    dk_ptrs = DK + kv_head.to(tl.int64) * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :] * stride_dkd
    dv_ptrs = DV + kv_head.to(tl.int64) * stride_dvh + offs_n[:, None] * stride_dvt + offs_d[None, :] * stride_dvd
    mask = col_ok[:, None] & d_ok[None, :]
    if HEAD_SPLIT == 1:
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=mask)
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(dk_ptrs, dk, mask=mask, sem="relaxed")
        tl.atomic_add(dv_ptrs, dv, mask=mask, sem="relaxed")
