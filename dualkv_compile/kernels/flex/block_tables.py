"""The FlexAttention mask's block tables, built from ``Segments`` with eager torch ops.

    segment_table(segs, T)                        -> int32 [4, num_segments + 1] (with the sentinel column)
    block_tables(table, T, window=0, chunk=0)     -> the eight BlockMask index tensors + three per-token tables

The forest's mask is ``q sees kv <=> kv <= q < reach[kv]`` (``layout.segments``), so a (query block, kv block)
pair is classified from the least and greatest reach of the kv block's keys, never over a ``T x T`` grid. With
rows ``[q_lo, q_hi]`` and keys ``[k0, k1]``: FULL (no mask_mod) iff ``k1 <= q_lo``, ``min reach > q_hi`` and the
kv block is complete (a stream's ragged last block is never FULL); partial iff not FULL, ``k0 <= q_hi`` and
``max reach > q_lo``: exact, not only a superset. Windows become one *depth limit* per key, ``depth(q) <
limit[kv] = min(depth(kv) + w, (depth(kv) // c + 1) * c)`` (``SENTINEL``: none); FULL then also needs ``max
depth(rows) < min limit(keys)``, and a pair below the diagonal is needed iff some key's visible rows hold a depth
below its limit (why both are exact: docs/design.md, "FlexAttention").

Assumes: ``table`` is ``segment_table`` of ``Segments`` in pre-order covering ``[0, T)``; ``window`` and ``chunk``
are ints >= 0 (0: none). Any forest shape: ragged lengths, empty and one-token segments, a block meeting any
number of segments.
Guarantees: pure tensor ops sized by host ints (T, ``BLOCK``, the number of segments): no device sync and, under
``torch.compile``, no specialisation on lengths; memory O(T + NB^2), O(T * NB) with a window. Every output is
int32 and contiguous; index rows past their count still hold valid block indices.
"""

from __future__ import annotations

import torch

from ...layout.segments import Segments

__all__ = ["BLOCK", "SENTINEL", "segment_table", "block_tables", "kv_block_reach", "token_maps", "depth_limit"]

BLOCK = 128  # BlockMask block size, queries and keys alike
SENTINEL = 1 << 30  # start of the padding segment; beyond any token index and any depth


def segment_table(segs: Segments, num_tokens: int) -> torch.Tensor:
    """int32 ``[4, num_segments + 1]``: seg_start, seg_len, subtree_end, prefix_len, plus a sentinel column.

    The sentinel column (a segment starting at 2**30, past any stream) keeps the
    table at least two columns wide and contiguous whatever the layout, so the
    traced builder sees no new size-1 or stride specialisation. (A constant,
    not ``num_tokens``: a symbolic pad value would specialise T under compile.)
    """
    table = torch.stack([segs.seg_start, segs.seg_len, segs.subtree_end, segs.prefix_len]).to(torch.int32)
    return torch.nn.functional.pad(table, (0, 1), value=SENTINEL)


def token_maps(table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ``[T]`` each: every token's reach (its segment's subtree end) and its depth.

    ``searchsorted(right=True) - 1`` picks the last segment starting at or
    before the token: an empty segment shares its start with the next one and
    comes first in pre-order, so it is never picked; the sentinel never is.
    """
    s = table[0].long()
    tok = torch.arange(num_tokens, device=table.device)
    seg_of = (torch.searchsorted(s, tok, right=True) - 1).clamp_(0, table.shape[1] - 1)
    reach = table[2][seg_of].to(torch.int32).contiguous()
    depth = (table[3].long()[seg_of] + tok - s[seg_of]).to(torch.int32).contiguous()
    return reach, depth


def depth_limit(depth: torch.Tensor, window: int = 0, chunk: int = 0) -> torch.Tensor:
    """int32 ``[T]``: each key's depth limit (the module docstring); ``SENTINEL`` without windows."""
    d = depth.long()
    lim = torch.full_like(d, SENTINEL)
    if window:
        lim = torch.minimum(lim, d + window)
    if chunk:
        lim = torch.minimum(lim, (torch.div(d, chunk, rounding_mode="floor") + 1) * chunk)
    return lim.to(torch.int32).contiguous()


