"""The prefix forest's ``mask_mod``s, for FlexAttention's partial blocks.

    tree_mask_mod(reach)                        -> mask_mod(b, h, q_idx, kv_idx)
    windowed_mask_mod(reach, depth, limit)      -> the same with the windows

Assumes: ``reach``, ``depth`` and ``limit`` are the int32 ``[T]`` per-token
tables of ``block_tables.block_tables`` (each key's reach: the end, exclusive,
of its segment's subtree; each token's depth; each key's depth limit under
the windows), indexed by position.

Guarantees: ``mask_mod(b, h, q, kv)`` is true exactly where query ``q`` sees
key ``kv``, ``kv <= q < reach[kv]``: causally inside q's own segment and fully
in every ancestor segment; the same mask as ``layout.segments.dense_mask``.
The windowed one adds ``depth[q] < limit[kv]``, which on the forest's pairs
is the sliding window and the chunks of ``dense_mask(..., window, chunk)``
(``block_tables``' docstring says why). Batch and head are ignored. The
windows' sizes live in ``limit``, a tensor, so a new window size is new data
for the compiled flex kernels, not a recompile. Elementwise tensor ops and
gathers, so FlexAttention can trace and vectorise them.
"""

from __future__ import annotations

import torch

__all__ = ["tree_mask_mod", "windowed_mask_mod"]


def tree_mask_mod(reach: torch.Tensor):
    def tree(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < reach[kv_idx])

    return tree


def windowed_mask_mod(reach: torch.Tensor, depth: torch.Tensor, limit: torch.Tensor):
    def windowed(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < reach[kv_idx]) & (depth[q_idx] < limit[kv_idx])

    return windowed
