"""Small node predicates the passes share (the per-op rules live in ``analysis``)."""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

__all__ = ["is_call", "item_of_placeholder"]


def is_call(n, functions=(), methods=()) -> bool:
    """``n`` calls one of ``functions`` (by identity) or one of the tensor ``methods`` (by name)."""
    if not isinstance(n, fx.Node):
        return False
    if n.op == "call_function":
        return any(n.target is f for f in functions)
    return n.op == "call_method" and n.target in methods


def item_of_placeholder(x) -> Optional[fx.Node]:
    """The placeholder ``p`` if ``x`` is ``p.item()`` (a module float Dynamo lifted to an input), else None."""
    if isinstance(x, fx.Node) and x.op == "call_method" and x.target == "item":
        src = x.args[0]
        if isinstance(src, fx.Node) and src.op == "placeholder":
            return src
    return None
