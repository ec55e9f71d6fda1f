"""What every launch of the project's Triton and Gluon kernels shares: its compile options, tiling and limits.

    LAUNCH_OPTIONS                      keyword arguments for ``kernel[grid](...)``
    block_d(head_dim)                   the head dim the kernels tile by: the next power of two, at least 16
    check_launch(q, k, segs, backend)   ``ValueError`` where one launch would pass the kernels' int32 limits

Why the options: Triton 3.9 warns that its default for floating-point contraction (``a * b + c`` as one FMA)
will change to off in Triton 3.10. The kernels were tuned and checked with FMAs (the softmax's
``exp2(s * scale - lse)`` is one per score; docs/benchmarks.md, "Behind the code"), so they ask for
them: they keep the FMAs whatever Triton's default, and no launch warns. From Triton 3.9 on, a user's
``TRITON_FORCE_DISABLE_FP_FUSION=1`` still turns them off (3.6-3.8 have no such switch). Under the CPU
interpreter the option is dropped (it is no argument of the kernels).
Assumes q and k are ``[1, H, T, D]`` (any strides). Guarantees: ``check_launch`` passes only where offsets
inside one head fit in int32 (``T * token_stride < 2**31``) and the tiles fit one grid dimension; host ints only.
"""

from __future__ import annotations

import torch

from ...layout.segments import Segments

__all__ = ["LAUNCH_OPTIONS", "block_d", "check_launch"]

LAUNCH_OPTIONS = {"enable_fp_fusion": True}


def block_d(head_dim: int) -> int:
    """The head dim the kernels tile by: the next power of two, at least 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


def check_launch(q: torch.Tensor, k: torch.Tensor, segs: Segments, backend: str) -> None:
    """``ValueError`` ("<backend> attention: ...") where the kernels would address past int32 within one head
    or launch more tiles than one grid dimension takes."""
    T = q.shape[2]
    for t in (q, k):
        if (T - 1) * max(t.stride(2), 1) + (t.shape[3] - 1) * t.stride(3) >= 2**31:
            raise ValueError(f"{backend} attention: offsets within one head exceed int32; make the tensor contiguous per head")
    if -(-T // 16) + segs.seg_start.numel() > 65535:
        raise ValueError(f"{backend} attention: too many tiles for one launch (T={T})")
