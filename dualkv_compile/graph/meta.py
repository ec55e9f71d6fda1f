"""Every node-meta key the package reads or writes, behind accessors: Dynamo's and torch's, and dualkv's own.

Dynamo's: the example value (``example_value``; FakeTensorProp writes ``val``), a placeholder's ``grapharg``,
``unbacked_bindings``. torch's activation checkpointing: ``recompute`` and ``ac_graph_id`` on ops of a region.
AOTAutograd's cache: ``is_wrapped`` and ``user_cache_hash`` on a call of a Python function. dualkv's own, set by
``rewrite`` for the passes after it: heads of an attention call, token sums, an original node's name, the rank
of an unpacked value, picked and weighted reads (``analysis.padding_reads`` follows them).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

__all__ = [
    "ev", "example_storage", "has_example_value", "set_example_value", "example_value_from_val", "drop_fake_values", "grapharg",
    "unbacked_bindings", "TAGGED_OPS", "recompute_tags", "set_recompute_tags", "mark_recompute", "in_checkpoint_region",
    "mark_cacheable", "heads", "set_heads", "token_sum", "set_token_sum", "original", "set_original", "unpacked_rank",
    "set_unpacked_rank", "picked_rank", "set_picked_rank", "weighted", "set_weighted", "copy_meta",
]

_EXAMPLE = "example_value"
_RECOMPUTE = ("recompute", "ac_graph_id")
# The node kinds that carry the checkpoint tags (ops, not placeholders or attributes).
TAGGED_OPS = ("call_function", "call_method", "call_module")

_HEADS = "dualkv_heads"
_TOKEN_SUM = "dualkv_token_sum"
_ORIGINAL = "dualkv_original"
_UNPACKED_RANK = "unpacked_rank"
_PICKED = "dualkv_picked_unpacked"
_WEIGHTED = "dualkv_weighted"


# --- Dynamo's -------------------------------------------------------------------------------------------------

def ev(x, default=None):
    """The example value Dynamo recorded on node ``x``; ``default`` for non-nodes and nodes without one."""
    return x.meta.get(_EXAMPLE, default) if isinstance(x, fx.Node) else default


def example_storage(n):
    """A weak reference to the storage of ``n``'s example value (equal for values that alias one buffer); None
    where it is not a tensor or has no storage (sparse and other storage-less tensors)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    value = ev(n)
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return StorageWeakRef(value.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def has_example_value(n: fx.Node) -> bool:
    return _EXAMPLE in n.meta


def set_example_value(n: fx.Node, value) -> None:
    n.meta[_EXAMPLE] = value


def example_value_from_val(n: fx.Node) -> None:
    """Move FakeTensorProp's ``val`` to where Dynamo keeps it, ``example_value``."""
    if "val" in n.meta:
        n.meta[_EXAMPLE] = n.meta.pop("val")


def drop_fake_values(n: fx.Node) -> None:
    """Forget the fake values of another trace (its fake mode's), so a new trace makes its own."""
    for key in (_EXAMPLE, "val", "tensor_meta"):
        n.meta.pop(key, None)


def grapharg(placeholder: fx.Node):
    """Dynamo's record of where a placeholder's value comes from (its source), or None."""
    return placeholder.meta.get("grapharg")


def unbacked_bindings(n: fx.Node):
    return n.meta.get("unbacked_bindings")


# --- activation checkpointing and AOTAutograd's cache -----------------------------------------------------------

def recompute_tags(n: fx.Node) -> dict:
    """``n``'s activation-checkpoint tags (empty outside a region)."""
    return {k: n.meta[k] for k in _RECOMPUTE if k in n.meta}


def set_recompute_tags(n: fx.Node, tags: dict) -> None:
    n.meta.update(tags)


def mark_recompute(n: fx.Node, region_id: int) -> None:
    """Put ``n`` in checkpoint region ``region_id``: recomputed in the backward, not saved."""
    from torch.utils.checkpoint import CheckpointPolicy

    n.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    n.meta["ac_graph_id"] = region_id


def in_checkpoint_region(n: fx.Node) -> bool:
    return any(k in n.meta for k in _RECOMPUTE)


def mark_cacheable(n: fx.Node, digest: str) -> None:
    """Let AOTAutograd's cache take a call of a Python function, keyed by ``digest`` (as ``torch.fx.wrap`` marks)."""
    n.meta["is_wrapped"] = True
    n.meta["user_cache_hash"] = digest


# --- dualkv's own ---------------------------------------------------------------------------------------------

def heads(n: fx.Node) -> Optional[tuple[int, int]]:
    """``(Hq, Hkv)`` of a ``dualkv::attention_fwd`` call (its key/value heads before any repeat), if recorded."""
    return n.meta.get(_HEADS)


def set_heads(n: fx.Node, hq: int, hkv: int) -> None:
    n.meta[_HEADS] = (hq, hkv)


def token_sum(n: fx.Node) -> Optional[str]:
    """"sum" if ``n`` is a sum over the packed tokens, "accumulate" for a ``scatter_add``/``index_add`` of the
    tokens into ``args[0]``, else None (``rewrite.sequence_parallel`` reduces them over the group)."""
    return n.meta.get(_TOKEN_SUM)


def set_token_sum(n: fx.Node, how: str) -> None:
    assert how in ("sum", "accumulate"), how
    n.meta[_TOKEN_SUM] = how


def original(n) -> Optional[str]:
    """The name of the original-graph node a packed node stands for (a name: meta may be deep-copied)."""
    return n.meta.get(_ORIGINAL) if isinstance(n, fx.Node) else None


def set_original(n: fx.Node, name: str) -> None:
    n.meta[_ORIGINAL] = name


def unpacked_rank(n) -> Optional[int]:
    """The rank of an unpacked value (an ``unpack`` or a read that stands for one), zero at padding."""
    return n.meta.get(_UNPACKED_RANK) if isinstance(n, fx.Node) else None


def set_unpacked_rank(n: fx.Node, rank: int) -> None:
    n.meta[_UNPACKED_RANK] = rank


def picked_rank(n: fx.Node) -> Optional[int]:
    """On ``gather_unpacked``'s result, or what a fusion put in its place: its index's rank."""
    return n.meta.get(_PICKED)


def set_picked_rank(n: fx.Node, rank: int) -> None:
    n.meta[_PICKED] = rank


def weighted(n: fx.Node) -> Optional[tuple]:
    """``(shift, truncate, merged, leading)`` on a reduction over the token axes taken with ``token_weights``."""
    return n.meta.get(_WEIGHTED)


def set_weighted(n: fx.Node, value: tuple) -> None:
    n.meta[_WEIGHTED] = value


def copy_meta(src: fx.Node, dst: fx.Node, example_value: bool = True) -> None:
    """``dst`` takes ``src``'s meta (a shallow copy), without its example value if ``example_value`` is False."""
    dst.meta = {k: v for k, v in src.meta.items() if example_value or k != _EXAMPLE}