def kv_block_reach(reach: torch.Tensor, num_tokens: int, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[NB]`` each: the least and the greatest reach of each kv block's keys.

    The ragged last block is padded with keys of no effect: reach ``SENTINEL``
    for the least (that block is never FULL anyway), ``0`` for the greatest.
    """
    return _blocks(reach, num_tokens, block, SENTINEL).amin(1), _blocks(reach, num_tokens, block, 0).amax(1)


def _blocks(x: torch.Tensor, num_tokens: int, block: int, pad_value: int) -> torch.Tensor:
    """int64 ``[NB, block]``: a per-token table cut into blocks, the ragged tail padded with ``pad_value``."""
    NB = (num_tokens + block - 1) // block
    return torch.nn.functional.pad(x.long(), (0, NB * block - num_tokens), value=pad_value).view(NB, block)


def _bounds(NB: int, num_tokens: int, block: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    lo = torch.arange(NB, device=device) * block  # first row / key of each block
    return lo, torch.clamp(lo + block, max=num_tokens) - 1  # and the last valid one


def window_needed(reach, depth, limit, num_tokens: int, block: int = BLOCK) -> torch.Tensor:
    """Bool ``[NB, NB]`` (query block, kv block): below the diagonal, whether some pair is seen under the windows.

    Only the strictly lower triangle is meaningful (the module docstring).
    """
    T = num_tokens
    NB = (T + block - 1) // block
    if NB == 0:
        return torch.zeros(0, 0, dtype=torch.bool, device=reach.device)
    q_lo, q_hi = _bounds(NB, T, block, reach.device)
    # the prefix minimum of depth inside each query block (the ragged tail padded high: never read)
    pmin = torch.cummin(_blocks(depth, T, block, SENTINEL), 1).values.flatten()[:T]
    end = torch.minimum(q_hi[None, :], reach.long()[:, None] - 1)  # [T keys, NB query blocks]
    seen = (end >= q_lo[None, :]) & (pmin[end.clamp(min=0)] < limit.long()[:, None])
    pad = NB * block - T
    per_block = torch.nn.functional.pad(seen, (0, 0, 0, pad), value=False).view(NB, block, NB).any(1)  # [kb, qb]
    return per_block.t()


def classify(min_reach, max_reach, num_tokens: int, block: int = BLOCK, windows=None):
    """Bool ``[NB, NB]`` (query block, kv block) each: ``(full, partial)`` (see the module docstring).

    ``windows``: None, or ``(needed, max_depth_q, min_limit_kv)`` of a windowed mask.
    """
    T = num_tokens
    NB = min_reach.shape[0]
    lo, hi = _bounds(NB, T, block, min_reach.device)
    q_lo, q_hi = lo[:, None], hi[:, None]
    k0, k1 = lo[None, :], hi[None, :]
    complete = (k0 + block) <= T
    full = (k1 <= q_lo) & (min_reach[None, :] > q_hi) & complete
    partial = (k0 <= q_hi) & (max_reach[None, :] > q_lo)
    if windows is not None:
        needed, max_depth_q, min_limit_kv = windows
        full = full & (max_depth_q[:, None] < min_limit_kv[None, :])
        partial = partial & (needed | (k0 == q_lo))  # the diagonal: every key sees itself
    return full, partial & ~full


def block_tables(table: torch.Tensor, num_tokens: int, block: int = BLOCK, window: int = 0,
                 chunk: int = 0) -> tuple[torch.Tensor, ...]:
    """The BlockMask index tensors and the per-token tables of the mask_mod.

    ``table`` is ``segment_table(segs, num_tokens)``; ``window`` and ``chunk``
    the windows (0: none).

    Returns ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
    q_num_blocks, q_indices, full_q_num_blocks, full_q_indices, reach, depth,
    limit)``: the first eight with shapes ``[1, 1, NB]`` and ``[1, 1, NB, NB]``
    (int32, NB = ceil(T / block)), the per-token ``reach``, ``depth`` and depth
    ``limit`` int32 ``[T]``. Pure tensor ops; every size comes from
    ``num_tokens``, ``block`` and the number of segments, so nothing waits on
    the device.
    """
    reach, depth = token_maps(table, num_tokens)
    limit = depth_limit(depth, window, chunk)
    windows = None
    if window or chunk:
        windows = (window_needed(reach, depth, limit, num_tokens, block),
                   _blocks(depth, num_tokens, block, -1).amax(1),  # the ragged tail's padding: below any depth
                   _blocks(limit, num_tokens, block, SENTINEL).amin(1))
    full, partial = classify(*kv_block_reach(reach, num_tokens, block), num_tokens, block, windows)

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
    return kv_num, kv_idx, fkv_num, fkv_idx, q_num, q_idx, fq_num, fq_idx, reach, depth, limit
