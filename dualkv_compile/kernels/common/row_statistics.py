"""The attention backward's preprocess kernel, shared by the Triton and Gluon backwards: the row statistics.

    row_statistics(out, dout, lse, pack)  -> (delta [1, Hq, T], stats [Hq * T, 4] or None)
    bwd_preprocess_kernel                 the jitted kernel behind it
    acc_dtype(dtype)                      the accumulators' dtype, a compile-time function (the Triton kernels' too)

Delta = rowsum(dO * O) per query row and head; with ``pack`` also (lse in base 2, 0, Delta, 0) per row in
16-byte rows, which the dK/dV kernels read with one bulk copy per block (Triton's ``STATS_TMA``, Gluon's always).
Assumes ``out`` and ``dout`` ``[1, Hq, T, D]`` (any strides) and ``lse`` ``[1, Hq, T]``, contiguous, in the
accumulation dtype. Guarantees: every valid row written, Delta in lse's dtype; the arguments after T get no value
specialisation, so new lengths reuse the kernel. Imported where it launches (it defines a Triton kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import LAUNCH_OPTIONS, block_d

__all__ = ["row_statistics", "bwd_preprocess_kernel", "acc_dtype"]

LOG2E = tl.constexpr(1.4426950408889634)


@triton.constexpr_function
def acc_dtype(dtype):
    """The accumulators' dtype for inputs of ``dtype``: float64 for float64, else float32 (bf16, fp16, fp32)."""
    return tl.float64 if dtype == tl.float64 else tl.float32


# As in fwd.py: arguments that follow T get no value specialisation, so new lengths reuse the kernels.
@triton.jit(do_not_specialize=["T", "stride_deltah"])
def bwd_preprocess_kernel(
    O, DO, DELTA, LSE, ROW_STATS, T,
    stride_oh, stride_ot, stride_od,
    stride_dh, stride_dt, stride_dd,
    stride_deltah,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, PACK_STATS: tl.constexpr,
):
    ACC: tl.constexpr = acc_dtype(O.dtype.element_ty)
    head = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows < T)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(O + head.to(tl.int64) * stride_oh + rows[:, None] * stride_ot + offs_d[None, :] * stride_od,
                mask=mask, other=0.0)
    do = tl.load(DO + head.to(tl.int64) * stride_dh + rows[:, None] * stride_dt + offs_d[None, :] * stride_dd,
                 mask=mask, other=0.0)
    delta = tl.sum(o.to(ACC) * do.to(ACC), 1)
    tl.store(DELTA + head.to(tl.int64) * stride_deltah + rows, delta, mask=rows < T)
    if PACK_STATS:
        # LSE is laid out like DELTA. Rows of 16 bytes (lse in base 2, 0, Delta, 0: join interleaves)
        # for the dK/dV kernel's copy engine.
        lse2 = tl.load(LSE + head.to(tl.int64) * stride_deltah + rows, mask=rows < T, other=0.0) * LOG2E
        zero = tl.zeros([BLOCK_M], ACC)
        packed = tl.reshape(tl.join(tl.join(lse2, delta), tl.join(zero, zero)), [BLOCK_M, 4])
        ptrs = ROW_STATS + (head.to(tl.int64) * T + rows)[:, None] * 4 + tl.arange(0, 4)[None, :]
        tl.store(ptrs, packed, mask=(rows < T)[:, None])


def row_statistics(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, pack: bool):
    """``(delta [1, Hq, T], stats)`` by the preprocess kernel: Delta = rowsum(dO * O) in lse's dtype and,
    with ``pack``, the dK/dV kernels' packed copy ``stats [Hq * T, 4]``: (lse in base 2, 0, Delta, 0) per
    head and token (else None). ``lse`` is ``[1, Hq, T]``, contiguous, in the accumulation dtype."""
    _, Hq, T, D = out.shape
    BD = block_d(D)
    delta = torch.empty((1, Hq, T), dtype=lse.dtype, device=out.device)
    stats = torch.empty((Hq * T, 4), dtype=lse.dtype, device=out.device) if pack else None
    if T and Hq:
        pre_block = 64 if BD <= 128 else 32
        bwd_preprocess_kernel[(Hq, -(-T // pre_block))](
            out, dout, delta, lse, stats, T, out.stride(1), out.stride(2), out.stride(3),
            dout.stride(1), dout.stride(2), dout.stride(3), delta.stride(1),
            HEAD_DIM=D, BLOCK_D=BD, BLOCK_M=pre_block, PACK_STATS=pack, **LAUNCH_OPTIONS,
        )
    return delta, stats
