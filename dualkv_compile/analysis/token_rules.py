"""Per-op token-axis rules: the ones that do not move dimensions (registered in ``rule_registry``).

The registry and the contract of a rule are in ``rule_registry``. The driver
(``token_axes``) calls a rule only for a node with a TOKEN or COLUMN input
and no ORIG input, and sets a result's shift and sequence length from its
operands where the rule leaves them unset.

Here: pointwise ops broadcast tags (``polar`` among them: complex values are
per-token values like any other); ``*_like`` (not random), dropout off and
``new_empty``-style buffers keep them; linear, embedding and matmul keep the
token axes of their token operand; reductions (``min``/``max`` with a dim
or none too; with a tensor they are elementwise), softmax and norms over
feature dimensions drop or keep them; sums over every token axis are weighted by
multiplicity (``token_reductions``); ops that couple tokens (batch_norm,
instance_norm, dropout in training, random draws shaped like a token value,
cumsum along the sequence) refuse the graph. The rules that move dimensions
are in ``shape_rules``; those of MoE routing and expert dispatch in ``moe_rules``.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..graph.meta import ev as _ev
from .node_info import Coupling, Kind, NodeInfo, RuleFailed, arg, hint, kind_of, op_name, reduced_dims, shape_of
from .rule_registry import token_rule
from .token_reductions import weighted_reduction, weighted_scatter

__all__ = [
    "POINTWISE_FUNCS", "POINTWISE_METHODS", "REDUCE_FUNCS", "REDUCE_METHODS", "SOFTMAX_LIKE", "SOFTMAX_METHODS",
]

POINTWISE_FUNCS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.pow,
    operator.neg, operator.pos, operator.and_, operator.or_, operator.xor, operator.invert, operator.mod,
    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
    torch.add, torch.sub, torch.mul, torch.div, torch.pow, torch.rsqrt, torch.sqrt, torch.exp, torch.log,
    torch.tanh, torch.sigmoid, torch.sin, torch.cos, torch.neg, torch.abs, torch.where, torch.clamp,
    torch.maximum, torch.minimum, torch.erf, torch.reciprocal, torch.square, torch.masked_fill,
    F.silu, F.gelu, F.relu, F.tanh, F.sigmoid, F.softplus, F.mish, F.leaky_relu, torch._C._nn.gelu,
    torch.nn.functional.hardtanh, torch.log1p, torch.expm1, torch.sign, torch.logical_and, torch.logical_or,
    torch.logical_not, torch.nan_to_num, torch.gather,
    torch.polar,  # complex rotary tables (DeepSeek-V2, Llama 4): polar(abs, angle), elementwise
    torch.floor, torch.ceil, torch.round, torch.trunc,  # Llama 4's attention temperature: floor of positions
    torch.clone, torch.detach,  # Zamba2 keeps torch.clone(inputs_embeds) for its shared attention block
}
POINTWISE_METHODS = {
    "to", "float", "half", "bfloat16", "double", "type_as", "contiguous", "clone", "detach", "pow", "rsqrt",
    "sqrt", "exp", "log", "sin", "cos", "neg", "abs", "sigmoid", "tanh", "mul", "add", "sub", "div", "clamp",
    "type", "masked_fill", "requires_grad_", "__and__", "__or__", "__invert__", "long", "int", "bool",
    "log1p", "expm1", "square", "reciprocal", "float_power", "nan_to_num", "where", "fill_", "zero_", "gather",
    "floor", "ceil", "round", "trunc",
    # Comparisons: torch 2.12's Dynamo records ``ids == x`` as ``call_method __eq__`` (2.13: ``operator.eq``).
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "eq", "ne", "lt", "le", "gt", "ge",
}
REDUCE_METHODS = {"mean", "sum", "amax", "amin", "norm", "var", "std", "logsumexp", "prod"}
REDUCE_FUNCS = {torch.mean, torch.sum, torch.amax, torch.amin, torch.norm, torch.var, torch.std, torch.logsumexp}
SOFTMAX_LIKE = {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax}
SOFTMAX_METHODS = {"softmax", "log_softmax"}
_LIKE_FUNCS = {torch.ones_like, torch.zeros_like, torch.empty_like, torch.full_like}
_RANDOM_LIKE = {torch.rand_like, torch.randn_like, torch.randint_like}
_COUPLING_FUNCS = {
    F.batch_norm: "batch_norm mixes values across the batch",
    torch.batch_norm: "batch_norm mixes values across the batch",
    F.instance_norm: "instance_norm mixes values along the sequence",
}


@token_rule(*_COUPLING_FUNCS)
def _coupling(node, info, B, S) -> NodeInfo:
    raise Coupling(_COUPLING_FUNCS[node.target])


@token_rule(F.dropout, torch.dropout)
def _dropout(node, info, B, S) -> NodeInfo:
    p, training = arg(node, 1, "p", 0.5), arg(node, 2, "training", True)
    if p != 0 and training is not False:
        raise Coupling(f"dropout p={p} in training mode draws different masks for the copies of a shared prompt")
    return _same(node, info)


@token_rule(torch.cumsum, torch.cumprod, methods=("cumsum", "cumprod"))
def _cumulative(node, info, B, S) -> NodeInfo:
    src = node.args[0]
    dim = arg(node, 1, "dim")
    t = info[src].tags
    if isinstance(dim, int) and t and t[dim % len(t)] in ("s", "bs", "r"):  # "r": the experts' sorted order
        raise Coupling("cumulative sum along the sequence axis couples tokens beyond causal attention")
    return _same(node, info)


def _same(node, info) -> NodeInfo:
    i = info[node.args[0]]
    return NodeInfo(kind_of(i.tags), i.tags, shift=i.shift, slen=i.slen)


@token_rule(*_LIKE_FUNCS)
def _like(node, info, B, S) -> NodeInfo:
    return _same(node, info)


@token_rule(*_RANDOM_LIKE)
def _random_like(node, info, B, S) -> NodeInfo:
    """Noise shaped like a token value (router jitter, noise injection): the original draws for every copy of a
    shared prompt, the packed stream once for all of them, as with dropout. A column value's noise is drawn in
    the original layout and gathered, as the original reads it."""
    if info[node.args[0]].kind is Kind.TOKEN:
        raise Coupling(f"{node.target.__name__} draws different values for the copies of a shared prompt")
    return _same(node, info)


@token_rule(methods=("new_empty", "new_zeros", "new_ones", "new_full"))
def _new_like(node, info, B, S) -> NodeInfo:
    """``x.new_empty(*sizes)``: a buffer whose sizes repeat ``x``'s at its token axes (DeepSeek's key states,
    ``kv.new_empty(*kv.shape[:-1], d)``) has those axes; its other dims may differ."""
    t = info[node.args[0]].tags
    src, out = _ev(node.args[0]), _ev(node)
    if out.dim() != src.dim() or any(tag is not None and hint(out.shape[d]) != hint(src.shape[d]) for d, tag in enumerate(t)):
        raise RuleFailed(f"{node.target} whose sizes do not repeat the token axes of its tensor")
    return NodeInfo(kind_of(t), t)


@token_rule(*POINTWISE_FUNCS, methods=POINTWISE_METHODS)
def _broadcast(node, info, B, S) -> NodeInfo:
    ev = _ev(node)
    if not isinstance(ev, torch.Tensor):
        raise RuleFailed("pointwise op without a tensor result")
    n = ev.dim()
    if node.target in ("gather", torch.gather):
        dim = arg(node, 1, "dim")
        if not isinstance(dim, int) or info[node.args[0]].tags[dim % n] is not None:
            raise RuleFailed("gather along a token axis")
    tags: list[Optional[str]] = [None] * n
    for a in node.all_input_nodes:
        a_ev = _ev(a)
        if not isinstance(a_ev, torch.Tensor):
            continue
        at = info[a].tags
        off = n - a_ev.dim()
        for d in range(a_ev.dim()):
            tag = at[d]
            if tag is None:
                continue
            if tags[off + d] not in (None, tag):
                raise RuleFailed(f"broadcasts token axis {tags[off + d]} against {tag}")
            tags[off + d] = tag
    # A NONE operand whose dimension has the length of a token axis would no
    # longer line up once that axis is packed.
    for a in node.all_input_nodes:
        a_ev = _ev(a)
        if not isinstance(a_ev, torch.Tensor) or info[a].kind is not Kind.NONE:
            continue
        off = n - a_ev.dim()
        for d in range(a_ev.dim()):
            if tags[off + d] is not None and hint(a_ev.shape[d]) > 1:
                raise RuleFailed(f"combines a constant of length {hint(a_ev.shape[d])} with the {tags[off + d]} axis")
    t = tuple(tags)
    return NodeInfo(kind_of(t), t)


@token_rule(F.linear, torch._C._nn.linear)
def _linear(node, info, B, S) -> NodeInfo:
    x, w = node.args[0], node.args[1]
    b = arg(node, 2, "bias")
    if info[w].kind is not Kind.NONE or (isinstance(b, fx.Node) and info[b].kind is not Kind.NONE):
        raise RuleFailed("linear with a token-dependent weight")
    t = info[x].tags
    if t[-1] is not None:
        raise RuleFailed("linear over a token axis")
    return NodeInfo(kind_of(t), t)


@token_rule(F.embedding, torch.embedding)
def _embedding(node, info, B, S) -> NodeInfo:
    if node.target is torch.embedding:  # ATen's order: (weight, indices, ...)
        w, ids = arg(node, 0, "weight"), arg(node, 1, "indices")
    else:
        ids, w = arg(node, 0, "input"), arg(node, 1, "weight")
    if info[w].kind is not Kind.NONE:
        raise RuleFailed("embedding with a token-dependent table")
    t = info[ids].tags + (None,)
    return NodeInfo(kind_of(t), t)


@token_rule(torch.matmul, operator.matmul, torch.bmm)
def _matmul(node, info, B, S) -> NodeInfo:
    """``[..., M, K] @ [..., K, N]``: batch dims broadcast, M keeps a's tag, N b's; K must carry none.

    Covers projections (a token value times a weight) and rotary tables built
    as ``inv_freq[:, None] @ positions[None, :]`` (a column value on the right).
    """
    a, b = node.args[:2]
    ta, tb = info[a].tags, info[b].tags
    if len(ta) < 2 or len(tb) < 2:
        raise RuleFailed("matmul with a vector operand")
    if ta[-1] is not None or tb[-2] is not None:
        raise RuleFailed("matmul that contracts over a token axis")
    n = max(len(ta), len(tb))
    batch_a = (None,) * (n - len(ta)) + ta[:-2]
    batch_b = (None,) * (n - len(tb)) + tb[:-2]
    batch = []
    for x, y in zip(batch_a, batch_b):
        if x is not None and y is not None and x != y:
            raise RuleFailed("matmul broadcasting different token axes")
        batch.append(x if x is not None else y)
    for x, xt in ((a, batch_a), (b, batch_b)):
        if info[x].kind is Kind.NONE:
            shape = [1] * (n - len(_ev(x).shape)) + shape_of(x)
            if any(tag is not None and shape[d] > 1 for d, tag in enumerate(batch)):
                raise RuleFailed("matmul broadcasting a constant over a token axis")
    t = tuple(batch) + (ta[-2], tb[-1])
    if sum(tag is not None for tag in t) > sum(tag is not None for tag in ta + tb) or (ta[-2] is not None and tb[-1] is not None):
        raise RuleFailed("matmul between two token values (attention-like)")
    return NodeInfo(kind_of(t), t)


@token_rule(*REDUCE_FUNCS, methods=REDUCE_METHODS)
def _reduce(node, info, B, S) -> NodeInfo:
    src = node.args[0]
    t = list(info[src].tags)
    n = len(t)
    # norm takes p before dim: x.norm(p, dim, keepdim), torch.norm(x, p, dim, keepdim).
    first = 2 if node.target in ("norm", torch.norm) else 1
    dim = arg(node, first, "dim")
    keepdim = arg(node, first + 1, "keepdim", False)
    dims = reduced_dims(dim, n)
    if any(t[d] is not None for d in dims):
        return weighted_reduction(node, info, B, S)  # over tokens: a weighted sum on the packed stream, or RuleFailed
    out = tuple(None if d in dims else tag for d, tag in enumerate(t)) if keepdim else tuple(tag for d, tag in enumerate(t) if d not in dims)
    return NodeInfo(kind_of(out), out)


@token_rule(torch.min, torch.max, methods=("min", "max"))
def _min_max(node, info, B, S) -> NodeInfo:
    """``min``/``max`` in their three forms: with a tensor ``other``, elementwise (xIELU's ``torch.min(x, eps)``,
    as ``minimum``); with ``dim``, a reduction giving (values, indices), both with the tags of the reduced value;
    with neither, a reduction over every dim. Over a token axis neither reduction is a sum the packed stream
    can weight: computed in the original layout (``RuleFailed``), as ``amax`` is."""
    second = arg(node, 1, "dim", node.kwargs.get("other"))
    if isinstance(second, fx.Node) and isinstance(_ev(second), torch.Tensor):
        return _broadcast(node, info, B, S)
    if not (second is None or isinstance(second, int)) or set(node.kwargs) - {"dim", "keepdim"}:
        raise RuleFailed(f"{op_name(node)} with arguments this rule does not read")
    t = info[node.args[0]].tags
    dim = arg(node, 1, "dim")
    dims = reduced_dims(dim, len(t))
    if any(t[d] is not None for d in dims):
        raise RuleFailed(f"{op_name(node)} along a token axis")
    keepdim = dim is not None and arg(node, 2, "keepdim", False)
    out = tuple(None if d in dims else tag for d, tag in enumerate(t)) if keepdim else tuple(tag for d, tag in enumerate(t) if d not in dims)
    return NodeInfo(kind_of(out), out)


@token_rule(torch.scatter_add, torch.index_add, methods=("scatter_add", "index_add"))
def _scatter_add(node, info, B, S) -> NodeInfo:
    return weighted_scatter(node, info, B, S)  # expert counts summed over tokens, or RuleFailed


@token_rule(*SOFTMAX_LIKE, methods=SOFTMAX_METHODS)
def _softmax(node, info, B, S) -> NodeInfo:
    t = info[node.args[0]].tags
    dim = arg(node, 1, "dim")
    if dim is None or t[dim % len(t)] is not None:
        raise RuleFailed("softmax along a token axis")
    return NodeInfo(kind_of(t), t)


@token_rule(F.layer_norm, F.rms_norm, torch.layer_norm, torch.rms_norm)
def _norm(node, info, B, S) -> NodeInfo:
    t = info[node.args[0]].tags
    shape = node.args[1]
    if any(x is not None for x in t[len(t) - len(shape):]):
        raise RuleFailed("normalisation over a token axis")
    return NodeInfo(kind_of(t), t)


