"""How a row of the token-axis rule tables is written and applied (``test_token_rules.py`` runs the rows).

A row applies one op to placeholders of given example values, token tags and
kinds, and names the ``NodeInfo`` its rule gives, or the failure it raises
(``RuleFailed``: computed in the original layout; ``Coupling``: the graph is
refused) with a substring of the message. ``apply_rule`` builds the one-op FX
graph, runs the op on real tensors for the node's ``example_value`` and calls
the rule ``rule_for`` finds for the node (or the one it is given: the MoE
dispatch's ``routed_rule``). Tags are written as a string, one word per
dimension: ``b``, ``s``, ``bs``, ``r`` (an MoE dispatch's axis) or ``-`` (no
token axis); a ROUTED input names its ``Route`` as ``(what, factor)``, its
order the input itself. Also the common inputs the tables share (hidden
states, a parameter, masks, ids, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from dualkv_compile.analysis.node_info import Coupling, Kind, NodeInfo, Route, RuleFailed
import dualkv_compile.analysis.token_axes  # noqa: F401  (the driver loads every rule module)
from dualkv_compile.analysis.rule_registry import rule_for

B, S, D = 3, 4, 8  # batch, sequence, feature: distinct, so a size names its axis
TOKEN, COLUMN, BCAST, NONE = Kind.TOKEN, Kind.COLUMN, Kind.BCAST, Kind.NONE


def tags(spec: str) -> tuple[Optional[str], ...]:
    return tuple(None if w == "-" else w for w in spec.split())


@dataclasses.dataclass(frozen=True)
class In:
    """A placeholder: its example value (``randn(shape)`` unless ``value``), tags and kind."""

    shape: tuple = ()
    tags: str = ""
    kind: Kind = NONE
    value: Any = None
    shift: int = 0
    slen: Optional[int] = None
    from_inputs: bool = False
    route: Optional[tuple[str, int]] = None  # ROUTED inputs: (what, factor)

    def example(self):
        if self.value is None:
            return torch.randn(self.shape)
        return map_aggregate(self.value, lambda v: v.clone() if isinstance(v, torch.Tensor) else v)


@dataclasses.dataclass(frozen=True)
class X:
    """The row's input ``i`` in an op's arguments."""

    i: int


X0, X1, X2, X3, X4 = (X(i) for i in range(5))


@dataclasses.dataclass(frozen=True)
class Op:
    op: str  # "call_function" or "call_method"
    target: Any
    args: tuple
    kwargs: dict

    def key(self):
        return (self.op, self.target)


def fn(target, *args, **kwargs) -> Op:
    return Op("call_function", target, args, kwargs)


def meth(name, *args, **kwargs) -> Op:
    return Op("call_method", name, args, kwargs)


def out(spec: str, kind: Kind, shift: int = 0, slen: Optional[int] = None) -> NodeInfo:
    return NodeInfo(kind, tags(spec), shift=shift, slen=slen)


@dataclasses.dataclass(frozen=True)
class Fails:
    exc: type
    match: str


def fails(match: str) -> Fails:
    return Fails(RuleFailed, match)


def couples(match: str) -> Fails:
    return Fails(Coupling, match)


@dataclasses.dataclass(frozen=True)
class Weighs:
    """A reduction over every token axis of input ``operand``, weighted on the packed stream: NONE, ``spec`` tags."""

    spec: str
    op: str
    operand: int = 0


def weighs(spec: str, op: str, operand: int = 0) -> Weighs:
    return Weighs(spec, op, operand)


def apply_rule(op: Op, inputs: list[In], rule=None):
    """Build ``op`` over placeholders of ``inputs``, set its example value, and run ``rule`` (its registered one
    unless given)."""
    graph = fx.Graph()
    nodes, values, info = [], [], {}
    for k, x in enumerate(inputs):
        node = graph.placeholder(f"x{k}")
        node.meta["example_value"] = x.example()
        route = Route(node, *x.route) if x.route is not None else None
        info[node] = NodeInfo(x.kind, tags(x.tags), shift=x.shift, slen=x.slen, from_inputs=x.from_inputs, route=route)
        nodes.append(node)
        values.append(node.meta["example_value"])

    def bind(items):
        return map_aggregate((op.args, op.kwargs), lambda a: items[a.i] if isinstance(a, X) else a)

    args, kwargs = bind(nodes)
    node = graph.create_node(op.op, op.target, args, kwargs)
    vargs, vkwargs = bind(values)
    if op.op == "call_function":
        node.meta["example_value"] = op.target(*vargs, **vkwargs)
    else:
        node.meta["example_value"] = getattr(vargs[0], op.target)(*vargs[1:], **vkwargs)
    rule = rule or rule_for(node)
    assert rule is not None, f"no rule registered for {op.target}"
    return rule(node, info, B, S)


# Common inputs.
x = In((B, S, D), "b s -", TOKEN)  # hidden states
y = In((B, S, D), "b s -", TOKEN)
w = In((D,), "-", NONE)  # a parameter
bx = In((B, S, D), "b s -", TOKEN, value=torch.rand(B, S, D) > 0.5)
by = In((B, S, D), "b s -", TOKEN, value=torch.rand(B, S, D) > 0.5)
mask = In((B, S, 1), "b s -", TOKEN, value=torch.rand(B, S, 1) > 0.5)
idx = In((B, S, 1), "b s -", TOKEN, value=torch.randint(0, S, (B, S, 1)))  # < S and < D
ids = In((B, S), "b s", TOKEN, value=torch.randint(0, 10, (B, S)))
table = In((10, D), "- -", NONE)
x_bds = In((B, D, S), "b - s", TOKEN)  # token value with the sequence last
merged = In((B * S, D), "bs -", TOKEN)
col = In((1, S, D), "- s -", COLUMN)  # a column value (rotary table)
