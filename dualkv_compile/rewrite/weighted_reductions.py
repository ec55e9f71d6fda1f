"""Rewrite: a reduction over every token axis, on the packed stream, each token weighted by its multiplicity.

Contract
    Input: the packer (``pack_graph._Packer``) and a node whose ``NodeInfo.weighted`` the analysis set
    (``analysis.token_reductions``): ``sum``/``mean`` over dims covering the operand's token axes,
    ``scatter_add``/``index_add`` into a value without token axes, ``histc`` with a fixed range.
    Output: the node's value in the original layout (it has no token axes), computed from the packed
    operand without unpacking it: the operand's entries times ``token_weights`` (how many positions of
    the original layout ``unpack`` fills from each token), then the same reduction; a mean divides by
    the original count of the reduced dims (read off the batch's sizes, static or symbolic). This equals
    the reduction of the unpacked operand (zeros at padding) up to reassociation.
    The node carrying the weighted operand (``args[0]`` is the packed operand) is marked
    ``graph.meta.set_weighted(node, (shift, truncate, merged, leading))`` (``leading``: the token axes are
    the operand's first): ``analysis.padding_reads`` treats it as a
    read of every position, which the runner checks per call (padding must be zeroed by a factor).

Dtypes: the products are formed in at least float32 (bfloat16 entries times counts above 256 would
round) and the result cast to the original's dtype; integer operands are weighted in int64, as
``sum`` of integers is.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..analysis.node_info import arg, reduced_dims, shape_of
from ..graph.meta import ev, set_token_sum, set_weighted
from ..layout.packed_ops import token_weights, weighted_histc
from .packed_shapes import original_dim_size

__all__ = ["emit_weighted"]


def emit_weighted(p, n: fx.Node) -> fx.Node:
    """The original-layout value of ``n`` (see the module docstring); ``p``: the packer."""
    weighted = p.axes.info[n].weighted
    x = weighted.operand
    xi = p.axes.info[x]
    g = p.g
    truncate = xi.shift == 0 and xi.slen == p.S - 1
    merged = "bs" in xi.tags
    leading = xi.tags[:1] == ("bs",) if merged else xi.tags[:2] == ("b", "s")
    ids = p.orig[p.size_ref()]
    w = g.call_function(token_weights, (p.T, p.inp["unpack_index"], p.inp["valid"], ids, xi.shift, truncate))
    d = xi.tags.index("bs" if merged else "s")
    per_token = shape_of(x)[d] // ((p.B if merged else 1) * xi.slen)  # entries per token along d (top-k ids)
    if per_token > 1:
        w = g.call_method("repeat_interleave", (w, per_token))
    view = [1] * len(xi.tags)
    view[d] = -1
    w = g.call_method("view", (w, tuple(view)))
    x_dtype = ev(x).dtype
    wdtype = torch.promote_types(x_dtype, torch.float32) if x_dtype.is_floating_point else torch.long
    w = g.call_method("to", (w, wdtype))
    xp = p.packed_of(x)

    if weighted.op == "histc":
        bins, lo, hi = arg(n, 1, "bins", 100), arg(n, 2, "min", 0), arg(n, 3, "max", 0)
        res = g.call_function(weighted_histc, (xp, w, bins, lo, hi))
        set_weighted(res, (xi.shift, truncate, merged, leading))
        set_token_sum(res, "sum")
        return _cast(g, res, ev(n).dtype, x_dtype)

    prod = g.call_function(operator.mul, (xp, w))
    set_weighted(prod, (xi.shift, truncate, merged, leading))
    if weighted.op in ("scatter_add", "index_add"):
        base, dim, index = n.args[:3]
        prod = _cast(g, prod, x_dtype, wdtype)  # the source must have the base's dtype
        res = g.create_node(n.op, n.target, (p.orig_of(base), dim, p.packed_of(index), prod), name=n.name)
        set_token_sum(res, "accumulate")
        return res

    args = fx.map_arg(tuple(n.args[1:]), p.orig_of)
    kwargs = fx.map_arg(dict(n.kwargs), p.orig_of)
    if weighted.op == "sum":
        res = g.create_node(n.op, n.target, (prod, *args), kwargs, name=n.name)
        set_token_sum(res, "sum")
        return _cast(g, res, ev(n).dtype, kwargs.get("dtype", wdtype))
    # mean: the weighted sum over the same dims, divided by the original count of their entries.
    total = g.call_method("sum", (prod, *args), kwargs)
    set_token_sum(total, "sum")
    count = _original_count(p, n, x, ids, truncate or xi.shift)
    return _cast(g, g.call_function(operator.truediv, (total, count), name=n.name), ev(n).dtype, kwargs.get("dtype", wdtype))


def _original_count(p, n: fx.Node, x: fx.Node, ids: fx.Node, short: bool):
    """The number of entries a mean over ``n``'s dims averages in the original layout (a graph value)."""
    g, xi = p.g, p.axes.info[x]
    dims = sorted(reduced_dims(arg(n, 1, "dim"), len(xi.tags)))
    B = g.call_method("size", (ids, 0))
    cols = g.call_method("size", (ids, 1))
    if short:  # x[:, 1:] or x[:, :-1]: S - 1 columns
        cols = g.call_function(operator.sub, (cols, 1))
    count = 1
    for d in dims:
        size = original_dim_size(p, x, d, B, cols)
        count = size if count == 1 else g.call_function(operator.mul, (count, size))
    return count


def _cast(g: fx.Graph, node: fx.Node, dtype: torch.dtype, have: torch.dtype) -> fx.Node:
    return node if dtype == have else g.call_method("to", (node, dtype))
