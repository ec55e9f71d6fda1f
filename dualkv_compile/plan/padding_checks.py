"""The padding reads of a packed graph and the side graphs that evaluate their factors (docs/design.md, semantics 8).

Assumes: the packed graph, whose last ``len(PACKED_INPUTS)`` placeholders are the layout's, and the graph it was
packed from (a factor applied on the packed stream may be a token input, evaluated there on the original inputs).
Guarantees: ``reads``, every ``analysis.padding_reads.Read`` of the packed graph; ``factor_gms``, side graphs
(``analysis.side_graphs.factor_graph``) that compute every factor of those reads from a call's own inputs, each
with its ``factor_nodes``; ``unknown``, the factors no side graph can evaluate before a call, with why (they zero
nothing: a call whose read only they could zero runs unpacked). Found once; the runner evaluates them per call.
"""

from __future__ import annotations

import dataclasses
import logging

import torch.fx as fx

from ..analysis.padding_reads import Read, find_padding_reads
from ..analysis.side_graphs import factor_graph
from ..rewrite.pack_graph import PACKED_INPUTS

log = logging.getLogger("dualkv_compile")

__all__ = ["PaddingChecks", "plan_padding_checks"]


@dataclasses.dataclass(frozen=True, eq=False)
class PaddingChecks:
    reads: tuple[Read, ...]
    factor_gms: tuple[fx.GraphModule, ...]
    unknown: dict[fx.Node, str]


def plan_padding_checks(gm: fx.GraphModule, packed: fx.GraphModule, graph_id: int) -> PaddingChecks:
    """Where the packed program reads a position packing zeroes, and how to evaluate the factors that may mask it."""
    reads = find_padding_reads(packed, len(PACKED_INPUTS), gm)
    factors = list(dict.fromkeys(node for r in reads for node, _, _ in r.factors))
    factor_gms: list[fx.GraphModule] = []
    unknown: dict[fx.Node, str] = {}
    for f in (
        factor_graph(packed, [n for n in factors if n.graph is packed.graph], len(PACKED_INPUTS)),
        factor_graph(gm, [n for n in factors if n.graph is gm.graph], 0),
    ):
        if f is None:
            continue
        if f.unusable is None:
            factor_gms.append(f)
            continue
        unknown.update(dict.fromkeys(f.factor_nodes, f.unusable))
        log.info("dualkv: graph %d: the masks of its padding reads cannot be evaluated on their own (%s)", graph_id, f.unusable)
    return PaddingChecks(tuple(reads), tuple(factor_gms), unknown)
