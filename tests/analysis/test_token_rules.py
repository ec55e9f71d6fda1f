"""The per-op token-axis rules (analysis/token_rules.py, analysis/shape_rules.py), one table per rule family.

A row applies one op to placeholders of given example values, token tags and
kinds, and names the ``NodeInfo`` its rule gives, or the failure it raises
(``RuleFailed``: computed in the original layout; ``Coupling``: the graph is
refused) with a substring of the message. Each row builds a one-op FX graph,
runs the op on real tensors for the node's ``example_value`` and calls the
rule ``rule_for`` finds for the node. Tags are written as a string, one word
per dimension: ``b``, ``s``, ``bs`` or ``-`` (no token axis).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.node import map_aggregate

from dualkv_compile.analysis.node_info import Coupling, Kind, NodeInfo, RuleFailed
from dualkv_compile.analysis.token_axes import analyze_token_axes
from dualkv_compile.analysis.token_inputs import Role, TokenInput, TokenInputs
import dualkv_compile.analysis.token_axes  # noqa: F401  (the driver loads every rule module)
from dualkv_compile.analysis.rule_registry import RULES, rule_for

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


def apply_rule(op: Op, inputs: list[In]):
    """Build ``op`` over placeholders of ``inputs``, set its example value, and run its registered rule."""
    graph = fx.Graph()
    nodes, values, info = [], [], {}
    for k, x in enumerate(inputs):
        node = graph.placeholder(f"x{k}")
        node.meta["example_value"] = x.example()
        info[node] = NodeInfo(x.kind, tags(x.tags), shift=x.shift, slen=x.slen, from_inputs=x.from_inputs)
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
    rule = rule_for(node)
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


def _pointwise_rows():
    binary_funcs = [
        operator.add, operator.sub, operator.mul, operator.truediv, operator.pow, operator.eq, operator.ne,
        operator.lt, operator.le, operator.gt, operator.ge, torch.add, torch.sub, torch.mul, torch.div,
        torch.pow, torch.maximum, torch.minimum,
    ]
    unary_funcs = [
        operator.neg, operator.pos, torch.rsqrt, torch.sqrt, torch.exp, torch.log, torch.tanh, torch.sigmoid,
        torch.sin, torch.cos, torch.neg, torch.abs, torch.erf, torch.reciprocal, torch.square, F.silu, F.gelu,
        F.relu, F.tanh, F.sigmoid, F.softplus, F.mish, F.leaky_relu, torch._C._nn.gelu, F.hardtanh,
        torch.log1p, torch.expm1, torch.sign, torch.nan_to_num,
    ]
    rows = [(f.__name__, fn(f, X0, X1), [x, w], out("b s -", TOKEN)) for f in binary_funcs]
    rows += [(f.__name__, fn(f, X0), [x], out("b s -", TOKEN)) for f in unary_funcs]
    rows += [
        ("floordiv-scalar", fn(operator.floordiv, X0, 2), [x], out("b s -", TOKEN)),
        ("mod-scalar", fn(operator.mod, X0, 3), [x], out("b s -", TOKEN)),
        ("and", fn(operator.and_, X0, X1), [bx, by], out("b s -", TOKEN)),
        ("or", fn(operator.or_, X0, X1), [bx, by], out("b s -", TOKEN)),
        ("xor", fn(operator.xor, X0, X1), [bx, by], out("b s -", TOKEN)),
        ("invert", fn(operator.invert, X0), [bx], out("b s -", TOKEN)),
        ("logical_and", fn(torch.logical_and, X0, X1), [bx, by], out("b s -", TOKEN)),
        ("logical_or", fn(torch.logical_or, X0, X1), [bx, by], out("b s -", TOKEN)),
        ("logical_not", fn(torch.logical_not, X0), [bx], out("b s -", TOKEN)),
        ("where", fn(torch.where, X0, X1, X2), [mask, x, w], out("b s -", TOKEN)),
        ("clamp", fn(torch.clamp, X0, min=0.0), [x], out("b s -", TOKEN)),
        ("masked_fill", fn(torch.masked_fill, X0, X1, 0.0), [x, mask], out("b s -", TOKEN)),
        ("gather-last", fn(torch.gather, X0, -1, X1), [x, idx], out("b s -", TOKEN)),
        # A column value (one row of positions) broadcasts against the token value's batch axis.
        ("column-times-token", fn(operator.mul, X0, X1), [col, x], out("b s -", TOKEN)),
        # A constant of size 1 along the token axes lines up after packing.
        ("size-1-constant", fn(operator.add, X0, X1), [x, In((1, 1, D), "- - -", NONE)], out("b s -", TOKEN)),
        ("column-only", fn(torch.cos, X0), [col], out("- s -", COLUMN)),
        ("gather-token-axis", fn(torch.gather, X0, 1, X1), [x, idx], fails("gather along a token axis")),
        ("clash-b-s", fn(operator.add, X0, X1), [In((S, S), "b s", TOKEN), In((S, S), "s b", TOKEN)],
         fails("broadcasts token axis b against s")),
        ("constant-along-s", fn(operator.add, X0, X1), [x, In((S, D), "- -", NONE)],
         fails("combines a constant of length 4 with the s axis")),
    ]
    methods = [
        ("to", (torch.float64,)), ("float", ()), ("half", ()), ("bfloat16", ()), ("double", ()),
        ("type_as", (X1,)), ("contiguous", ()), ("clone", ()), ("detach", ()), ("pow", (2,)), ("rsqrt", ()),
        ("sqrt", ()), ("exp", ()), ("log", ()), ("sin", ()), ("cos", ()), ("neg", ()), ("abs", ()),
        ("sigmoid", ()), ("tanh", ()), ("mul", (X1,)), ("add", (X1,)), ("sub", (X1,)), ("div", (X1,)),
        ("clamp", (0.0,)), ("type", (torch.float64,)), ("requires_grad_", ()), ("long", ()), ("int", ()),
        ("bool", ()), ("log1p", ()), ("expm1", ()), ("square", ()), ("reciprocal", ()), ("float_power", (2,)),
        ("nan_to_num", ()), ("fill_", (0.0,)), ("zero_", ()),
        # comparisons as methods (torch 2.12's Dynamo records ``a == b`` as ``call_method __eq__``)
        ("__eq__", (X1,)), ("__ne__", (X1,)), ("__lt__", (X1,)), ("__le__", (X1,)), ("__gt__", (X1,)),
        ("__ge__", (X1,)), ("eq", (X1,)), ("ne", (X1,)), ("lt", (0.0,)), ("le", (X1,)), ("gt", (0.0,)), ("ge", (X1,)),
    ]
    rows += [(f"{m}-method", meth(m, X0, *a), [x, w], out("b s -", TOKEN)) for m, a in methods]
    rows += [
        ("masked_fill-method", meth("masked_fill", X0, X1, 0.0), [x, mask], out("b s -", TOKEN)),
        ("where-method", meth("where", X0, X1, X2), [x, mask, w], out("b s -", TOKEN)),
        ("__and__-method", meth("__and__", X0, X1), [bx, by], out("b s -", TOKEN)),
        ("__or__-method", meth("__or__", X0, X1), [bx, by], out("b s -", TOKEN)),
        ("__invert__-method", meth("__invert__", X0), [bx], out("b s -", TOKEN)),
        ("gather-method", meth("gather", X0, -1, X1), [x, idx], out("b s -", TOKEN)),
        ("gather-method-token-axis", meth("gather", X0, 1, X1), [x, idx], fails("gather along a token axis")),
        ("mul-method-constant-along-b", meth("mul", X0, X1), [x, In((B, 1, D), "- - -", NONE)],
         fails("combines a constant of length 3 with the b axis")),
    ]
    return rows


LIKE = [
    # The result has its operand's axes, shift and sequence length.
    (f.__name__, fn(f, X0, *a), [In((B, S - 1, D), "b s -", TOKEN, shift=1, slen=S - 1)],
     out("b s -", TOKEN, shift=1, slen=S - 1))
    for f, a in [(torch.ones_like, ()), (torch.zeros_like, ()), (torch.empty_like, ()), (torch.full_like, (1.0,))]
] + [
    ("zeros_like-column", fn(torch.zeros_like, X0), [col], out("- s -", COLUMN)),
    # Noise per token: the original draws for each copy of a shared prompt (as dropout does): refused.
    ("rand_like", fn(torch.rand_like, X0), [x], couples("rand_like draws different values for the copies")),
    ("randn_like-merged", fn(torch.randn_like, X0), [merged], couples("randn_like draws different values")),
    ("randint_like", fn(torch.randint_like, X0, 5), [x], couples("randint_like draws different values")),
    ("randn_like-column", fn(torch.randn_like, X0), [col], out("- s -", COLUMN)),
]

LINEAR = [
    ("projection", fn(F.linear, X0, X1, X2), [x, In((16, D), "- -", NONE), In((16,), "-", NONE)], out("b s -", TOKEN)),
    ("no-bias", fn(F.linear, X0, X1), [merged, In((16, D), "- -", NONE)], out("bs -", TOKEN)),
    ("token-weight", fn(F.linear, X0, X1), [x, In((S, D), "s -", COLUMN)], fails("linear with a token-dependent weight")),
    ("token-bias", fn(F.linear, X0, X1, X2), [x, In((S, D), "- -", NONE), In((S,), "s", COLUMN)],
     fails("linear with a token-dependent weight")),
    ("over-s", fn(F.linear, X0, X1), [x_bds, In((16, S), "- -", NONE)], fails("linear over a token axis")),
]

EMBEDDING = [
    ("ids", fn(F.embedding, X0, X1), [ids, table], out("b s -", TOKEN)),
    ("position-ids-column", fn(F.embedding, X0, X1), [In((1, S), "- s", COLUMN, value=torch.arange(S)[None]), table],
     out("- s -", COLUMN)),
    ("token-table", fn(F.embedding, X0, X1), [ids, In((10, S), "- s", COLUMN)], fails("embedding with a token-dependent table")),
    # torch.embedding takes (weight, indices): ATen's order, not F.embedding's.
    ("torch.embedding", fn(torch.embedding, X0, X1), [table, ids], out("b s -", TOKEN)),
    ("torch.embedding-token-table", fn(torch.embedding, X0, X1), [In((10, S), "- s", COLUMN), ids],
     fails("embedding with a token-dependent table")),
    ("keywords", fn(F.embedding, input=X0, weight=X1), [ids, table], out("b s -", TOKEN)),
]

MATMUL = [
    ("projection", fn(torch.matmul, X0, X1), [x, In((D, 16), "- -", NONE)], out("b s -", TOKEN)),
    ("operator", fn(operator.matmul, X0, X1), [x, In((D, 16), "- -", NONE)], out("b s -", TOKEN)),
    # Rotary: inv_freq[:, None] @ positions[None, :] (a column value on the right).
    ("rotary", fn(torch.matmul, X0, X1), [In((D, 1), "- -", NONE), In((1, S), "- s", COLUMN)], out("- s", COLUMN)),
    ("bmm-batch-constant", fn(torch.bmm, X0, X1), [x, In((B, D, 16), "b - -", BCAST)], out("b s -", TOKEN)),
    ("bmm-constant-over-b", fn(torch.bmm, X0, X1), [x, In((B, D, 16), "- - -", NONE)],
     fails("matmul broadcasting a constant over a token axis")),
    ("contracts-s", fn(torch.matmul, X0, X1), [x_bds, x], fails("matmul that contracts over a token axis")),
    ("attention-like", fn(torch.matmul, X0, X1), [x, x_bds], fails("matmul between two token values (attention-like)")),
    ("vector", fn(torch.matmul, X0, X1), [x, w], fails("matmul with a vector operand")),
    ("different-batch-axes", fn(torch.matmul, X0, X1), [In((S, S, 2, D), "b s - -", TOKEN), In((S, S, D, 2), "s b - -", TOKEN)],
     fails("matmul broadcasting different token axes")),
]

REDUCTIONS = [
    (f"{m}-method", meth(m, X0, dim=-1), [x], out("b s", TOKEN))
    for m in ("mean", "sum", "amax", "amin", "norm", "var", "std", "logsumexp", "prod")
] + [
    (f.__name__, fn(f, X0, dim=-1), [x], out("b s", TOKEN))
    for f in (torch.mean, torch.sum, torch.amax, torch.amin, torch.norm, torch.var, torch.std, torch.logsumexp)
] + [
    ("keepdim", meth("sum", X0, -1, True), [x], out("b s -", TOKEN)),
    ("dims-tuple", fn(torch.mean, X0, (2, 3)), [In((B, S, 2, D), "b s - -", TOKEN)], out("b s", TOKEN)),
    # Over some token axes only (per row, per column): not a sum of per-token terms; the original layout.
    ("along-s", meth("mean", X0, 1), [x], fails("mean along some token axes only")),
    ("along-b-keepdim", fn(torch.sum, X0, 0, keepdim=True), [x], fails("sum along some token axes only")),
    # Over every token axis: weighted by multiplicity on the packed stream (analysis/token_reductions.py).
    ("all-axes", meth("sum", X0), [x], weighs("", "sum")),
    ("token-axes", fn(torch.sum, X0, (0, 1)), [x], weighs("-", "sum")),
    ("mean-token-axes-keepdim", meth("mean", X0, (1, 0), True), [x], weighs("- - -", "mean")),
    ("merged-axis", meth("sum", X0, 0), [merged], weighs("-", "sum")),
    ("torch.mean-merged", fn(torch.mean, X0, dim=0), [merged], weighs("-", "mean")),
    ("next-token-values", meth("sum", X0), [In((B, S - 1), "b s", TOKEN, shift=1, slen=S - 1)], weighs("", "sum")),
    ("mean-of-ints", meth("sum", X0), [In((B, S), "b s", TOKEN, value=torch.ones(B, S, dtype=torch.long))], weighs("", "sum")),
    ("amax-all-axes", fn(torch.amax, X0, (0, 1)), [x], fails("amax along a token axis")),
    ("logsumexp-merged", meth("logsumexp", X0, 0), [merged], fails("logsumexp along a token axis")),
    ("var-method-all", meth("var", X0), [x], fails("var along a token axis")),
    ("sum-column", meth("sum", X0), [col], fails("sum of a column value over the token axes")),
    ("sum-of-inputs", meth("sum", X0), [In((B, S), "b s", TOKEN, from_inputs=True)],
     fails("sum over the token axes of a value of the inputs alone")),
    # norm takes p first: x.norm(2, 1) reduces the sequence axis (dim 1), not dim 2.
    ("norm-p-then-dim-along-s", meth("norm", X0, 2, 1), [x], fails("norm along a token axis")),
    ("torch.norm-p-then-dim-along-s", fn(torch.norm, X0, 2, 1), [x], fails("norm along a token axis")),
    ("norm-p-then-dim", meth("norm", X0, 2, -1), [x], out("b s", TOKEN)),
    ("norm-p-dim-keepdim", meth("norm", X0, 2, -1, True), [x], out("b s -", TOKEN)),
]

# Expert counts: a constant ``zeros(E)`` gathers each token's entries (top-k ids, a mask repeated k times).
_E_IDS = In((B * S * 2,), "bs", TOKEN, value=torch.randint(0, 4, (B * S * 2,)))
_E_SRC = In((B * S * 2,), "bs", TOKEN)
_E_BASE = In((4,), "-", NONE, value=torch.zeros(4))
SCATTER = [
    ("scatter_add-method", meth("scatter_add", X0, 0, X1, X2), [_E_BASE, _E_IDS, _E_SRC], weighs("-", "scatter_add", 2)),
    ("torch.scatter_add", fn(torch.scatter_add, X0, 0, X1, X2), [_E_BASE, _E_IDS, _E_SRC], weighs("-", "scatter_add", 2)),
    ("index_add-method", meth("index_add", X0, 0, X1, X2), [_E_BASE, _E_IDS, _E_SRC], weighs("-", "index_add", 2)),
    ("torch.index_add", fn(torch.index_add, X0, 0, X1, X2), [_E_BASE, _E_IDS, _E_SRC], weighs("-", "index_add", 2)),
    # The mask's counts alone (no model value): computed in the original layout from the inputs.
    ("of-inputs-alone", meth("scatter_add", X0, 0, X1, X2),
     [_E_BASE, In((B * S * 2,), "bs", TOKEN, value=torch.randint(0, 4, (B * S * 2,)), from_inputs=True), In((B * S * 2,), "bs", TOKEN, from_inputs=True)],
     fails("of the inputs alone")),
    ("into-token-value", meth("scatter_add", X0, 0, X1, X2), [In((B * S * 2,), "bs", TOKEN), _E_IDS, _E_SRC],
     fails("into a value with token axes")),
    ("index-without-token-axes", meth("index_add", X0, 0, X1, X2), [In((B * S * 2, 3), "bs -", TOKEN), In((4,), "-", NONE, value=torch.arange(4)), In((4, 3), "- -", NONE)],
     fails("into a value with token axes")),
    ("along-features", meth("scatter_add", X0, 1, X1, X2),
     [In((B * S, 4), "bs -", TOKEN), In((B * S, 2), "bs -", TOKEN, value=torch.randint(0, 4, (B * S, 2))), In((B * S, 2), "bs -", TOKEN)],
     fails("into a value with token axes")),
    ("split-token-axes", meth("scatter_add", X0, 0, X1, X2),
     [In((4, S), "- -", NONE, value=torch.zeros(4, S)), In((B, S), "b s", TOKEN, value=torch.randint(0, 4, (B, S))), In((B, S), "b s", TOKEN)],
     fails("one merged token axis at dim 0 expected")),
]

NEW_LIKE = [
    # DeepSeek-V3's key states: kv.new_empty(*kv.shape[:-1], d), filled slice by slice.
    ("new_empty-sizes", meth("new_empty", X0, B, S, 24), [x], out("b s -", TOKEN)),
    ("new_zeros-tuple", meth("new_zeros", X0, (B, S, 2)), [x], out("b s -", TOKEN)),
    ("new_ones-merged", meth("new_ones", X0, (B * S, 3)), [merged], out("bs -", TOKEN)),
    ("new_full", meth("new_full", X0, (B, S, D), 1.0), [x], out("b s -", TOKEN)),
    ("new_empty-other-length", meth("new_empty", X0, B, S + 1, D), [x], fails("do not repeat the token axes")),
    ("new_zeros-other-rank", meth("new_zeros", X0, (B * S, D)), [x], fails("do not repeat the token axes")),
]

SLICE_SCATTER = [
    ("features", fn(torch.slice_scatter, X0, X1, -1, 0, 2), [x, In((B, S, 2), "b s -", TOKEN)], out("b s -", TOKEN)),
    ("method", meth("slice_scatter", X0, X1, 2, 2, None), [x, In((B, S, D - 2), "b s -", TOKEN)], out("b s -", TOKEN)),
    ("along-s", fn(torch.slice_scatter, X0, X1, 1, 0, 2), [x, In((B, 2, D), "b - -", TOKEN)], fails("slice_scatter along a token axis")),
    ("constant-src", fn(torch.slice_scatter, X0, X1, -1, 0, 2), [x, In((B, S, 2), "- - -", NONE)],
     fails("combines token and non-token values")),
]

SOFTMAX = [
    ("F.softmax", fn(F.softmax, X0, -1), [x], out("b s -", TOKEN)),
    ("F.log_softmax", fn(F.log_softmax, X0, dim=-1), [x], out("b s -", TOKEN)),
    ("torch.softmax", fn(torch.softmax, X0, 2), [x], out("b s -", TOKEN)),
    ("torch.log_softmax", fn(torch.log_softmax, X0, -1), [x], out("b s -", TOKEN)),
    ("softmax-method", meth("softmax", X0, -1), [x], out("b s -", TOKEN)),
    ("log_softmax-method", meth("log_softmax", X0, dim=-1), [x], out("b s -", TOKEN)),
    ("along-s", fn(F.softmax, X0, 1), [x], fails("softmax along a token axis")),
    ("along-s-last", meth("softmax", X0, -1), [x_bds], fails("softmax along a token axis")),
]

NORMS = [
    ("F.layer_norm", fn(F.layer_norm, X0, (D,)), [x], out("b s -", TOKEN)),
    ("F.rms_norm", fn(F.rms_norm, X0, (D,), X1), [x, w], out("b s -", TOKEN)),
    ("torch.layer_norm", fn(torch.layer_norm, X0, [D]), [x], out("b s -", TOKEN)),
    ("torch.rms_norm", fn(torch.rms_norm, X0, [D]), [x], out("b s -", TOKEN)),
    ("over-s", fn(F.layer_norm, X0, (S, D)), [x], fails("normalisation over a token axis")),
    ("over-s-last", fn(F.rms_norm, X0, (S,)), [x_bds], fails("normalisation over a token axis")),
]

COUPLING = [
    ("F.batch_norm", fn(F.batch_norm, X0, X1, X2, training=True), [x_bds, In((D,), "-", NONE), In((D,), "-", NONE, value=torch.ones(D))],
     couples("batch_norm mixes values across the batch")),
    ("torch.batch_norm", fn(torch.batch_norm, X0, None, None, X1, X2, False, 0.1, 1e-5, False),
     [x_bds, In((D,), "-", NONE), In((D,), "-", NONE, value=torch.ones(D))], couples("batch_norm mixes values across the batch")),
    ("F.instance_norm", fn(F.instance_norm, X0), [x_bds], couples("instance_norm mixes values along the sequence")),
]

DROPOUT = [
    ("p0", fn(F.dropout, X0, 0.0), [x], out("b s -", TOKEN)),
    ("eval", fn(F.dropout, X0, p=0.1, training=False), [x], out("b s -", TOKEN)),
    ("keeps-shift", fn(torch.dropout, X0, 0.1, False), [In((B, S - 1, D), "b s -", TOKEN, shift=1, slen=S - 1)],
     out("b s -", TOKEN, shift=1, slen=S - 1)),
    ("training", fn(F.dropout, X0, 0.1, True), [x], couples("dropout p=0.1 in training mode draws different masks")),
    ("training-default", fn(F.dropout, X0), [x], couples("dropout p=0.5 in training mode")),
    ("torch.dropout-training", fn(torch.dropout, X0, 0.2, True), [x], couples("dropout p=0.2 in training mode")),
]

CUMULATIVE = [
    ("cumsum-features", fn(torch.cumsum, X0, -1), [x], out("b s -", TOKEN)),
    ("cumprod-features", fn(torch.cumprod, X0, dim=2), [x], out("b s -", TOKEN)),
    ("cumsum-method-features", meth("cumsum", X0, -1), [x], out("b s -", TOKEN)),
    ("cumprod-method-features", meth("cumprod", X0, 2), [x], out("b s -", TOKEN)),
    ("cumsum-along-s", fn(torch.cumsum, X0, 1), [x], couples("cumulative sum along the sequence axis")),
    ("cumsum-method-along-s", meth("cumsum", X0, dim=-1), [x_bds], couples("cumulative sum along the sequence axis")),
    ("cumprod-along-bs", meth("cumprod", X0, 0), [merged], couples("cumulative sum along the sequence axis")),
    # Along the batch axis the rows stay apart.
    ("cumsum-along-b", fn(torch.cumsum, X0, 0), [x], out("b s -", TOKEN)),
    # MoE dispatch values in expert-sorted order (tag r): a running sum over them mixes tokens.
    ("cumsum-along-expert-order", fn(torch.cumsum, X0, 0), [In((B * S * 2, D), "r -", Kind.ROUTED)],
     couples("cumulative sum along the sequence axis")),
]

VIEW = [
    ("merge-b-s", meth("view", X0, B * S, D), [x], out("bs -", TOKEN)),
    ("split-bs", meth("view", X0, B, S, D), [merged], out("b s -", TOKEN)),
    ("split-bs-after-shift", meth("reshape", X0, B, S - 1, D), [In(((S - 1) * B, D), "bs -", TOKEN, slen=S - 1)],
     out("b s -", TOKEN)),
    ("heads", meth("view", X0, B, S, 2, D // 2), [x], out("b s - -", TOKEN)),
    ("reshape-heads-back", meth("reshape", X0, B, S, D), [In((B, S, 2, D // 2), "b s - -", TOKEN)], out("b s -", TOKEN)),
    ("torch.reshape", fn(torch.reshape, X0, (B * S, D)), [x], out("bs -", TOKEN)),
    ("flatten-b-s", meth("flatten", X0, 0, 1), [x], out("bs -", TOKEN)),
    ("torch.flatten", fn(torch.flatten, X0, 0, 1), [x], out("bs -", TOKEN)),
    ("unflatten", meth("unflatten", X0, 0, (B, S)), [merged], out("b s -", TOKEN)),
    ("unit-dims", meth("view", X0, B, 1, S, D), [x], out("b - s -", TOKEN)),
    # The sequence axis merged with the features (s-major) and split back.
    ("merge-s-features", meth("view", X0, B, S * D), [x], out("b s", TOKEN)),
    ("split-s-features", meth("view", X0, B, S, D), [In((B, S * D), "b s", TOKEN)], out("b s -", TOKEN)),
    # A merged axis of k entries per token split into [tokens * g, k / g]: the first dim keeps whole tokens.
    ("split-bs-per-token", meth("view", X0, B * S, 2, D), [In((B * S * 2, D), "bs -", TOKEN)], out("bs - -", TOKEN)),
    ("split-bs-two-per-token", meth("view", X0, B * S * 2, 2), [In((B * S * 4,), "bs", TOKEN)], out("bs -", TOKEN)),
    ("split-s-two-per-token", meth("view", X0, B, 2 * S, 2), [In((B, 4 * S), "b s", TOKEN)], out("b s -", TOKEN)),
    ("split-bs-across-tokens", meth("view", X0, 2, B * S, D), [In((B * S * 2, D), "bs -", TOKEN)],
     fails("reshape [24, 8] -> [2, 12, 8] that splits a token axis")),
    ("split-s", meth("view", X0, B, 2, S // 2, D), [x], fails("reshape [3, 4, 8] -> [3, 2, 2, 8] that splits a token axis")),
    ("split-bs-wrong-slen", meth("view", X0, B, S, D), [In((B * S, D), "bs -", TOKEN, slen=S // 2)],
     fails("reshape splitting the sequence axis")),
    ("merge-s-b", meth("view", X0, S * B, D), [In((S, B, D), "s b -", TOKEN)], fails("reshape merging ['s', 'b']")),
    ("features-ahead", meth("reshape", X0, D * B, S), [In((D, B, S), "- b s", TOKEN)],
     fails("reshape that merges feature dims ahead of a token axis")),
    # A batch of one row (a remove-padding batch [1, total]): the size-1 batch axis keeps its tag.
    ("one-row-heads-back", meth("reshape", X0, 1, S, D), [In((1, S, 2, D // 2), "b s - -", TOKEN)], out("b s -", TOKEN)),
    ("one-row-merge", meth("view", X0, S, D), [In((1, S, D), "b s -", TOKEN)], out("bs -", TOKEN)),
]

MOVE = [
    ("transpose", meth("transpose", X0, 1, 2), [x], out("b - s", TOKEN)),
    ("torch.transpose", fn(torch.transpose, X0, 0, 1), [x], out("s b -", TOKEN)),
    ("permute-args", meth("permute", X0, 0, 2, 1), [x], out("b - s", TOKEN)),
    ("permute-tuple", meth("permute", X0, (2, 0, 1)), [x], out("- b s", TOKEN)),
    ("torch.permute", fn(torch.permute, X0, (1, 0, 2)), [x], out("s b -", TOKEN)),
    ("unsqueeze", meth("unsqueeze", X0, 1), [x], out("b - s -", TOKEN)),
    ("torch.unsqueeze", fn(torch.unsqueeze, X0, -1), [x], out("b s - -", TOKEN)),
    ("squeeze-dim", meth("squeeze", X0, -1), [mask], out("b s", TOKEN)),
    ("squeeze-all", meth("squeeze", X0), [In((B, 1, S, 1), "b - s -", TOKEN)], out("b s", TOKEN)),
    ("torch.squeeze-not-1", fn(torch.squeeze, X0, 2), [x], out("b s -", TOKEN)),
    ("movedim", meth("movedim", X0, 2, 0), [x], out("- b s", TOKEN)),
    ("torch.movedim", fn(torch.movedim, X0, 1, 2), [x], out("b - s", TOKEN)),
    ("t", meth("t", X0), [ids], out("s b", TOKEN)),
    ("expand-features", meth("expand", X0, B, S, D), [mask], out("b s -", TOKEN)),
    # A column value expanded over the batch gains the batch axis; so does a constant (BCAST).
    ("expand-column", meth("expand", X0, B, -1, -1), [col], out("b s -", TOKEN)),
    ("expand-constant", meth("expand", X0, B, D), [In((1, D), "- -", NONE)], out("b -", BCAST)),
    ("expand-new-dims", meth("expand", X0, 2, B, S, D), [x], out("- b s -", TOKEN)),
    ("expand-size-node", meth("expand", X0, X1, -1, -1), [col, In(value=B)], out("b s -", TOKEN)),
]

GETITEM = [
    ("drop-last", fn(operator.getitem, X0, (slice(None), slice(None, -1))), [In((B, S, D), "b s -", TOKEN, slen=S)],
     out("b s -", TOKEN, shift=0, slen=S - 1)),
    ("next-tokens", fn(operator.getitem, X0, (slice(None), slice(1, None))), [In((B, S), "b s", TOKEN, slen=S)],
     out("b s", TOKEN, shift=1, slen=S - 1)),
    ("full-slice", fn(operator.getitem, X0, (slice(None), slice(0, S), Ellipsis)), [In((B, S, D), "b s -", TOKEN, slen=S)],
     out("b s -", TOKEN, slen=S)),
    ("feature-index", fn(operator.getitem, X0, (Ellipsis, 0)), [x], out("b s", TOKEN)),
    ("feature-slice", fn(operator.getitem, X0, (Ellipsis, slice(None, D // 2))), [x], out("b s -", TOKEN)),
    ("new-axis", fn(operator.getitem, X0, (slice(None), None, slice(None))), [x], out("b - s -", TOKEN)),
    ("gather-rows-of-constant", fn(operator.getitem, X0, X1), [table, ids], out("b s -", TOKEN)),
    ("split-element", fn(operator.getitem, X0, 1),
     [In(tags="b s -", kind=TOKEN, value=(torch.randn(B, S, D // 2), torch.randn(B, S, D // 2)))], out("b s -", TOKEN)),
    ("single-position", fn(operator.getitem, X0, (slice(None), 0)), [x], fails("indexing a single position of a token axis")),
    ("single-row", fn(operator.getitem, X0, 0), [x], fails("indexing a single position of a token axis")),
    ("strided", fn(operator.getitem, X0, (slice(None), slice(None, None, 2))), [In((B, S, D), "b s -", TOKEN, slen=S)],
     fails("strided slice along a token axis")),
    ("two-columns-off", fn(operator.getitem, X0, (slice(None), slice(1, -1))), [In((B, S, D), "b s -", TOKEN, slen=S)],
     fails("slice along a token axis (other than one next-token shift)")),
    ("shift-twice", fn(operator.getitem, X0, (slice(None), slice(1, None))),
     [In((B, S - 1, D), "b s -", TOKEN, shift=1, slen=S - 1)], fails("other than one next-token shift")),
    ("slice-rows", fn(operator.getitem, X0, slice(1, None)), [x], fails("slice along a token axis")),
    ("advanced", fn(operator.getitem, X0, X1), [x, In((B, S), "b s", TOKEN, value=torch.randint(0, B, (B, S)))],
     fails("advanced indexing of a token value")),
]

CAT = [
    ("features", fn(torch.cat, [X0, X1], -1), [x, y], out("b s -", TOKEN)),
    ("features-kwarg", fn(torch.cat, (X0, X1), dim=2), [x, y], out("b s -", TOKEN)),
    ("skips-empty", fn(torch.cat, [X0, X1], 1), [x, In((0,), "-", NONE)], out("b s -", TOKEN)),
    ("along-s", fn(torch.cat, [X0, X1], 1), [x, y], fails("concatenation along a token axis")),
    ("along-b", fn(torch.cat, [X0, X1]), [x, y], fails("concatenation along a token axis")),
    ("with-constant", fn(torch.cat, [X0, X1], -1), [x, In((B, S, D), "- - -", NONE)],
     fails("combines token and non-token values along one axis")),
    ("different-axes", fn(torch.cat, [X0, X1], -1), [In((S, S, D), "b s -", TOKEN), In((S, S, D), "s b -", TOKEN)],
     fails("combines values with different token axes")),
]

STACK = [
    ("front", fn(torch.stack, [X0, X1]), [x, y], out("- b s -", TOKEN)),
    ("last", fn(torch.stack, [X0, X1], dim=-1), [x, y], out("b s - -", TOKEN)),
    ("with-constant", fn(torch.stack, [X0, X1], 2), [x, In((B, S, D), "- - -", NONE)],
     fails("combines token and non-token values along one axis")),
]

SPLIT = [
    ("split-method", meth("split", X0, 2, -1), [x], out("b s -", TOKEN)),
    ("torch.split", fn(torch.split, X0, [2, 6], dim=2), [x], out("b s -", TOKEN)),
    ("chunk-method", meth("chunk", X0, 2, -1), [x], out("b s -", TOKEN)),
    ("torch.chunk", fn(torch.chunk, X0, 4, 2), [x], out("b s -", TOKEN)),
    ("unbind-method", meth("unbind", X0, -1), [x], out("b s", TOKEN)),
    ("torch.unbind", fn(torch.unbind, X0, 2), [x], out("b s", TOKEN)),
    ("split-along-s", meth("split", X0, 2, 1), [x], fails("split along a token axis")),
    ("torch.chunk-along-b", fn(torch.chunk, X0, 3), [x], fails("split along a token axis")),
    ("unbind-along-s", meth("unbind", X0, 1), [x], fails("split along a token axis")),
]

# x.size() of a token value: sizes of the original layout, no token axes (the rewrite keeps them as numbers).
SIZE = [
    ("size", meth("size", X0), [x], out("", NONE)),
    ("size-of-s", meth("size", X0, 1), [x], out("", NONE)),
    ("size-dim-keyword", meth("size", X0, dim=0), [merged], out("", NONE)),
    ("size-of-column", meth("size", X0, -1), [col], out("", NONE)),
]

TABLES = {
    "pointwise": _pointwise_rows(),
    "like": LIKE,
    "linear": LINEAR,
    "embedding": EMBEDDING,
    "matmul": MATMUL,
    "reductions": REDUCTIONS,
    "scatter": SCATTER,
    "new_like": NEW_LIKE,
    "slice_scatter": SLICE_SCATTER,
    "softmax": SOFTMAX,
    "norms": NORMS,
    "coupling": COUPLING,
    "dropout": DROPOUT,
    "cumulative": CUMULATIVE,
    "view": VIEW,
    "move": MOVE,
    "getitem": GETITEM,
    "cat": CAT,
    "stack": STACK,
    "split": SPLIT,
    "size": SIZE,
}


def _values(row):
    """A row's ``(id, op, inputs, expected)``, of a plain row or of one in ``pytest.param`` (with marks)."""
    return row.values if hasattr(row, "marks") else row


