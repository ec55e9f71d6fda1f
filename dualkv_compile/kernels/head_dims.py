"""Zero-padding of head dims, for kernels that need q, k and v to share one head dim.

MLA (DeepSeek-V3) attends with q/k head dim 192 and v head dim 128. A kernel
that takes one head dim runs it exactly on zero-padded operands: zero columns
of q and k add nothing to the scores, zero columns of v give zero output
columns (sliced off), and in the backward zero columns of dO and O add
nothing to dP or Delta. The cost is the padded copies and the wider tiles.

    common_head_dim(q, v) -> the larger of q's (= k's) and v's head dims
    pad_head_dim(t, D)    -> t with its last dim zero-padded to D (t itself if it has D)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["common_head_dim", "pad_head_dim"]


def common_head_dim(q: torch.Tensor, v: torch.Tensor) -> int:
    return max(q.shape[-1], v.shape[-1])


def pad_head_dim(t: torch.Tensor, D: int) -> torch.Tensor:
    return t if t.shape[-1] == D else F.pad(t, (0, D - t.shape[-1]))
