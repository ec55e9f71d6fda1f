"""The sequences of a ``[B, S]`` batch, read to the host in one transfer (docs/design.md, semantics 10).

A sequence is a row's valid run in a padded batch, or one of the sequences
packed into a row: a new one starts wherever the position ids do not continue
(``pos[c] != pos[c - 1] + 1``), as in veRL's remove-padding and TRL's
padding-free layouts. (Unless ``split_at_restarts`` is False: a program whose
attention spans the whole row, causal with no mask, reads the row as one
sequence whatever its positions.)

Assumes: each row's valid tokens (``attention_mask != 0``) are one contiguous
run of columns (left padding, right padding or both, never holes).

Guarantees: ``read_sequences`` validates its arguments (``ValueError`` names
the bad one), does exactly one device-to-host transfer, and returns each
sequence as ``(row, start, end)`` columns with a host tensor of per-token keys:
two tokens may share a packed copy only if their keys are equal, and the key
holds the token id, the position id (when given) and the column (when
``same_columns``: the program reads values of the column).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

__all__ = ["HostBatch", "read_sequences"]


class HostBatch(NamedTuple):
    """A batch on the host: ``keys`` int64 ``[B, S, fields]`` (contiguous, CPU) and its sequences."""

    batch_size: int
    seq_len: int
    keys: torch.Tensor
    sequences: tuple[tuple[int, int, int], ...]  # (row, start column, end column), in row and column order
    read: tuple[torch.Tensor, ...] = ()  # the host copies of read_sequences' ``also_read``, in its order


def _check_2d(name: str, t, shape: Sequence[int]) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape [B, S], got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape [B, S] = {list(shape)}, got {list(t.shape)}")


def read_sequences(
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    *,
    same_columns: bool = True,
    split_at_restarts: bool = True,
    also_read: Sequence[torch.Tensor] = (),
) -> HostBatch:
    """The sequences of a batch and their keys, with one device-to-host transfer (see the module docstring).

    ``also_read``: tensors of integer or boolean values on the batch's device that the caller needs on the host
    too; they ride in the same transfer and come back, as int64 host tensors of their shapes, in ``HostBatch.read``.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        got = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a 2-D tensor [B, S], got {got}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    B, S = input_ids.shape
    if B == 0 or S == 0:
        raise ValueError(f"input_ids must have at least one row and one column, got shape {[B, S]}")
    if attention_mask is not None:
        _check_2d("attention_mask", attention_mask, (B, S))
    if position_ids is not None and (
        not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
        or position_ids.shape[1] != S or position_ids.shape[0] not in (1, B)
    ):
        got = list(position_ids.shape) if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise ValueError(f"position_ids must have shape [B, S] = {[B, S]} or [1, S], got {got}")
    # The one device-to-host transfer: the raw fields (and the riders), everything else is derived on the host,
    # so the device runs a few copies before the sync rather than a dozen small kernels.
    parts = [input_ids, _mask_code(attention_mask), position_ids, *also_read]
    sent = [p for p in parts if p is not None]
    host = torch.cat([p.reshape(-1).long() for p in sent]).cpu()
    pieces = iter(host.split([p.numel() for p in sent]))
    ids = next(pieces).view(B, S)
    code = next(pieces).view(B, S) if attention_mask is not None else None
    pos = next(pieces).view(-1, S).expand(B, S) if position_ids is not None else None
    read = tuple(next(pieces).view(p.shape) for p in also_read)

    if code is None:
        mask = torch.ones(B, S, dtype=torch.bool)
    else:
        if ((code != 0) & (code != 1)).any():
            raise ValueError("attention_mask must hold only 0 and 1")
        mask = code != 0
    cols = torch.arange(S)
    count = mask.sum(1)
    last = torch.where(mask, cols, -1).amax(1)
    first = torch.where(mask, cols, S).amin(1)
    holes = ((last - first + 1) != count) & (count > 0)
    if holes.any():
        bad = holes.nonzero().flatten().tolist()
        raise ValueError(
            f"attention_mask must mark one contiguous run of tokens per row (left and/or right padding); rows {bad} have holes"
        )
    # A sequence starts at a valid column whose left neighbour is padding, or where the positions restart.
    starts = mask.clone()
    if S > 1:
        cont = mask[:, :-1]
        if pos is not None and split_at_restarts:
            cont = cont & (pos[:, 1:] == pos[:, :-1] + 1)
        starts[:, 1:] &= ~cont
    fields = [ids]
    if pos is not None:
        fields.append(pos)
    if same_columns:
        fields.append(cols.expand(B, S))
    keys = torch.stack(fields, -1)
    # Each sequence runs from its start to the next start in its row or the end of the row's valid run.
    ends = count + first.clamp(max=S)
    begin = starts.nonzero().tolist()
    seqs = []
    for i, (b, c) in enumerate(begin):
        nxt = begin[i + 1] if i + 1 < len(begin) else None
        end = nxt[1] if nxt is not None and nxt[0] == b else int(ends[b])
        seqs.append((b, c, end))
    return HostBatch(B, S, keys, tuple(seqs), read)


def _mask_code(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The mask as integers that keep its 0s and 1s and show any other value as something else (a float
    0.5 would truncate to 0 as an integer: it becomes 2)."""
    if attention_mask is None or not (attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex):
        return attention_mask
    nonzero = attention_mask != 0
    return nonzero.long() + (nonzero & (attention_mask != 1)).long()