def _params():
    for table, rows in TABLES.items():
        for row in rows:
            values = _values(row)
            yield pytest.param(*values[1:], id=f"{table}:{values[0]}", marks=getattr(row, "marks", ()))


@pytest.mark.parametrize("op, inputs, expected", list(_params()))
def test_rule(op, inputs, expected):
    if isinstance(expected, Fails):
        with pytest.raises(expected.exc) as e:
            apply_rule(op, inputs)
        assert expected.match in str(e.value)
    elif isinstance(expected, Weighs):
        got = apply_rule(op, inputs)
        assert (got.kind, got.tags) == (NONE, tags(expected.spec)) and got.weighted is not None, got
        assert (got.weighted.op, got.weighted.operand.name) == (expected.op, f"x{expected.operand}")
    else:
        assert apply_rule(op, inputs) == expected


def _all_rows():
    from .test_moe_rules import MOE_TABLES  # the MoE routing rules' rows (analysis/moe_rules.py)

    return [row for tables in (TABLES, MOE_TABLES) for rows in tables.values() for row in rows]


def test_every_rule_key_has_a_row():
    covered = {_values(row)[1].key() for row in _all_rows()}
    missing = sorted(f"{op} {getattr(target, '__name__', target)}" for op, target in RULES if (op, target) not in covered)
    assert not missing, f"registered token-axis rules without a table row: {missing}"


