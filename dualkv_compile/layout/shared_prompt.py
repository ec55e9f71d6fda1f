"""SharedPromptLayout: how one ``[B, S]`` micro-batch maps onto the packed stream of its prefix forest.

The batch holds *sequences* (a padded row's valid run, or one of several
sequences packed into a row: ``sequences``). Sequences that start with the
same tokens share a prefix, and sharing nests: a system prompt shared by
several groups, each group's prompt, then its responses (docs/design.md,
semantics 10-11). The packed stream holds each node of that prefix forest
once, in pre-order::

    [ system | prompt_0 | resp_0,0 | resp_0,1 | prompt_1 | resp_1,0 | ... ]

Guarantees
    * ``pack`` and ``unpack`` (``layout.pack``) are differentiable index maps:
      ``pack`` reads each node from its first sequence in the batch;
      ``unpack``'s backward sums the gradient of a shared token over every
      sequence that reads it. ``unpack`` writes zeros at padding positions.
    * The attention structure is ``attention_segments`` (``segments.Segments``):
      one segment per node, its parent the node's parent.
"""

from __future__ import annotations

import dataclasses
import torch

from .segments import Segments, dense_mask, to_device

__all__ = ["SharedPromptLayout", "Node", "SequenceSpan", "LayoutStats"]


@dataclasses.dataclass(frozen=True)
class SequenceSpan:
    """One sequence: columns ``[start, end)`` of ``row``; ``leaf`` the node it ends in (``-1``: empty)."""

    row: int
    start: int
    end: int
    leaf: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Node:
    """A node of the prefix forest: tokens ``[offset, offset + length)`` of each of its ``count`` sequences.

    Stored once at packed tokens ``[packed_start, packed_start + length)``, read
    from ``source`` (the flat ``row * S + column`` of its first token in its
    first sequence). ``parent`` is ``-1`` for a root.
    """

    parent: int
    offset: int
    length: int
    packed_start: int
    source: int
    count: int


@dataclasses.dataclass(frozen=True)
class LayoutStats:
    """Token and attention-pair counts of a batch before and after packing."""

    num_rows: int
    num_groups: int  # trees of the forest (roots)
    padded_tokens: int
    tokens_before: int
    tokens_after: int
    attention_pairs_before: int
    attention_pairs_after: int
    num_sequences: int = 0
    depth: int = 0  # nodes on the longest root-to-leaf path

    @property
    def rho(self) -> float:
        """Token reduction: valid tokens of the batch per packed token."""
        return self.tokens_before / max(self.tokens_after, 1)

    @property
    def attention_ratio(self) -> float:
        return self.attention_pairs_before / max(self.attention_pairs_after, 1)

    def __str__(self) -> str:
        return (
            f"{self.num_rows} rows, {self.num_sequences} sequences in {self.num_groups} trees of depth {self.depth}: "
            f"tokens {self.tokens_before} -> {self.tokens_after} (rho {self.rho:.2f}x), "
            f"attention pairs {self.attention_pairs_before} -> {self.attention_pairs_after} "
            f"({self.attention_ratio:.2f}x)"
        )


