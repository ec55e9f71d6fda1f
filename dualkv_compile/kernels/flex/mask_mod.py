"""The two-region ``mask_mod`` of the packed stream, for FlexAttention's partial blocks.

    two_region_mask_mod(own_start, pre_start, pre_end) -> mask_mod(b, h, q_idx, kv_idx)

Assumes: the three int32 ``[T]`` per-token tables of
``block_tables.block_tables`` (each query token's own segment start, prefix
start and prefix end, exclusive), indexed by query position.

Guarantees: ``mask_mod(b, h, q, kv)`` is true exactly where query ``q`` sees key
``kv``: causally inside its own segment (``own_start[q] <= kv <= q``) or
anywhere in its prefix (``pre_start[q] <= kv < pre_end[q]``); the same mask
as ``layout.dense_mask``. Batch and head are ignored. Elementwise tensor ops
only, so FlexAttention can trace and vectorise it.
"""

from __future__ import annotations

import torch

__all__ = ["two_region_mask_mod"]


def two_region_mask_mod(own_start: torch.Tensor, pre_start: torch.Tensor, pre_end: torch.Tensor):
    def two_region(b, h, q_idx, kv_idx):
        own = (kv_idx <= q_idx) & (kv_idx >= own_start[q_idx])
        prefix = (kv_idx >= pre_start[q_idx]) & (kv_idx < pre_end[q_idx])
        return own | prefix

    return two_region
