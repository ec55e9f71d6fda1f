"""The gated delta rule on the packed forest through a varlen kernel: one launch per depth level.

Assumes ``kernel`` has the contract of flash-linear-attention's ``chunk_gated_delta_rule`` over variable-length
sequences: ``kernel(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=...,
cu_seqlens=cu)`` with q, k ``[1, N, Hk, Dk]``, v ``[1, N, Hv, Dv]`` (Hv a multiple of Hk, each q/k head serving
consecutive value heads), g and beta ``[1, N, Hv]`` (g ``[1, N, Hv, Dk]`` for fla's ``chunk_kda``), ``cu`` int64 ``[n + 1]`` (every sequence non-empty), ``h0``
``[n, Hv, Dk, Dv]`` or None (zeros), returning ``(o [1, N, Hv, Dv], final states [n, Hv, Dk, Dv])``,
differentiable in every tensor input (``h0`` included); ``cu_seqlens_cpu`` is passed too where the kernel
names it. Layout and segments as ``gated_delta.forest_gated_delta_rule``.

Guarantees: the math of ``gated_delta.forest_gated_delta_rule`` with the kernel's rounding: level ``l``'s
segments are gathered into one varlen batch, each starting from its parent's final state (the same state for
every child of one parent: autograd sums the children's state gradients into it); an empty segment passes its
initial state through. A forest of depth d is d kernel calls; the levels come from the host table
(``levels.host_table``), so no call waits on the device.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

from ...layout.segments import Segments, to_device
from .levels import depth_groups, host_table

__all__ = ["forest_gated_delta_rule_varlen"]


@functools.lru_cache(maxsize=None)  # a kernel's signature, read once (every layer, every call asks)
def _names_cpu_lengths(kernel) -> bool:
    try:
        return "cu_seqlens_cpu" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return False


def forest_gated_delta_rule_varlen(kernel: Callable, q, k, v, g, beta, segs: Segments,
                                   use_qk_l2norm: bool = False) -> torch.Tensor:
    """``out [1, T, Hv, Dv]`` in the kernel's dtype (q's); see the module docstring."""
    T = q.shape[1]
    start, length, parent = host_table(segs)
    if start and start[-1] + length[-1] != T:
        raise ValueError(f"the segments cover {start[-1] + length[-1]} tokens, the inputs have {T}")
    by_level, row = depth_groups(parent)
    device = q.device
    host_lens = _names_cpu_lengths(kernel)
    state_shape = (v.shape[2], k.shape[3], v.shape[3])
    state_dtype = torch.promote_types(q.dtype, torch.float32)  # fla's final states: float32
    outs, where, prev = [], [], None
    for members in by_level:
        full = [i for i in members if length[i] > 0]
        if prev is None:
            state0 = None
        else:
            rows = torch.tensor([row[parent[i]] for i in members], dtype=torch.int64)
            state0 = prev.index_select(0, to_device(rows, device))
        if not full:  # only empty segments: their final states are their initial ones
            prev = state0 if state0 is not None else q.new_zeros((len(members),) + state_shape, dtype=state_dtype)
            continue
        keep = [j for j, i in enumerate(members) if length[i] > 0]
        partial = len(keep) < len(members)
        keep_dev = to_device(torch.tensor(keep, dtype=torch.int64), device) if partial else None
        h0 = None if state0 is None else (state0.index_select(0, keep_dev) if partial else state0)
        tokens = torch.cat([torch.arange(start[i], start[i] + length[i], dtype=torch.int64) for i in full])
        cu = torch.zeros(len(full) + 1, dtype=torch.int64)
        cu[1:] = torch.tensor([length[i] for i in full], dtype=torch.int64).cumsum(0)
        idx = to_device(tokens, device)
        extra = {"cu_seqlens_cpu": cu} if host_lens else {}
        o, ht = kernel(*(x.index_select(1, idx) for x in (q, k, v, g, beta)), initial_state=h0,
                       output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=to_device(cu, device),
                       **extra)
        if partial:
            base = state0 if state0 is not None else ht.new_zeros((len(members),) + state_shape)
            ht = base.index_copy(0, keep_dev, ht)
        prev = ht
        outs.append(o[0])
        where.append(idx)
    if not outs:
        raise ValueError("the forest has no tokens")
    out_all = torch.cat(outs)
    out = out_all.new_zeros((T,) + tuple(out_all.shape[1:])).index_copy(0, torch.cat(where), out_all)
    return out.unsqueeze(0)