def test_every_row_targets_a_registered_rule():
    keys = [_values(row)[1].key() for row in _all_rows()]
    assert [k for k in keys if k not in RULES] == []


def test_rule_for_unregistered():
    graph = fx.Graph()
    a = graph.placeholder("a")
    assert rule_for(a) is None
    assert rule_for(graph.call_function(torch.flip, (a,))) is None
    assert rule_for(graph.call_method("flip", (a,))) is None
    assert rule_for(graph.call_module("linear", (a,))) is None  # a module named like a method
    assert rule_for(graph.call_method("view", (a, 1))) is not None


def _analyze(build):
    """``analyze_token_axes`` of a graph over ``input_ids`` of shape [B, S] that ``build(graph, ids)`` completes."""
    graph = fx.Graph()
    ids = graph.placeholder("input_ids")
    ids.meta["example_value"] = torch.randint(0, 10, (B, S))
    result = build(graph, ids)
    graph.output(result)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    return analyze_token_axes(gm, TokenInputs((TokenInput(Role.INPUT_IDS, ids),)), attention=[]), result


def test_driver_no_rule():
    def build(graph, ids):
        n = graph.call_function(torch.flip, (ids, (1,)))
        n.meta["example_value"] = torch.flip(ids.meta["example_value"], (1,))
        return n

    axes, node = _analyze(build)
    assert axes.info[node].kind is Kind.ORIG
    assert axes.info[node].cause == f"{node.name}: no token-axis rule for flip"
    assert axes.refusals == ()


