"""Shared-prompt attention under Ulysses sequence parallelism: exchange heads for tokens, attend, exchange back.

Assumes each rank of the group holds its chunk of the packed stream (rank
``r`` the tokens ``[r * Tl, (r + 1) * Tl)``, the stream padded to
``world * Tl`` tokens and its segments covering all of them) and the same
segments (the whole forest). Guarantees: the output is this rank's chunk of
``dualkv::attention_fwd`` over the whole stream, every head; the kernel
runs on every token for ``Hq / world`` query heads and their key/value
heads, so each rank sees the whole forest for its heads.

Key/value heads: with ``Hkv`` not a multiple of ``world`` each is repeated
(``Hkv * r`` heads, r the smallest repeat that ``world`` divides) before the
exchange, as veRL does; query head ``h`` still reads key/value head
``h // (Hq / Hkv)``'s copy, and the backward sums the copies' gradients.
``check_heads`` says when no repeat can work.
"""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch

from . import attention as _attention  # noqa: F401  (registers torch.ops.dualkv.attention_fwd)
from . import sp_collectives as _sp_collectives  # noqa: F401  (registers torch.ops.dualkv.sp_all_to_all)

__all__ = ["check_heads", "kv_repeat", "ulysses_attention", "ulysses_steps"]


def kv_repeat(num_kv_heads: int, world: int) -> int:
    """How many copies of each key/value head make their count a multiple of ``world``."""
    return world // math.gcd(num_kv_heads, world)


def check_heads(num_heads: int, num_kv_heads: int, world: int) -> Optional[str]:
    """None if the heads split over ``world`` ranks; else why not."""
    if num_heads % world:
        return f"sequence-parallel degree {world} does not divide the {num_heads} query heads"
    kv = num_kv_heads * kv_repeat(num_kv_heads, world)
    if num_heads % kv:
        return (
            f"the {num_kv_heads} key/value heads, repeated to {kv} for a sequence-parallel degree of {world}, "
            f"do not divide the {num_heads} query heads"
        )
    return None


def ulysses_steps(call, q, k, v, num_kv_heads: int, attention_args: tuple, world: int, group_name: str):
    """The exchange, the kernel and the exchange back, each step one ``call(target, *args)``; returns the output.

    Eagerly ``call`` runs the target; ``rewrite.sequence_parallel`` passes one that emits a graph node per step,
    so every step is one custom-op node on the graph's own line: Dynamo, re-tracing the packed graph, copies a
    node's activation-checkpoint tags only to the ops traced on its line, and the steps of a Python function it
    inlines lost them (the exchanged q/k/v and the output were then saved for the backward of every checkpointed
    layer, not recomputed). ``attention_args``: ``dualkv::attention_fwd``'s arguments after q, k, v."""
    a2a = torch.ops.dualkv.sp_all_to_all.default
    r = kv_repeat(num_kv_heads, world)
    if r > 1:
        k, v = call(torch.repeat_interleave, k, r, 1), call(torch.repeat_interleave, v, r, 1)
    # [1, H, Tl, D] -> [1, H / world, world * Tl, D]: this rank's heads over the whole stream.
    q, k, v = (call(a2a, t, 1, 2, world, group_name) for t in (q, k, v))
    res = call(torch.ops.dualkv.attention_fwd.default, q, k, v, *attention_args)
    return call(a2a, call(operator.getitem, res, 0), 2, 1, world, group_name)


def ulysses_attention(
    q, k, v, seg_start, seg_len, parent, prefix_len, subtree_end, max_seg_len, max_prefix_len,
    scale: float, softcap: float, backend: str, world: int, group_name: str,
):
    """``dualkv::attention_fwd``'s arguments plus the group; returns ``(out,)``: this rank's chunk, every head."""
    args = (seg_start, seg_len, parent, prefix_len, subtree_end, max_seg_len, max_prefix_len, scale, softcap, backend)
    return (ulysses_steps(lambda f, *a: f(*a), q, k, v, k.shape[1], args, world, group_name),)
