"""What every graph pass shares, from ``normalize`` up: how it refuses a graph and how it reads a node's example value.

``Refusal``: raised by any pass (normalize, analysis, rewrite) when the
graph cannot be rewritten; the backend catches it, runs the graph unchanged
and keeps the message for ``explain()``. ``ev``: the example value Dynamo
recorded on a node (``meta["example_value"]``), None for non-nodes.
Imports nothing of the package.
"""

from __future__ import annotations

import torch.fx as fx

__all__ = ["Refusal", "ev"]


class Refusal(Exception):
    """The graph cannot be rewritten; the message says why."""


def ev(x):
    """The example value of node ``x`` (None for non-nodes)."""
    return x.meta.get("example_value") if isinstance(x, fx.Node) else None