def test_driver_coupling_refuses_and_shift_is_inherited():
    def build(graph, ids):
        nxt = graph.call_function(operator.getitem, (ids, (slice(None), slice(1, None))))
        nxt.meta["example_value"] = ids.meta["example_value"][:, 1:]
        f = graph.call_method("float", (nxt,))
        f.meta["example_value"] = nxt.meta["example_value"].float()
        d = graph.call_function(F.dropout, (f, 0.1, True))
        d.meta["example_value"] = f.meta["example_value"]
        return (f, d)

    axes, (f, d) = _analyze(build)
    # Of the ids alone: the rewrite computes it in the original layout where that layout needs it.
    assert axes.info[f] == NodeInfo(Kind.TOKEN, ("b", "s"), shift=1, slen=S - 1, from_inputs=True)
    assert axes.info[d].kind is Kind.ORIG and not axes.info[d].from_inputs  # a random draw is never computed twice
    assert axes.refusals == (f"{d.name}: dropout p=0.1 in training mode draws different masks for the copies of a shared prompt",)


def test_driver_size_of_a_token_value_is_a_number_not_a_refusal():
    """``ids.size(1)`` (an int, not a tensor) and ``ids.size()`` read off a token value give NONE: the view they
    shape keeps its token axes, and the value divided by the size stays per-token."""

    def build(graph, ids):
        ev = ids.meta["example_value"]
        whole = graph.call_method("size", (ids,))
        whole.meta["example_value"] = ev.size()
        cols = graph.call_method("size", (ids, 1))
        cols.meta["example_value"] = ev.size(1)
        flat = graph.call_method("view", (ids, whole))
        flat.meta["example_value"] = ev.view(ev.size())
        scaled = graph.call_function(operator.truediv, (flat, cols))
        scaled.meta["example_value"] = flat.meta["example_value"] / ev.size(1)
        return (whole, cols, scaled)

    axes, (whole, cols, scaled) = _analyze(build)
    assert axes.info[whole].kind is Kind.NONE and axes.info[cols].kind is Kind.NONE
    assert (axes.info[scaled].kind, axes.info[scaled].tags) == (Kind.TOKEN, ("b", "s"))


