"""The prefix forest's ``mask_mod``, for FlexAttention's partial blocks.

    tree_mask_mod(reach) -> mask_mod(b, h, q_idx, kv_idx)

Assumes: ``reach`` is the int32 ``[T]`` per-token table of
``block_tables.block_tables`` (each key's reach: the end, exclusive, of its
segment's subtree), indexed by key position.

Guarantees: ``mask_mod(b, h, q, kv)`` is true exactly where query ``q`` sees
key ``kv``, ``kv <= q < reach[kv]``: causally inside q's own segment and fully
in every ancestor segment; the same mask as ``layout.segments.dense_mask``.
Batch and head are ignored. Elementwise tensor ops and one gather, so
FlexAttention can trace and vectorise it.
"""

from __future__ import annotations

import torch

__all__ = ["tree_mask_mod"]


def tree_mask_mod(reach: torch.Tensor):
    def tree(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < reach[kv_idx])

    return tree
