"""The FlexAttention mask's block tables, built from ``Segments`` with eager torch ops.

    segment_table(segs, T)   -> int32 [3, num_segments + 1] (with the sentinel column)
    block_tables(table, T)   -> the eight BlockMask index tensors + the per-token ``reach``

The mask of the prefix forest is ``q sees kv <=> kv <= q < reach[kv]``
(``layout.segments``: ``reach[kv]`` is the subtree end of kv's segment). So a
(query block, kv block) pair is classified from two numbers per kv block, the
least and the greatest reach of its keys, never by evaluating a mask over a
``T x T`` grid. With query rows ``[q_lo, q_hi]`` and keys ``[k0, k1]``:

* FULL (FlexAttention skips the mask_mod) iff every key precedes every row,
  ``k1 <= q_lo``, and every row lies before every key's reach,
  ``min reach > q_hi``; and the kv block is complete: the last kv block of a
  stream whose length is not a multiple of ``BLOCK`` is never FULL (the kernels
  mask keys past the end themselves; we do not rely on it);
* partial (masked by ``mask_mod.tree_mask_mod``) iff not FULL and
  ``k0 <= q_hi`` and ``max reach > q_lo``. This is exact, not only a superset:
  below the diagonal the key of greatest reach is seen by row ``q_lo``; on the
  diagonal every key sees itself.

Assumes: ``table`` is ``segment_table`` of ``Segments`` in pre-order covering
the stream ``[0, T)``. Any forest shape is handled: ragged lengths, empty and
one-token segments, a block meeting any number of segments.

Guarantees: pure tensor ops whose sizes come from host ints (T, ``BLOCK``,
the number of segments): no device sync, and under ``torch.compile`` no
specialisation on lengths; memory O(T + NB^2). Every output is int32 and
contiguous; index rows past their count still hold valid block indices.
"""

from __future__ import annotations

import torch

from ...layout.segments import Segments

__all__ = ["BLOCK", "SENTINEL", "segment_table", "block_tables", "kv_block_reach"]

BLOCK = 128  # BlockMask block size, queries and keys alike
SENTINEL = 1 << 30  # start of the padding segment; beyond any token index


def segment_table(segs: Segments, num_tokens: int) -> torch.Tensor:
    """int32 ``[3, num_segments + 1]``: seg_start, seg_len, subtree_end, plus a sentinel column.

    The sentinel column (a segment starting at 2**30, past any stream) keeps the
    table at least two columns wide and contiguous whatever the layout, so the
    traced builder sees no new size-1 or stride specialisation. (A constant,
    not ``num_tokens``: a symbolic pad value would specialise T under compile.)
    """
    table = torch.stack([segs.seg_start, segs.seg_len, segs.subtree_end]).to(torch.int32)
    return torch.nn.functional.pad(table, (0, 1), value=SENTINEL)


def token_reach_from_table(table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """int32 ``[T]``: each key's reach (its segment's subtree end), found by a search over the starts.

    ``searchsorted(right=True) - 1`` picks the last segment starting at or
    before the token: an empty segment shares its start with the next one and
    comes first in pre-order, so it is never picked; the sentinel never is.
    """
    s = table[0].long()
    tok = torch.arange(num_tokens, device=table.device)
    seg_of = (torch.searchsorted(s, tok, right=True) - 1).clamp_(0, table.shape[1] - 1)
    return table[2][seg_of].to(torch.int32).contiguous()


def kv_block_reach(reach: torch.Tensor, num_tokens: int, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[NB]`` each: the least and the greatest reach of each kv block's keys.

    The ragged last block is padded with keys of no effect: reach ``SENTINEL``
    for the least (that block is never FULL anyway), ``0`` for the greatest.
    """
    NB = (num_tokens + block - 1) // block
    pad = NB * block - num_tokens
    r = reach.long()
    lo = torch.nn.functional.pad(r, (0, pad), value=SENTINEL).view(NB, block).amin(1)
    hi = torch.nn.functional.pad(r, (0, pad), value=0).view(NB, block).amax(1)
    return lo, hi


def classify(min_reach: torch.Tensor, max_reach: torch.Tensor, num_tokens: int, block: int = BLOCK):
    """Bool ``[NB, NB]`` (query block, kv block) each: ``(full, partial)`` (see the module docstring)."""
    T = num_tokens
    NB = min_reach.shape[0]
    lo = torch.arange(NB, device=min_reach.device) * block  # first row / key of each block
    hi = torch.clamp(lo + block, max=T) - 1  # last valid row / key
    q_lo, q_hi = lo[:, None], hi[:, None]
    k0, k1 = lo[None, :], hi[None, :]
    complete = (k0 + block) <= T
    full = (k1 <= q_lo) & (min_reach[None, :] > q_hi) & complete
    partial = (k0 <= q_hi) & (max_reach[None, :] > q_lo) & ~full
    return full, partial


def block_tables(table: torch.Tensor, num_tokens: int, block: int = BLOCK) -> tuple[torch.Tensor, ...]:
    """The BlockMask index tensors and the per-token table of the mask_mod.

    ``table`` is ``segment_table(segs, num_tokens)``.

    Returns ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
    q_num_blocks, q_indices, full_q_num_blocks, full_q_indices, reach)``: the
    first eight with shapes ``[1, 1, NB]`` and ``[1, 1, NB, NB]`` (int32,
    NB = ceil(T / block)), ``reach`` int32 ``[T]``. Pure tensor ops; every size
    comes from ``num_tokens``, ``block`` and the number of segments, so nothing
    waits on the device.
    """
    reach = token_reach_from_table(table, num_tokens)
    full, partial = classify(*kv_block_reach(reach, num_tokens, block), num_tokens, block)

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Contiguous: the flex kernels read these tables assuming a unit last
        # stride (an argsort of a transposed matrix keeps the transposed strides).
        d = dense.to(torch.int32).contiguous()
        num = d.sum(-1, dtype=torch.int32)
        idx = torch.argsort(d, dim=-1, descending=True, stable=True).to(torch.int32).contiguous()
        return num[None, None], idx[None, None]

    kv_num, kv_idx = ordered(partial)
    fkv_num, fkv_idx = ordered(full)
    q_num, q_idx = ordered(partial.t())
    fq_num, fq_idx = ordered(full.t())
    return kv_num, kv_idx, fkv_num, fkv_idx, q_num, q_idx, fq_num, fq_idx, reach