def test_driver_arange_of_a_batch_as_long_as_its_sequence():
    """With B == S a static graph's ``arange(S)`` (the column index) and ``arange(B)`` (a row index) are one op,
    ``arange(n)``. It is a column value: lined up with the sequence axis the packed stream reads entry c at column
    c, as the original does whatever it was written for; lined up with the batch axis (a row index) it conflicts,
    and the value is computed in the original layout rather than packed as a column."""
    n = 5
    graph = fx.Graph()
    ids = graph.placeholder("input_ids")
    ids.meta["example_value"] = torch.randint(0, 10, (n, n))

    def op(target, *args, method=False):
        node = (graph.call_method if method else graph.call_function)(target, args)
        vals = [a.meta["example_value"] if isinstance(a, fx.Node) else a for a in args]
        node.meta["example_value"] = getattr(vals[0], target)(*vals[1:]) if method else target(*vals)
        return node

    idx = op(torch.arange, n)
    f = op("float", ids, method=True)
    by_column = op(operator.add, f, idx)  # f[b, s] + s
    rows = op(operator.getitem, idx, (slice(None), None))
    by_row = op(operator.add, f, rows)  # f[b, s] + b
    rows_expanded = op("expand", rows, n, n, method=True)
    by_expanded_row = op(operator.add, f, rows_expanded)
    graph.output((by_column, by_row, by_expanded_row))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    axes = analyze_token_axes(gm, TokenInputs((TokenInput(Role.INPUT_IDS, ids),)), attention=[])
    assert (axes.info[idx].kind, axes.info[idx].tags) == (Kind.COLUMN, ("s",))
    assert (axes.info[by_column].kind, axes.info[by_column].tags) == (Kind.TOKEN, ("b", "s"))
    assert axes.info[by_row].kind is Kind.ORIG and "broadcasts token axis" in axes.info[by_row].cause
    assert axes.info[by_expanded_row].kind is Kind.ORIG
    assert axes.refusals == ()
