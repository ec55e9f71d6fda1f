"""``detect``: the prefix forest of a ``[B, S]`` batch's sequences, and the index tensors of its packed layout.

Assumes each row's valid tokens are one contiguous run (``sequences``);
guarantees one device-to-host transfer per call (the batch's keys, read by
``sequences.read_sequences``; the forest is built on the host by ``forest``),
and index tensors built on the batch's device without a host loop over tokens.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from .forest import build_forest
from .segments import to_device, tree_segments
from .sequences import HostBatch, read_sequences
from .shared_prompt import Node, SequenceSpan, SharedPromptLayout

log = logging.getLogger("dualkv_compile")

__all__ = ["detect", "detect_reading", "expand_runs"]


def detect(
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    *,
    group_size: Optional[int] = None,
    min_shared: int = 1,
    same_columns: bool = True,
    split_at_restarts: bool = True,
    vocab_size: Optional[int] = None,
) -> SharedPromptLayout:
    """The layout of a batch (``detect_reading``, reading nothing else)."""
    return detect_reading(
        input_ids, attention_mask, position_ids, group_size=group_size, min_shared=min_shared,
        same_columns=same_columns, split_at_restarts=split_at_restarts, vocab_size=vocab_size,
    )[0]


def detect_reading(
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    *,
    group_size: Optional[int] = None,
    min_shared: int = 1,
    same_columns: bool = True,
    split_at_restarts: bool = True,
    vocab_size: Optional[int] = None,
    also_read: Sequence[torch.Tensor] = (),
) -> tuple[SharedPromptLayout, tuple[torch.Tensor, ...]]:
    """The prefix forest of a ``[B, S]`` batch's sequences, in any row order, and its packed layout.

    Sequences are the rows' valid runs, split where ``position_ids`` restart
    unless ``split_at_restarts`` is False (``sequences.read_sequences``). Two sequences share a node where their
    token ids, position ids (when given) and, with ``same_columns``, columns
    agree; shared nodes are at least ``min_shared`` tokens (``forest``).
    ``group_size``, when the caller knows the batch is made of groups of that
    many consecutive rows, is verified: each group's rows must share at least
    ``min_shared`` leading tokens, else ``ValueError`` (sharing is still found
    across groups, where it holds). ``vocab_size``, when given, is the number of
    rows of the embedding that reads ``input_ids``: an id outside ``[0, vocab_size)``
    anywhere, padding included, is a ``ValueError`` (the model's embedding raises
    on it; packing would drop a padding position's id unread). Read off the one
    host copy of the batch: no extra transfer. ``also_read``: integer or boolean
    tensors the caller needs on the host, read in the same transfer
    (``read_sequences``) and returned beside the layout, as int64 host tensors.
    """
    B = input_ids.shape[0] if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else None
    if group_size is not None and (not isinstance(group_size, int) or group_size < 1 or (B is not None and B % group_size)):
        raise ValueError(f"group_size must be a positive integer dividing the batch size {B}, got {group_size!r}")
    if not isinstance(min_shared, int) or min_shared < 1:
        raise ValueError(f"min_shared must be a positive integer, got {min_shared!r}")
    batch = read_sequences(
        input_ids, attention_mask, position_ids, same_columns=same_columns, split_at_restarts=split_at_restarts,
        also_read=also_read,
    )
    if vocab_size is not None:
        _check_ids(batch.keys[..., 0], vocab_size)
    nodes, leaf = build_forest(batch, min_shared)
    layout = _build(batch, nodes, leaf, input_ids.device)
    if group_size is not None:
        _check_groups(layout, group_size, min_shared)
    return layout, batch.read


def _check_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """``ValueError`` naming the first id of the host ``[B, S]`` ids outside ``[0, vocab_size)``."""
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if len(bad):
        b, c = bad[0].tolist()
        raise ValueError(
            f"input_ids must hold token ids in [0, {vocab_size}) (the embedding's rows), padding positions included; "
            f"got {int(ids[b, c])} at row {b}, column {c}"
        )


def _check_groups(layout: SharedPromptLayout, group_size: int, min_shared: int) -> None:
    """``ValueError`` unless rows ``[i * group_size, (i + 1) * group_size)`` share ``min_shared`` leading tokens."""
    by_row: dict[int, list[int]] = {}
    for i, s in enumerate(layout.sequences):
        by_row.setdefault(s.row, []).append(i)
    for lo in range(0, layout.batch_size, group_size):
        rows = range(lo, lo + group_size)
        if group_size == 1:
            continue
        paths = [layout.path(by_row[r][0]) if len(by_row.get(r, ())) == 1 else None for r in rows]
        shared = 0
        if all(p is not None for p in paths):
            for nodes in zip(*paths):
                if len(set(nodes)) != 1:
                    break
                shared += layout.nodes[nodes[0]].length
        if shared < min_shared:
            raise ValueError(
                f"group_size={group_size}: rows {lo}..{lo + group_size - 1} share {shared} leading tokens, "
                f"expected at least min_shared={min_shared}"
            )


def _build(batch: HostBatch, forest: list, leaf: list[int], device) -> SharedPromptLayout:
    B, S = batch.batch_size, batch.seq_len
    seqs = batch.sequences
    nodes, offset = [], 0
    for f in forest:  # pre-order: the packed stream is the nodes in this order
        row, start, _ = seqs[f.members[0]]
        nodes.append(Node(f.parent, f.offset, f.length, offset, row * S + start + f.offset, len(f.members)))
        offset += f.length
    T = offset
    spans = tuple(SequenceSpan(r, s, e, leaf[i]) for i, (r, s, e) in enumerate(seqs))

    # Copy runs (flat source, length) in packed order for pack, and
    # (flat destination, packed source, length) for unpack; expanded on device.
    pack_runs = [(n.source, n.length) for n in nodes]
    unpack_runs = []
    for i, s in enumerate(spans):
        n = s.leaf
        while n >= 0:
            node = nodes[n]
            unpack_runs.append((s.row * S + s.start + node.offset, node.packed_start, node.length))
            n = node.parent
    (pack_index,) = expand_runs(pack_runs, T, device)
    # (a zero-length run: with no sequences at all there is no run to give expand_runs its width)
    flat_dst, packed_src = expand_runs(unpack_runs or [(0, 0, 0)], sum(s.length for s in spans), device)
    unpack_index = torch.zeros(B * S, dtype=torch.long, device=device)
    unpack_index.index_copy_(0, flat_dst, packed_src)
    valid = torch.zeros(B * S, dtype=torch.bool, device=device)
    valid.index_fill_(0, flat_dst, True)  # not valid[flat_dst] = True: that syncs on CUDA

    segs = tree_segments([n.length for n in nodes], [n.parent for n in nodes], device)
    return SharedPromptLayout(
        batch_size=B,
        seq_len=S,
        sequences=spans,
        nodes=tuple(nodes),
        num_tokens=T,
        pack_index=pack_index,
        unpack_index=unpack_index,
        valid=valid,
        attention_segments=segs,
    )


def expand_runs(runs, total: int, device) -> tuple[torch.Tensor, ...]:
    """For runs ``(a, b, ..., n)``: the concatenations of ``arange(a, a + n)``, ``arange(b, b + n)``, ...

    Runs are expanded on the device in the order given, so a few hundred
    small host tuples become index tensors of any length without a host loop.
    """
    width = len(runs[0]) - 1 if runs else 1
    runs = [r for r in runs if r[-1] > 0]
    if not runs:
        return tuple(torch.zeros(0, dtype=torch.long, device=device) for _ in range(width))
    t = to_device(torch.tensor(runs, dtype=torch.long), device)
    n = t[:, -1]
    run = torch.repeat_interleave(torch.arange(len(runs), device=device), n, output_size=total)
    within = torch.arange(total, device=device) - (torch.cumsum(n, 0) - n)[run]
    return tuple(t[run, i] + within for i in range(width))
