"""The FlexAttention mask's block tables, built from ``Segments`` with eager torch ops.

    segment_table(segs, T)   -> int32 [4, num_segments + 1] (with the sentinel column)
    block_tables(table, T)   -> the eight BlockMask index tensors + three per-token tables

For each ``BLOCK``-token query block the key/value blocks it needs are found
from the segments that meet the block, never by evaluating a mask over a
``T x T`` grid:

* a kv block that every query row of the block sees completely (inside the
  segment's prefix, or strictly below the rows in their own segment, or in the
  union of both where they touch) is a FULL block: FlexAttention runs it
  without evaluating the mask_mod;
* a kv block that some row sees in part is a partial block, masked by the
  mask_mod (``mask_mod.two_region_mask_mod``), which reads three per-token
  int32 tables (own segment start, prefix start, prefix end) at the query index;
* the last kv block of a stream whose length is not a multiple of ``BLOCK`` is
  never FULL (the kernels mask keys past the end themselves; we do not rely on it).

Assumes: the segments are in stream order and cover the stream ``[0, T)``;
a segment's prefix lies before it. Several groups, ragged response lengths,
segments shorter than a block and a query block meeting any number of
segments are all handled.

Guarantees: pure tensor ops whose sizes come from host ints (T, ``BLOCK``,
the number of segments): no device sync, and under ``torch.compile`` no
specialisation on lengths. Every output is int32 and contiguous; index rows
past their count still hold valid block indices.
"""

from __future__ import annotations

import torch

from ...layout.segments import Segments

__all__ = ["BLOCK", "SENTINEL", "segment_table", "block_tables"]

BLOCK = 128  # BlockMask block size, queries and keys alike
SENTINEL = 1 << 30  # start of the padding segment; beyond any token index


def segment_table(segs: Segments, num_tokens: int) -> torch.Tensor:
    """int32 ``[4, num_segments + 1]``: seg_start, seg_len, prefix_start, prefix_len, plus a sentinel.

    The sentinel column (a segment starting at 2**30, past any stream) keeps the
    table at least two columns wide and contiguous whatever the layout, so the
    traced builder sees no new size-1 or stride specialisation. (A constant,
    not ``num_tokens``: a symbolic pad value would specialise T under compile.)
    """
    table = torch.stack([segs.seg_start, segs.seg_len, segs.prefix_start, segs.prefix_len]).to(torch.int32)
    return torch.nn.functional.pad(table, (0, 1), value=SENTINEL)


def block_tables(table: torch.Tensor, num_tokens: int, block: int = BLOCK) -> tuple[torch.Tensor, ...]:
    """The BlockMask index tensors and the per-token tables of the mask_mod.

    ``table`` is ``segment_table(segs, num_tokens)``.

    Returns ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
    q_num_blocks, q_indices, full_q_num_blocks, full_q_indices, own_start,
    pre_start, pre_end)``: the first eight with shapes ``[1, 1, NB]`` and
    ``[1, 1, NB, NB]`` (int32, NB = ceil(T / block)), the last three int32 ``[T]``.
    Pure tensor ops; every size comes from ``num_tokens``, ``block`` and the
    number of segments, so nothing waits on the device.
    """
    device = table.device
    T = num_tokens
    nseg = table.shape[1]  # segments + the sentinel, which no token belongs to
    NB = (T + block - 1) // block
    t = table.long()
    s = t[0]
    e = s + t[1]  # segment end (exclusive)
    p = t[2]
    pe = p + t[3]  # prefix end (exclusive)

    # Per token: its segment (segments are in stream order and cover the stream).
    tok = torch.arange(T, device=device)
    seg_of = (torch.searchsorted(s, tok, right=True) - 1).clamp_(0, nseg - 1)
    own_start = s[seg_of].int()
    pre_start = p[seg_of].int()
    pre_end = pe[seg_of].int()

    # Per query block: the contiguous run of segments [first, last] it meets.
    blk = torch.arange(NB, device=device)
    q_lo = blk * block
    q_hi = torch.clamp(q_lo + block, max=T) - 1  # last valid row
    first = seg_of[q_lo]
    last = seg_of[q_hi]
    count = last - first + 1
    incl = torch.cumsum(count, 0)
    excl = incl - count

    # (query block, segment) pairs, in block order. Their number is at most
    # NB + nseg - 1; we size for NB + nseg and mark the tail invalid.
    U = NB + nseg
    k = torch.arange(U, device=device)
    pair_blk = torch.searchsorted(incl, k, right=True)  # == NB past the last pair
    valid = pair_blk < NB
    pb = pair_blk.clamp(max=NB - 1)
    j = (first[pb] + k - excl[pb]).clamp_(0, nseg - 1)
    sj, ej, pj, pej = s[j], e[j], p[j], pe[j]
    rows_lo = torch.maximum(sj, q_lo[pb])[:, None]  # first row of segment j in the block
    rows_hi = (torch.minimum(ej, q_hi[pb] + 1) - 1)[:, None]  # last row
    sj, pj, pej = sj[:, None], pj[:, None], pej[:, None]

    k0 = (blk * block)[None, :]  # kv block's first key
    k1 = torch.clamp(k0 + block, max=T) - 1  # and last key
    complete = (k0 + block) <= T
    has_prefix = pej > pj
    # Some row of segment j in the block sees some key of the kv block.
    needed = ((k0 < pej) & (k1 >= pj) & has_prefix) | ((k1 >= sj) & (k0 <= rows_hi))
    # Every row of segment j in the block sees every key of the kv block:
    # inside the prefix, inside [segment start, first row], or inside their
    # union [prefix start, first row] when the prefix ends where the segment starts.
    in_prefix = (k0 >= pj) & (k1 < pej)
    in_own = (k0 >= sj) & (k1 <= rows_lo)
    in_union = (pej == sj) & (k0 >= pj) & (k1 <= rows_lo)
    full = (in_prefix | in_own | in_union) & complete

    row = torch.where(valid, pair_blk, NB)[:, None].expand(U, NB)
    need_count = torch.zeros(NB + 1, NB, dtype=torch.int32, device=device)
    need_count.scatter_add_(0, row, (needed & valid[:, None]).int())
    full_count = torch.zeros(NB + 1, NB, dtype=torch.int32, device=device)
    full_count.scatter_add_(0, row, (full & valid[:, None]).int())
    is_full = full_count[:NB] == count[:, None]
    is_partial = (need_count[:NB] > 0) & ~is_full

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Contiguous: the flex kernels read these tables assuming a unit last
        # stride (an argsort of a transposed matrix keeps the transposed strides).
        d = dense.to(torch.int32).contiguous()
        num = d.sum(-1, dtype=torch.int32)
        idx = torch.argsort(d, dim=-1, descending=True, stable=True).to(torch.int32).contiguous()
        return num[None, None], idx[None, None]

    kv_num, kv_idx = ordered(is_partial)
    fkv_num, fkv_idx = ordered(is_full)
    q_num, q_idx = ordered(is_partial.t())
    fq_num, fq_idx = ordered(is_full.t())
    return kv_num, kv_idx, fkv_num, fkv_idx, q_num, q_idx, fq_num, fq_idx, own_start, pre_start, pre_end