@dataclasses.dataclass(frozen=True, eq=False)
class SharedPromptLayout:
    """The packed layout of one ``[B, S]`` micro-batch.

    Index tensors (all on the batch's device):
        pack_index    int64 [T]    flat ``b * S + c`` read by each packed token
        unpack_index  int64 [B*S]  packed token read by each position
                                   (0 at padding, masked by ``valid``)
        valid         bool  [B*S]  positions that hold a token
    ``attention_segments``: one segment per node (``segments.Segments``).
    """

    batch_size: int
    seq_len: int
    sequences: tuple[SequenceSpan, ...]
    nodes: tuple[Node, ...]
    num_tokens: int
    pack_index: torch.Tensor
    unpack_index: torch.Tensor
    valid: torch.Tensor
    attention_segments: Segments
    _cache: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def device(self) -> torch.device:
        return self.pack_index.device

    @property
    def num_segments(self) -> int:
        return len(self.nodes)

    @property
    def max_seg_len(self) -> int:
        return self.attention_segments.max_seg_len

    @property
    def max_prefix_len(self) -> int:
        return self.attention_segments.max_prefix_len

    def path(self, seq: int) -> list[int]:
        """The nodes of sequence ``seq``, root first."""
        out, n = [], self.sequences[seq].leaf
        while n >= 0:
            out.append(n)
            n = self.nodes[n].parent
        return out[::-1]

    def depth(self) -> int:
        depth = [0] * len(self.nodes)
        for i, n in enumerate(self.nodes):  # pre-order: parents first
            depth[i] = 1 + (depth[n.parent] if n.parent >= 0 else 0)
        return max(depth, default=0)

    def one_sequence_per_row(self) -> bool:
        """True if every row holds at most one sequence, starting at column 0 (no left padding)."""
        rows = [s.row for s in self.sequences]
        return len(rows) == len(set(rows)) and all(s.start == 0 for s in self.sequences)

    def stats(self) -> LayoutStats:
        lens = [s.length for s in self.sequences]
        prefix = [0] * len(self.nodes)
        after = pairs_after = 0
        for i, n in enumerate(self.nodes):
            prefix[i] = (prefix[n.parent] + self.nodes[n.parent].length) if n.parent >= 0 else 0
            after += n.length
            pairs_after += n.length * prefix[i] + n.length * (n.length + 1) // 2
        return LayoutStats(
            num_rows=self.batch_size,
            num_groups=sum(1 for n in self.nodes if n.parent < 0),
            padded_tokens=self.batch_size * self.seq_len,
            tokens_before=sum(lens),
            tokens_after=after,
            attention_pairs_before=sum(n * (n + 1) // 2 for n in lens),
            attention_pairs_after=pairs_after,
            num_sequences=len(self.sequences),
            depth=self.depth(),
        )

    def segments(self) -> list[tuple[int, int, int, int, int]]:
        """``(seg_start, seg_len, parent, prefix_len, subtree_end)`` per segment, on the host."""
        segs = self.attention_segments
        cols = [segs.seg_start, segs.seg_len, segs.parent, segs.prefix_len, segs.subtree_end]
        return [tuple(r) for r in torch.stack(cols, 1).tolist()]

    def copy_runs(self) -> list[tuple[int, int, int]]:
        """``(flat position, flat position of the copy packing keeps, length)`` for every dropped copy of a node."""
        runs = []
        S = self.seq_len
        for i, s in enumerate(self.sequences):
            for n in self.path(i):
                node = self.nodes[n]
                dst = s.row * S + s.start + node.offset
                if dst != node.source:
                    runs.append((dst, node.source, node.length))
        return runs

    def sequence_ids(self) -> torch.Tensor:
        """int64 ``[B * S]``: the sequence holding each position, ``-1`` at padding (on the layout's device)."""
        if "sequence_ids" not in self._cache:
            self._cache["sequence_ids"] = to_device(self.sequence_ids_on_host(), self.device)
        return self._cache["sequence_ids"]

    def sequence_ids_on_host(self) -> torch.Tensor:
        """``sequence_ids`` as a host tensor, built from the spans without reading the device (``valid`` is
        ``sequence_ids_on_host() >= 0``)."""
        if "sequence_ids_host" not in self._cache:
            ids = torch.full((self.batch_size * self.seq_len,), -1, dtype=torch.long)
            for i, s in enumerate(self.sequences):
                ids[s.row * self.seq_len + s.start : s.row * self.seq_len + s.end] = i
            self._cache["sequence_ids_host"] = ids
        return self._cache["sequence_ids_host"]

    def token_multiplicity(self) -> torch.Tensor:
        """int64 ``[T]``: how many sequences each packed token stands for (docs/design.md, semantics 12)."""
        if "multiplicity" not in self._cache:
            counts = torch.tensor([n.count for n in self.nodes], dtype=torch.long)
            lens = torch.tensor([n.length for n in self.nodes], dtype=torch.long)
            self._cache["multiplicity"] = to_device(counts.repeat_interleave(lens), self.device)
        return self._cache["multiplicity"]

    def dense_mask(self) -> torch.Tensor:
        """The ``[T, T]`` boolean attention mask of the packed stream (for references and tests)."""
        return dense_mask(self.attention_segments, self.num_tokens)

    def __repr__(self) -> str:
        return (
            f"SharedPromptLayout(B={self.batch_size}, S={self.seq_len}, T={self.num_tokens}, "
            f"sequences={len(self.sequences)}, nodes={len(self.nodes)}, depth={self.depth()})"
        )

