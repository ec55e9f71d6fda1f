"""SharedPromptLayout: how one padded micro-batch maps onto the packed stream.

A GRPO-style micro-batch is a padded ``[B, S]`` batch whose rows come in
groups: consecutive rows that start with the same tokens (the prompt, and
possibly the first tokens of the responses). The packed stream holds, group
after group, the shared prefix once and then each row's remaining tokens::

    [ shared_0 | rest_0,0 | rest_0,1 | ... | shared_1 | rest_1,0 | ... ]

Assumptions
    * Each row's valid tokens (``attention_mask == 1``) are one contiguous run
      of columns: left padding, right padding or both, never holes.
    * Two rows share column ``c`` when their masks agree there and, where the
      column is valid, their token ids and position ids agree too. A group's
      shared prefix is the longest run of valid columns, starting at the rows'
      common first valid column, on which every row of the group agrees.

Guarantees
    * ``detect`` does at most one device-to-host synchronisation.
    * ``pack`` and ``unpack`` are differentiable index maps: ``pack`` reads the
      shared prefix from the group's first row; ``unpack``'s backward sums the
      gradient of a shared token over every row that reads it. ``unpack``
      writes zeros at padding positions.
    * The attention structure is described by *segments*: a segment is a run
      of packed query tokens that attend causally to themselves and fully to
      one *prefix* run of packed tokens (empty for the shared part itself).
      That is all the attention kernels need to know.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple, Optional, Sequence

import torch

log = logging.getLogger("dualkv_compile")

__all__ = ["SharedPromptLayout", "Segments", "Group", "LayoutStats", "detect", "pack", "unpack", "dense_mask", "previous_token_index", "gather_valid"]


class Segments(NamedTuple):
    """The attention structure of a packed stream, as kernels take it.

    Segment ``i`` is the packed query tokens ``[seg_start[i], seg_start[i] + seg_len[i])``;
    each of them sees the packed tokens ``[prefix_start[i], prefix_start[i] + prefix_len[i])``
    and its own segment's tokens up to and including itself. Every packed
    token belongs to exactly one segment, and segments are in stream order.
    Tensors are int32 on the stream's device; the maxima are host ints, so
    kernels can size their grids without a sync.
    """

    seg_start: torch.Tensor
    seg_len: torch.Tensor
    prefix_start: torch.Tensor
    prefix_len: torch.Tensor
    max_seg_len: int
    max_prefix_len: int


@dataclasses.dataclass(frozen=True)
class Group:
    """One group of rows that share a prefix.

    ``rows`` are consecutive batch rows; every row has its valid tokens in
    columns ``[starts[i], ends[i])``; the first ``shared_len`` of them are the
    shared prefix, stored once at ``packed_offset``; row ``rows[i]``'s other
    tokens follow at ``rest_offsets[i]``.
    """

    rows: range
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    shared_len: int
    packed_offset: int
    rest_offsets: tuple[int, ...]

    @property
    def rest_lens(self) -> tuple[int, ...]:
        return tuple(e - s - self.shared_len for s, e in zip(self.starts, self.ends))


@dataclasses.dataclass(frozen=True)
class LayoutStats:
    """Token and attention-pair counts of a batch before and after packing."""

    num_rows: int
    num_groups: int
    padded_tokens: int
    tokens_before: int
    tokens_after: int
    attention_pairs_before: int
    attention_pairs_after: int

    @property
    def rho(self) -> float:
        """Token reduction: valid tokens of the padded batch per packed token."""
        return self.tokens_before / max(self.tokens_after, 1)

    @property
    def attention_ratio(self) -> float:
        return self.attention_pairs_before / max(self.attention_pairs_after, 1)

    def __str__(self) -> str:
        return (
            f"{self.num_rows} rows in {self.num_groups} groups: "
            f"tokens {self.tokens_before} -> {self.tokens_after} (rho {self.rho:.2f}x), "
            f"attention pairs {self.attention_pairs_before} -> {self.attention_pairs_after} "
            f"({self.attention_ratio:.2f}x)"
        )


@dataclasses.dataclass(frozen=True, eq=False)
class SharedPromptLayout:
    """The packed layout of one ``[B, S]`` micro-batch.

    Index tensors (all on the batch's device):
        pack_index    int64 [T]    flat ``b * S + c`` read by each packed token
        unpack_index  int64 [B*S]  packed token read by each padded position
                                   (0 at padding, masked by ``valid``)
        valid         bool  [B*S]  padded positions that hold a token
    Segments (int32 [num_segments], on the batch's device):
        seg_start, seg_len         the segment's own packed tokens (causal)
        prefix_start, prefix_len   the packed tokens it sees in full
    """

    batch_size: int
    seq_len: int
    groups: tuple[Group, ...]
    num_tokens: int
    pack_index: torch.Tensor
    unpack_index: torch.Tensor
    valid: torch.Tensor
    seg_start: torch.Tensor
    seg_len: torch.Tensor
    prefix_start: torch.Tensor
    prefix_len: torch.Tensor
    max_seg_len: int
    max_prefix_len: int

    @property
    def device(self) -> torch.device:
        return self.pack_index.device

    @property
    def num_segments(self) -> int:
        return int(self.seg_start.numel())

    def segments(self) -> list[tuple[int, int, int, int]]:
        """``(seg_start, seg_len, prefix_start, prefix_len)`` per segment, on the host."""
        return _host_segments(self.groups)

    def stats(self) -> LayoutStats:
        before = after = pairs_before = pairs_after = 0
        for g in self.groups:
            lens = [e - s for s, e in zip(g.starts, g.ends)]
            before += sum(lens)
            pairs_before += sum(n * (n + 1) // 2 for n in lens)
            L = g.shared_len
            after += L + sum(g.rest_lens)
            pairs_after += L * (L + 1) // 2
            pairs_after += sum(L * r + r * (r + 1) // 2 for r in g.rest_lens)
        return LayoutStats(
            num_rows=self.batch_size,
            num_groups=len(self.groups),
            padded_tokens=self.batch_size * self.seq_len,
            tokens_before=before,
            tokens_after=after,
            attention_pairs_before=pairs_before,
            attention_pairs_after=pairs_after,
        )

    @property
    def attention_segments(self) -> Segments:
        return Segments(
            self.seg_start, self.seg_len, self.prefix_start, self.prefix_len, self.max_seg_len, self.max_prefix_len
        )

    def dense_mask(self) -> torch.Tensor:
        """The ``[T, T]`` boolean attention mask of the packed stream (for references and tests)."""
        return dense_mask(self.attention_segments, self.num_tokens)

    def __repr__(self) -> str:
        return f"SharedPromptLayout(B={self.batch_size}, S={self.seq_len}, T={self.num_tokens}, groups={len(self.groups)})"


def segment_ids(segs: Segments, num_tokens: int) -> torch.Tensor:
    """int64 [T]: the segment each packed token belongs to."""
    return torch.repeat_interleave(
        torch.arange(segs.seg_len.numel(), device=segs.seg_len.device),
        segs.seg_len.long(),
        output_size=num_tokens,
    )


def dense_mask(segs: Segments, num_tokens: int) -> torch.Tensor:
    """``[T, T]`` bool: ``mask[q, kv]`` is True where packed query q attends to packed key kv."""
    seg = segment_ids(segs, num_tokens)
    q = torch.arange(num_tokens, device=seg.device)
    start = segs.seg_start.long()[seg]
    pstart, plen = segs.prefix_start.long()[seg], segs.prefix_len.long()[seg]
    kv = q[None, :]
    own = (kv >= start[:, None]) & (kv <= q[:, None])
    prefix = (kv >= pstart[:, None]) & (kv < (pstart + plen)[:, None])
    return own | prefix


def previous_token_index(segs: Segments, num_tokens: int) -> torch.Tensor:
    """int64 [T]: for each packed token, the packed token before it in its rows.

    Inside a segment that is ``t - 1``; for the first token of a response it
    is the last token of its group's shared prefix (read by every row of the
    group: DESIGN.md, semantics 5); the first token of a shared prefix has no
    predecessor and maps to itself.
    """
    seg = segment_ids(segs, num_tokens)
    t = torch.arange(num_tokens, device=seg.device)
    first = segs.seg_start.long()[seg] == t
    plen = segs.prefix_len.long()[seg]
    before_prefix_end = segs.prefix_start.long()[seg] + plen - 1
    return torch.where(first, torch.where(plen > 0, before_prefix_end, t), t - 1)


# --------------------------------------------------------------------------- detection


def _check_2d(name: str, t: torch.Tensor, shape: Sequence[int]) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape [B, S], got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape [B, S] = {list(shape)}, got {list(t.shape)}")


def detect(
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    *,
    group_size: Optional[int] = None,
    min_shared: int = 1,
) -> SharedPromptLayout:
    """Find the shared-prefix groups of a padded ``[B, S]`` batch.

    Without ``group_size`` the batch is split into runs of consecutive rows so
    that the number of tokens saved, sum over groups of
    ``(rows - 1) * shared_len``, is largest, counting only groups whose shared
    prefix is at least ``min_shared`` tokens. With ``group_size`` the groups
    are rows ``[i * group_size, (i + 1) * group_size)`` and each must share at
    least ``min_shared`` tokens, else ``ValueError``.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        got = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a 2-D tensor [B, S], got {got}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    B, S = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        mask = torch.ones(B, S, dtype=torch.bool, device=device)
        mask_bad = torch.zeros((), dtype=torch.bool, device=device)
    else:
        _check_2d("attention_mask", attention_mask, (B, S))
        mask_bad = ((attention_mask != 0) & (attention_mask != 1)).any()
        mask = attention_mask != 0
    if position_ids is None:
        pos = None
    else:
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[1] != S or position_ids.shape[0] not in (1, B):
            got = list(position_ids.shape) if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
            raise ValueError(f"position_ids must have shape [B, S] = {[B, S]} or [1, S], got {got}")
        pos = position_ids.expand(B, S)
    if group_size is not None and (not isinstance(group_size, int) or group_size < 1 or B % group_size):
        raise ValueError(f"group_size must be a positive integer dividing the batch size {B}, got {group_size!r}")
    if not isinstance(min_shared, int) or min_shared < 1:
        raise ValueError(f"min_shared must be a positive integer, got {min_shared!r}")
    if B == 0 or S == 0:
        raise ValueError(f"input_ids must have at least one row and one column, got shape {[B, S]}")

    cols = torch.arange(S, device=device)
    count = mask.sum(1)
    start = torch.where(mask, cols, S).amin(1)
    last = torch.where(mask, cols, -1).amax(1)
    holes = ((last - start + 1) != count) & (count > 0)
    start = torch.where(count > 0, start, 0)
    end = start + count

    if B > 1:
        agree = mask[1:] == mask[:-1]
        same = input_ids[1:] == input_ids[:-1]
        if pos is not None:
            same &= pos[1:] == pos[:-1]
        agree &= ~mask[1:] | same
        first_diff = torch.where(~agree, cols, S).amin(1)
        lcp = (torch.minimum(torch.minimum(first_diff, end[1:]), end[:-1]) - start[1:]).clamp(min=0)
    else:
        lcp = start.new_zeros(0)

    # The one device-to-host sync of this function.
    host = torch.cat([start, end, lcp, torch.stack([mask_bad.long(), holes.any().long()])]).tolist()
    starts, ends, lcps = host[:B], host[B : 2 * B], host[2 * B : 3 * B - 1]
    if host[-2]:
        raise ValueError("attention_mask must hold only 0 and 1")
    if host[-1]:
        bad = holes.nonzero().flatten().tolist()
        raise ValueError(
            f"attention_mask must mark one contiguous run of tokens per row (left and/or right padding); rows {bad} have holes"
        )

    if group_size is not None:
        bounds = [(i, i + group_size) for i in range(0, B, group_size)]
        for lo, hi in bounds:
            if hi - lo > 1 and min(lcps[lo : hi - 1]) < min_shared:
                raise ValueError(
                    f"group_size={group_size}: rows {lo}..{hi - 1} share {min(lcps[lo:hi - 1])} leading tokens, "
                    f"expected at least min_shared={min_shared}"
                )
    else:
        bounds = _best_groups(lcps, B, min_shared)

    return _build(B, S, device, starts, ends, lcps, bounds)


def _best_groups(lcps: list[int], B: int, min_shared: int) -> list[tuple[int, int]]:
    """Split rows 0..B-1 into runs maximising the tokens saved, sum of (n-1) * shared."""
    best = [0] * (B + 1)
    choice = [0] * (B + 1)
    for j in range(1, B + 1):
        best[j], choice[j] = best[j - 1], j - 1  # row j-1 alone
        shared = None
        for i in range(j - 2, -1, -1):  # group rows i..j-1
            shared = lcps[i] if shared is None else min(shared, lcps[i])
            if shared < min_shared:
                break
            gain = best[i] + (j - 1 - i) * shared
            if gain > best[j]:
                best[j], choice[j] = gain, i
    bounds = []
    j = B
    while j > 0:
        bounds.append((choice[j], j))
        j = choice[j]
    return bounds[::-1]


def _build(B, S, device, starts, ends, lcps, bounds) -> SharedPromptLayout:
    groups = []
    offset = 0
    for lo, hi in bounds:
        if hi - lo == 1:
            shared = ends[lo] - starts[lo]
        else:
            shared = min(lcps[lo : hi - 1])
        rest_offsets = []
        o = offset + shared
        for b in range(lo, hi):
            rest_offsets.append(o)
            o += ends[b] - starts[b] - shared
        groups.append(
            Group(range(lo, hi), tuple(starts[lo:hi]), tuple(ends[lo:hi]), shared, offset, tuple(rest_offsets))
        )
        offset = o
    T = offset

    # Copy runs (flat source, length) in packed order for pack, and
    # (flat destination, packed source, length) for unpack; expanded on device.
    pack_runs, unpack_runs = [], []
    for g in groups:
        b0 = g.rows[0]
        pack_runs.append((b0 * S + g.starts[0], g.shared_len))
        for i, b in enumerate(g.rows):
            base = b * S + g.starts[i]
            rest = g.ends[i] - g.starts[i] - g.shared_len
            pack_runs.append((base + g.shared_len, rest))
            unpack_runs.append((base, g.packed_offset, g.shared_len))
            unpack_runs.append((base + g.shared_len, g.rest_offsets[i], rest))
    (pack_index,) = _expand_runs(pack_runs, T, device)
    flat_dst, packed_src = _expand_runs(unpack_runs, T + sum(g.shared_len * (len(g.rows) - 1) for g in groups), device)
    unpack_index = torch.zeros(B * S, dtype=torch.long, device=device)
    unpack_index.index_copy_(0, flat_dst, packed_src)
    valid = torch.zeros(B * S, dtype=torch.bool, device=device)
    valid.index_fill_(0, flat_dst, True)  # not valid[flat_dst] = True: that syncs on CUDA

    segs = _host_segments(groups)
    seg = _to_device(torch.tensor(segs, dtype=torch.int32).reshape(-1, 4), device)
    return SharedPromptLayout(
        batch_size=B,
        seq_len=S,
        groups=tuple(groups),
        num_tokens=T,
        pack_index=pack_index,
        unpack_index=unpack_index,
        valid=valid,
        # clone, not .contiguous(): a column of a [1, 4] table is already contiguous, so
        # .contiguous() would return views sharing one storage (CUDA kernels refuse overlap).
        seg_start=seg[:, 0].clone(memory_format=torch.contiguous_format),
        seg_len=seg[:, 1].clone(memory_format=torch.contiguous_format),
        prefix_start=seg[:, 2].clone(memory_format=torch.contiguous_format),
        prefix_len=seg[:, 3].clone(memory_format=torch.contiguous_format),
        max_seg_len=max((s[1] for s in segs), default=0),
        max_prefix_len=max((s[3] for s in segs), default=0),
    )


def _host_segments(groups: Sequence[Group]) -> list[tuple[int, int, int, int]]:
    segs = []
    for g in groups:
        if g.shared_len:
            segs.append((g.packed_offset, g.shared_len, g.packed_offset, 0))
        for off, rest in zip(g.rest_offsets, g.rest_lens):
            if rest:
                segs.append((off, rest, g.packed_offset, g.shared_len))
    return segs


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without synchronising it.

    A plain host-to-CUDA copy from pageable memory waits for the whole stream;
    from pinned memory with ``non_blocking=True`` it is queued like a kernel
    (the caching host allocator keeps the pinned buffer alive until it is done).
    """
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _expand_runs(runs, total: int, device) -> tuple[torch.Tensor, ...]:
    """For runs ``(a, b, ..., n)``: the concatenations of ``arange(a, a + n)``, ``arange(b, b + n)``, ...

    Runs are expanded on the device in the order given, so a few hundred
    small host tuples become index tensors of any length without a host loop.
    """
    width = len(runs[0]) - 1 if runs else 1
    runs = [r for r in runs if r[-1] > 0]
    if not runs:
        return tuple(torch.zeros(0, dtype=torch.long, device=device) for _ in range(width))
    t = _to_device(torch.tensor(runs, dtype=torch.long), device)
    n = t[:, -1]
    run = torch.repeat_interleave(torch.arange(len(runs), device=device), n, output_size=total)
    within = torch.arange(total, device=device) - (torch.cumsum(n, 0) - n)[run]
    return tuple(t[run, i] + within for i in range(width))


# --------------------------------------------------------------------------- pack / unpack


def pack(x: torch.Tensor, layout: SharedPromptLayout) -> torch.Tensor:
    """``[B, S, *rest]`` -> ``[T, *rest]``: each group's shared prefix once, then each row's other tokens."""
    B, S = layout.batch_size, layout.seq_len
    if x.dim() < 2 or x.shape[0] != B or x.shape[1] != S:
        raise ValueError(f"x must have shape [B, S, ...] with B={B}, S={S}, got {list(x.shape)}")
    return x.reshape(B * S, *x.shape[2:]).index_select(0, layout.pack_index)


def unpack(x: torch.Tensor, layout: SharedPromptLayout) -> torch.Tensor:
    """``[T, *rest]`` -> ``[B, S, *rest]``; zeros at padding; gradients of shared tokens summed over rows."""
    T = layout.num_tokens
    if x.dim() < 1 or x.shape[0] != T:
        raise ValueError(f"x must have shape [T, ...] with T={T}, got {list(x.shape)}")
    if T == 0:  # every row empty: index_select cannot read from an empty axis
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    out = gather_valid(x, layout.unpack_index, layout.valid)
    return out.reshape(layout.batch_size, layout.seq_len, *x.shape[1:])


def gather_valid(x: torch.Tensor, index: torch.Tensor, keep: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``x.index_select(dim, index)`` with zeros where ``keep`` is False (padding positions).

    Differentiable: the backward sums the gradients of entries read more than
    once (a shared token read by every row of its group).
    """
    y = x.index_select(dim, index)
    shape = [1] * y.dim()
    shape[dim] = -1
    return torch.where(keep.view(shape), y, y.new_zeros(()))
