"""``detect``: the shared-prefix groups of a padded ``[B, S]`` batch, and the index tensors of its packed layout.

Assumes each row's valid tokens are one contiguous run (see ``shared_prompt``);
guarantees at most one device-to-host synchronisation per call, and index
tensors built on the batch's device without a host loop over tokens.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from .shared_prompt import Group, SharedPromptLayout, host_segments

log = logging.getLogger("dualkv_compile")

__all__ = ["detect", "expand_runs"]


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
    (pack_index,) = expand_runs(pack_runs, T, device)
    flat_dst, packed_src = expand_runs(unpack_runs, T + sum(g.shared_len * (len(g.rows) - 1) for g in groups), device)
    unpack_index = torch.zeros(B * S, dtype=torch.long, device=device)
    unpack_index.index_copy_(0, flat_dst, packed_src)
    valid = torch.zeros(B * S, dtype=torch.bool, device=device)
    valid.index_fill_(0, flat_dst, True)  # not valid[flat_dst] = True: that syncs on CUDA

    segs = host_segments(groups)
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


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without synchronising it.

    A plain host-to-CUDA copy from pageable memory waits for the whole stream;
    from pinned memory with ``non_blocking=True`` it is queued like a kernel
    (the caching host allocator keeps the pinned buffer alive until it is done).
    """
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def expand_runs(runs, total: int, device) -> tuple[torch.Tensor, ...]:
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
