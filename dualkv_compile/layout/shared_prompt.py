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
from typing import Sequence

import torch

from .segments import Segments, dense_mask

__all__ = ["SharedPromptLayout", "Group", "LayoutStats", "host_segments"]


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
        return host_segments(self.groups)

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


def host_segments(groups: Sequence[Group]) -> list[tuple[int, int, int, int]]:
    segs = []
    for g in groups:
        if g.shared_len:
            segs.append((g.packed_offset, g.shared_len, g.packed_offset, 0))
        for off, rest in zip(g.rest_offsets, g.rest_lens):
            if rest:
                segs.append((off, rest, g.packed_offset, g.shared_len))
    return segs
