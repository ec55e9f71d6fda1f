"""Small graphs cut from a graph the runners evaluate per call: its attention masks, the factors of padding reads."""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from ..analysis.token_axes import TokenAxes

__all__ = ["factor_graph", "graph_returning", "mask_graph"]


def graph_returning(source: fx.GraphModule, nodes: list, class_name: str, drop_trailing: int = 0) -> Optional[fx.GraphModule]:
    """A copy of ``source`` that returns ``nodes`` (a tuple), with what they do not need removed; None if no nodes.

    ``drop_trailing``: trailing placeholders (the packed graph's layout inputs) removed when unused, so the
    copy takes the call's own arguments.
    """
    if not nodes:
        return None
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    g.graph_copy(source.graph, env)
    g.output(tuple(env[n] for n in nodes))
    g.eliminate_dead_code()
    placeholders = list(g.find_nodes(op="placeholder"))
    for ph in placeholders[len(placeholders) - drop_trailing:]:
        if not ph.users:
            g.erase_node(ph)
    return fx.GraphModule(source, g, class_name=class_name)


def mask_graph(gm: fx.GraphModule, axes: TokenAxes) -> Optional[fx.GraphModule]:
    """A copy of ``gm`` that returns the attention masks (as the original graph builds them)."""
    return graph_returning(gm, [m.mask for m in axes.attention if m.mask is not None], "AttentionMasks")


def factor_graph(source: fx.GraphModule, nodes: list, layout_inputs: int) -> Optional[fx.GraphModule]:
    """A copy of ``source`` returning ``nodes`` (the factors of padding reads) from the call's own inputs.

    ``layout_inputs``: trailing placeholders of ``source`` (the packed graph's layout inputs), which the
    factors do not read (``find_padding_reads`` checked).
    """
    gm = graph_returning(source, nodes, "PaddingReadFactors", drop_trailing=layout_inputs)
    if gm is not None:
        gm.factor_nodes = nodes
    return gm
