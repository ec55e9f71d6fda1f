"""Jitted tile loads and bounds shared by the forward (``fwd.py``) and backward (``bwd.py``, ``bwd_dq.py``) kernels.

``load_tile`` loads one ``[rows, BLOCK_D]`` tile through pointers; ``load_pair`` loads the same rows of two
tensors (k and v in the forward and dQ kernels, q and dO in the dK/dV kernel), through tensor descriptors for full
blocks when the launcher built them, else through ``load_tile``. Compile-time functions: ``acc_dtype`` (the
accumulator dtype: float32, float64 for float64 inputs) and ``key_sum_chunk`` (how many query blocks the dK/dV
kernel sums apart before adding them to a key tile's total; 0: one running sum). ``softcap_tanh`` is the tanh of a
logit softcap from ``exp2`` (docs/design.md, "Triton kernels", says why). ``lowest_depth`` and ``last_reader`` are
``common/window_rule.py``'s window bounds on depths; ``walk_down`` steps the query kernels' windowed ancestor walk one
full block down, ``own_band`` bounds their walk over the tile's own segment.

Assumes
    * ``ptrs`` (and ``A`` / ``B`` with their token and dim strides) address rows of one head; ``row_ok`` marks the
      rows inside the segment and ``d_ok`` the columns below the head dim (``EVEN_D``: no padded columns).
    * With ``TMA``, ``descs`` is ``(A's descriptor, this head's row and column in it, the same three for B, ...)``
      as ``tma.descriptors`` builds them, and the block from ``start`` lies wholly inside the segment (``MASKED``
      false).
Guarantees
    * Masked rows and padded columns load as zero, so they contribute nothing to a product; full blocks load
      unmasked (wide, unpredicated loads).
    * With ``UPCAST`` the tiles come back as float32 (the CPU interpreter's bfloat16 dots are wrong); otherwise in
      the tensor's own dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common.row_statistics import acc_dtype  # noqa: F401  (the accumulators' dtype, the preprocess kernel's too)

LOG2E = tl.constexpr(1.4426950408889634)


@triton.constexpr_function
def key_sum_chunk(dtype):
    """Query blocks per partial sum of a key tile's dK/dV (bwd.py): 16 for float32 inputs, 0 (one running sum) else.

    The dK/dV kernel sums a key tile's gradient over every query block that reads it: for a prompt shared by
    N rows, N rows' worth. One float32 running sum's error grows like that count; summing each run of 16 blocks
    apart and then adding the runs makes it grow like 16 + count / 16 (issue 35, defect 5). bf16/fp16 inputs
    keep one running sum: their rounding of dK/dV dwarfs the difference, and the kernel stays as it was.
    """
    return 16 if dtype == tl.float32 else 0


@triton.jit
def softcap_tanh(s, qk_scale, SOFTCAP: tl.constexpr, POLY: tl.constexpr, OUT: tl.constexpr):
    """``OUT * tanh(scale * s / SOFTCAP)`` for the raw scores ``s`` (``qk_scale = scale * log2(e)``).

    With ``OUT = SOFTCAP * log2(e)`` that is the capped score in the kernels' base-2 units; the
    cap's derivative with respect to the scaled score is ``1 - tanh^2``. Computed as
    ``OUT - 2 OUT / (exp(2x) + 1)``: one exponential and one division, exactly +-OUT where exp2
    overflows or underflows, an absolute error of about one ulp of OUT (far below bfloat16's and
    float16's resolution; in float64, eps). With ``POLY`` (float32 inputs) |x| < 1/4 takes the
    Taylor series to x^9 instead (first dropped term under 1e-8 relative there), so the result
    is accurate to a few ulp relative everywhere.
    """
    t = OUT - (2.0 * OUT) / (tl.math.exp2(s * (qk_scale * (2.0 / SOFTCAP))) + 1.0)
    if POLY:
        x = s * (qk_scale / (SOFTCAP * LOG2E))
        x2 = x * x
        poly = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (-0.05396825396825397
                                                                                        + x2 * 0.021869488536155203))))
        t = tl.where(tl.abs(x) < 0.25, poly * OUT, t)
    return t


@triton.jit
def lowest_depth(d, window, chunk):
    """The lowest key depth a query at depth ``d`` sees (``window_rule.lowest_depth``; none is 2**30, so no branch)."""
    return tl.maximum(d - window + 1, (d // chunk) * chunk)


@triton.jit
def last_reader(d, window, chunk):
    """The deepest query that sees a key at depth ``d`` (``window_rule.last_reader``)."""
    return tl.minimum(d + window - 1, (d // chunk + 1) * chunk - 1)


@triton.jit
def walk_down(WALK, SEG_START, SEG_LEN, PREFIX_LEN, anc, a_start, start_n, BLOCK_N: tl.constexpr):
    """One full block down the windowed ancestor walk: ``(anc, a_start, start_n, koff)`` of the next block.

    Inside an ancestor the blocks go from its last full one down to its first; past that, to the last full
    block of the next ancestor with one (``WALK``'s third column), so the depth of the keys only descends.
    ``koff`` turns the block's key indices into depths. Selects, not branches (``fwd.py`` says why); a -1
    ancestor (the walk is over) reads segment 0, in bounds and unused.
    """
    start_n -= BLOCK_N
    moved = start_n < a_start
    anc = tl.where(moved, tl.maximum(tl.load(WALK + anc * 4 + 2), 0), anc)
    a_start = tl.load(SEG_START + anc)
    start_n = tl.where(moved, a_start + (tl.load(SEG_LEN + anc) // BLOCK_N - 1) * BLOCK_N, start_n)
    return anc, a_start, start_n, tl.load(PREFIX_LEN + anc) - a_start


@triton.jit
def own_band(m0, qoff, seg_start, diag_start, diag_end, window, chunk, BLOCK_N: tl.constexpr):
    """``(first, band_end)``: the own key blocks a query tile (rows ``m0 .. diag_end - 1``) walks under the windows.

    Blocks start at ``seg_start`` plus multiples of ``BLOCK_N``. ``first`` is the block of the first row's lowest
    key (blocks before it no row sees); ``[first, band_end)`` the band, below the last row's lowest key, masked
    per element; ``[band_end, diag_start)`` full blocks every row sees; the diagonal blocks follow. ``qoff`` turns
    a token index of the segment into a depth.
    """
    lo_own = tl.maximum(lowest_depth(m0 + qoff, window, chunk) - qoff, seg_start)
    first = seg_start + ((lo_own - seg_start) // BLOCK_N) * BLOCK_N
    hi_own = tl.maximum(lowest_depth(diag_end - 1 + qoff, window, chunk) - qoff - seg_start, 0)
    return first, tl.maximum(tl.minimum(seg_start + tl.cdiv(hi_own, BLOCK_N) * BLOCK_N, diag_start), first)


@triton.jit
def load_tile(ptrs, row_ok, d_ok, ROW_MASK: tl.constexpr, EVEN_D: tl.constexpr, UPCAST: tl.constexpr):
    # Full tiles load unmasked so the compiler can use wide, unpredicated loads.
    if ROW_MASK:
        if EVEN_D:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    if UPCAST:
        # The CPU interpreter (triton 3.9) multiplies bfloat16 dot operands as raw
        # integers, so under it bf16 tiles are widened to float32 at load.
        x = x.to(tl.float32)
    return x


@triton.jit
def load_pair(A, B, descs, start, rows, row_ok, offs_d, d_ok, stride_at, stride_ad, stride_bt, stride_bd,
              MASKED: tl.constexpr, EVEN_D: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr):
    # The same rows of two tensors (k and v here and in the dQ kernel; q and dO in the dK/dV kernel).
    # descs = (A's descriptor, this head's row and column in it, the same for B, ...). A full block
    # goes through the copy engine when descriptors are given; masked blocks never do.
    if TMA and not MASKED:
        a = descs[0].load([descs[1] + start, descs[2]])
        b = descs[3].load([descs[4] + start, descs[5]])
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
    else:
        a = load_tile(A + rows[:, None] * stride_at + offs_d[None, :] * stride_ad, row_ok, d_ok, MASKED, EVEN_D, UPCAST)
        b = load_tile(B + rows[:, None] * stride_bt + offs_d[None, :] * stride_bd, row_ok, d_ok, MASKED, EVEN_D, UPCAST)
    return a, b
