"""Rewrite: sizes on the packed stream and in the original layout, for ``pack_graph``.

Contract
    Functions over the packer (``pack_graph._Packer``, called ``p``) while it translates a node.

    ``rewrite_shapes``: the shape arguments of an op that makes a packed value (view, reshape, expand,
    new_empty/zeros/ones/full, unflatten, slices), re-derived from the result's token tags: ``b -> 1``,
    ``s -> T * f``, ``bs -> T * f`` (``f`` entries per token), whatever the original argument was (a constant, a
    symbol, a size read off another value). Slices along a token axis are made full.

    ``emit_original_size``: ``x.size()`` / ``x.size(d)`` of a TOKEN value ``x``, in the original layout, without
    building ``x``'s original form (an ``unpack`` of a ``[B, S, ...]`` value only to read its shape). A size the
    graph's example gives as a constant (static graphs, and sizes a guard specialised) is that constant: the
    graph's guards pin it. A symbolic one is computed from the batch's sizes (``input_ids``, or the ``[B, S]``
    input ``unpack`` is sized by) or, along a dim without a token axis, from the packed value, whose size there is
    the original one.

Why the original sizes and not T: a size is also read as a number (``1 / S``, ``arange(S)`` as the column index, a
mean's count), and there the packed program must read what the original read; the ops that shape a packed value
from a size re-derive its token axes (``rewrite_shapes``), so they never use the original size of a token axis.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from ..analysis.node_info import Kind, arg, shape_of
from ..graph import Refusal
from ..graph.meta import ev

__all__ = ["emit_original_size", "original_dim_size", "rewrite_shapes", "token_size"]


def token_size(p, tag: str, size: int, slen: int):
    """The packed size of a dim tagged ``tag`` whose original size is ``size`` (``slen`` columns): 1 or ``T * f``."""
    if tag == "b":
        return 1
    unit = slen if tag == "s" else p.B * slen
    factor = size // unit
    return p.T if factor == 1 else p.g.call_function(operator.mul, (p.T, factor))


def rewrite_shapes(p, n: fx.Node, args, kwargs):
    """``n``'s packed arguments ``args``/``kwargs`` with their shape arguments re-derived (module docstring)."""
    tags = p.axes.info[n].tags
    out_shape = shape_of(n) if isinstance(ev(n), torch.Tensor) else []
    target = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    slen = p.axes.info[n].slen
    if target in ("view", "reshape", "expand", "new_empty", "new_zeros", "new_ones", "new_full"):
        _refuse_shape_value(n, args)
    if target in ("view", "reshape", "expand"):
        sizes_in_tuple = len(args) == 2 and isinstance(args[1], (tuple, list))
        sizes = list(args[1] if sizes_in_tuple else args[1:])
        for d, tag in enumerate(tags):
            if tag is None:
                continue
            if target == "expand":
                sizes[d] = 1 if tag == "b" else -1
            elif sizes[d] != -1:
                sizes[d] = token_size(p, tag, out_shape[d], slen)
        args = (args[0], tuple(sizes)) if sizes_in_tuple else (args[0], *sizes)
    elif target in ("new_empty", "new_zeros", "new_ones", "new_full"):
        sizes_in_tuple = len(args) >= 2 and isinstance(args[1], (tuple, list))
        sizes = list(args[1] if sizes_in_tuple else args[1:])
        for d, tag in enumerate(tags):
            if tag is not None:
                sizes[d] = token_size(p, tag, out_shape[d], slen)
        args = (args[0], tuple(sizes), *args[2:]) if sizes_in_tuple else (args[0], *sizes)
    elif target == "unflatten":
        dim, sizes = args[1], list(args[2])
        dim %= len(ev(n.args[0]).shape)
        for j in range(len(sizes)):
            tag = tags[dim + j]
            if tag is not None and sizes[j] != -1:
                sizes[j] = token_size(p, tag, out_shape[dim + j], slen)
        args = (args[0], dim, tuple(sizes))
    elif n.op == "call_function" and n.target is operator.getitem and isinstance(ev(n.args[0]), torch.Tensor):
        args = (args[0], _full_slices(p, n, args[1]))
    elif n.op == "call_function" and n.target is operator.setitem and p.axes.info[n].kind is Kind.ROUTED:
        # The MoE dispatch's inverse permutation, inv[perm] = arange(n): n entries of the packed stream.
        value = n.args[2]
        size = p.g.call_method("size", (args[1], 0))
        args = (args[0], args[1], p.g.call_function(torch.arange, (size,), dict(value.kwargs)))
    return args, kwargs


