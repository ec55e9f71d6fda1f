"""``PackedInputs``: the inputs a packed graph takes after the original ones, and their values for a layout.

The rewrite (``pack_graph``) adds one placeholder per field, in field order; the runner passes
``PackedInputs.of(layout)`` in the same order. One definition, so the two cannot disagree.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..layout import SharedPromptLayout, previous_token_index

__all__ = ["PackedInputs"]


class PackedInputs(NamedTuple):
    pack_index: torch.Tensor  # [T]: each packed token's flat index in the [B, S] batch
    col_index: torch.Tensor  # [T]: each packed token's column (for values of the column only)
    unpack_index: torch.Tensor  # [B * S]: the packed token each position reads
    valid: torch.Tensor  # [B * S]: non-padding positions
    prev_index: torch.Tensor  # [T]: each packed token's predecessor (next-token values)
    seg_start: torch.Tensor  # the attention segments (layout.Segments)
    seg_len: torch.Tensor
    parent: torch.Tensor
    prefix_len: torch.Tensor
    subtree_end: torch.Tensor
    max_seg_len: int
    max_prefix_len: int

    @classmethod
    def of(cls, layout: SharedPromptLayout) -> "PackedInputs":
        segs = layout.attention_segments
        return cls(
            layout.pack_index,
            layout.pack_index % layout.seq_len,
            layout.unpack_index,
            layout.valid,
            previous_token_index(segs, layout.num_tokens),
            segs.seg_start,
            segs.seg_len,
            segs.parent,
            segs.prefix_len,
            segs.subtree_end,
            segs.max_seg_len,
            segs.max_prefix_len,
        )


# Fields whose length follows the packed token count or the segment count, which change every step (marked
# dynamic per call so they do not recompile); unpack_index and valid follow B * S, as the outer graph does.
PER_TOKEN_OR_SEGMENT = ("pack_index", "col_index", "prev_index", "seg_start", "seg_len", "parent", "prefix_len", "subtree_end")
