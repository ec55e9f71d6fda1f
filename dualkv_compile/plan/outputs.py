"""Which of the packed graph's outputs ``unpack`` makes: their shared copies are equal by construction.

Assumes: the packed graph (``rewrite.pack_graph``'s, after the fusion) with example values on its nodes.
Guarantees: positions among its tensor outputs in ``layout.carried.leaves`` order, as ``ActiveLayout.record_outputs``
counts them; empty when an output's kind (tensor or not) cannot be told, so nothing is taken for granted.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph.meta import ev, has_example_value
from ..layout import carried as active_layout
from ..layout.packed_ops import unpack_merged, unpack_tokens

__all__ = ["unpacked_output_positions"]


def unpacked_output_positions(packed: fx.GraphModule) -> tuple[int, ...]:
    """Positions, among the packed graph's tensor outputs in ``layout.carried.leaves`` order, made by ``unpack``."""
    out = next(iter(packed.graph.find_nodes(op="output")))
    positions, i = [], 0
    for leaf in active_layout.leaves(out.args[0]):
        if not isinstance(leaf, fx.Node):
            continue
        if leaf.op == "call_function" and leaf.target in (unpack_tokens, unpack_merged):
            positions.append(i)
        elif not isinstance(ev(leaf), torch.Tensor):
            if not has_example_value(leaf):
                return ()
            continue  # a SymInt or other non-tensor output: not counted by _tensors
        i += 1
    return tuple(positions)