def _refuse_shape_value(n: fx.Node, args) -> None:
    """``Refusal`` for a shape given as one graph value (``x.view(w.size())``, ``w`` no token value; a size of a
    token value arrives as a tuple, ``emit_original_size``): its entries at the token axes cannot be replaced."""
    if len(args) >= 2 and isinstance(args[1], fx.Node) and isinstance(ev(n.args[1]), (tuple, list)):
        raise Refusal(f"{n.name}: its shape is one value, {n.args[1].name}, so its token axes cannot be re-derived")


def _full_slices(p, n: fx.Node, packed_idx):
    """Slices along token axes are full (the analysis checked); drop their bounds so they stay full at T.

    ``packed_idx``: the index with its nodes mapped to the packed graph (tensor indices kept as mapped)."""
    src_tags = p.axes.info[n.args[0]].tags
    idx = n.args[1]
    single = not isinstance(idx, tuple)
    idx = (idx,) if single else idx
    mapped = (packed_idx,) if single else packed_idx
    n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    out, d = [], 0
    for i, m in zip(idx, mapped):
        if i is Ellipsis:
            d += len(src_tags) - n_real
            out.append(i)
        elif i is None:
            out.append(i)
        else:
            out.append(slice(None) if isinstance(i, slice) and src_tags[d] is not None else m)
            d += 1
    return out[0] if single else tuple(out)


def original_dim_size(p, x: fx.Node, d: int, batch, cols):
    """Dim ``d`` of the TOKEN value ``x`` in the original layout, as a graph value.

    ``batch`` and ``cols``: B and ``x``'s column count (S, or S - 1 after a
    next-token slice) as graph values. A token axis is B, ``f * cols`` or
    ``f * B * cols`` (``f`` entries per token, from the example); a dim without
    one has the packed value's size."""
    xi = p.axes.info[x]
    tag = xi.tags[d]
    if tag == "b":
        return batch
    if tag in ("s", "bs"):
        per_token = shape_of(x)[d] // xi.slen // (p.B if tag == "bs" else 1)
        size = cols if per_token == 1 else p.g.call_function(operator.mul, (cols, per_token))
        return p.g.call_function(operator.mul, (size, batch)) if tag == "bs" else size
    return p.g.call_method("size", (p.packed_of(x), d))


def emit_original_size(p, n: fx.Node):
    """The original-layout value of ``n`` = ``x.size()`` or ``x.size(d)``, ``x`` a TOKEN value (module docstring):
    an int, a graph value, or a tuple of them."""
    x = n.args[0]
    shape = ev(x).shape
    dim = arg(n, 1, "dim")
    dims = range(len(shape)) if dim is None else [dim % len(shape)]
    runtime: dict[str, fx.Node] = {}

    def batch_sizes():
        # B and the columns of x, read off the [B, S] input once per size query that needs them.
        if not runtime:
            ids = p.orig[p.size_ref()]
            runtime["batch"] = p.g.call_method("size", (ids, 0))
            cols = p.g.call_method("size", (ids, 1))
            short = p.S - p.axes.info[x].slen  # 1 after x[:, :-1] or x[:, 1:]
            runtime["cols"] = cols if short == 0 else p.g.call_function(operator.sub, (cols, short))
        return runtime["batch"], runtime["cols"]

    entries = []
    for d in dims:
        if is_concrete_int(shape[d]):
            entries.append(int(shape[d]))
        else:
            entries.append(original_dim_size(p, x, d, *batch_sizes()))
    return entries[0] if dim is not None else tuple(entries)
