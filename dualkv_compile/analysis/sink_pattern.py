"""gpt-oss's learnable sinks in eager attention: the part of the pattern between the scores and the softmax.

Contract
    ``sink_logits(x, internal)``: if the softmax's input ``x`` is ``cat([scores, sinks_expanded], dim=-1)``,
    optionally less its row max (``c - c.max(-1, keepdim=True)[0]`` or ``.values``, or ``c.amax(-1, keepdim=True)``:
    a softmax is unchanged by it), returns ``(sinks, scores)`` and appends the pattern's nodes to ``internal``;
    else ``(None, x)``. ``sinks`` is the node before the sink's shape chain (expand, reshape, view, casts), a
    floating-point value of exactly Hq elements (the scores' head count): one logit per query head.
    ``drops_last_column(n)``: ``n`` is ``x[..., :-1]``, the sink column dropped after the softmax.
    The graph is not modified.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from ..graph.meta import ev as _ev
__all__ = ["sink_logits", "drops_last_column"]

_SHAPE_METHODS = {"expand", "reshape", "view", "to", "contiguous", "type_as"}


def _arg(node: fx.Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _row_max_of(b) -> Optional[tuple[fx.Node, list]]:
    """``(c, nodes)`` if ``b`` is ``c.max(-1, keepdim=True)[0]`` (or ``.values``) or ``c.amax(-1, keepdim=True)``."""
    nodes = []
    if isinstance(b, fx.Node) and b.op == "call_function" and b.target in (operator.getitem, getattr) and len(b.args) == 2 \
            and b.args[1] in (0, "values"):
        nodes.append(b)
        b = b.args[0]
        want = "max"
    else:
        want = "amax"
    if not (isinstance(b, fx.Node) and b.op == "call_method" and b.target == want):
        return None
    if _arg(b, 1, "dim") not in (-1, 3) or not _arg(b, 2, "keepdim", False):
        return None
    return b.args[0], nodes + [b]


def sink_logits(x, internal: list):
    nodes, c = [], x
    if isinstance(c, fx.Node) and c.op == "call_function" and c.target in (operator.sub, torch.sub) and len(c.args) == 2:
        found = _row_max_of(c.args[1])
        if found is not None and found[0] is c.args[0]:
            nodes = [c] + found[1]
            c = c.args[0]
    if not (isinstance(c, fx.Node) and c.op == "call_function" and c.target is torch.cat):
        return None, x
    parts, dim = c.args[0], _arg(c, 1, "dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or dim not in (-1, 3):
        return None, x
    scores, s = parts
    chain = []
    while isinstance(s, fx.Node) and s.op == "call_method" and s.target in _SHAPE_METHODS and len(s.users) == 1:
        chain.append(s)
        s = s.args[0]
    ev = _ev(s)
    cat = _ev(c)
    if not chain or not isinstance(ev, torch.Tensor) or not isinstance(cat, torch.Tensor) or cat.dim() != 4:
        return None, x
    if ev.numel() != cat.shape[1] or not ev.dtype.is_floating_point:
        return None, x  # not one logit per query head: not a sink
    internal.extend(nodes + [c] + chain)
    return s, scores


def drops_last_column(n: fx.Node) -> bool:
    if not (n.op == "call_function" and n.target is operator.getitem and len(n.args) == 2):
        return False
    idx = n.args[1]
    return isinstance(idx, tuple) and len(idx) == 2 and idx[0] is Ellipsis and idx[1] == slice(None, -1, None)
