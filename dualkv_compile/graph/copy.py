"""A pass's working copy of a Dynamo graph module.

The passes that run before the analysis (``inline_checkpoint``,
``positional_args``, ``functionalize``) change a copy, never ``gm`` itself:
the caller's fallback keeps running the original (``rewrite.sequence_parallel``
copies the packed graph the same way). Guarantees: a new
``GraphModule`` over a node-for-node copy of ``gm.graph`` (meta included),
with ``gm``'s attributes, submodules and class name; ``env``, when given, is
filled with each original node's copy.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

__all__ = ["copy_graph_module"]


def copy_graph_module(gm: fx.GraphModule, env: Optional[dict[fx.Node, fx.Node]] = None) -> fx.GraphModule:
    """A copy of ``gm`` to change (see the module docstring)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {} if env is None else env))
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__)
