"""Token-axis rules of the ops that move dimensions (``rule_registry``: the registry and the contract of a rule).

view/reshape/flatten/unflatten group dimensions and may merge ``b`` and
``s`` into ``bs`` (or split it back); transpose, permute, unsqueeze,
squeeze, expand, movedim and t move tags; indexing moves them and takes
``[:, :-1]`` / ``[:, 1:]`` along the sequence as a next-token shift; cat,
stack, split, chunk and unbind work along feature dimensions only;
``view_as_complex`` takes a trailing pair of reals (no token axis) into one
complex entry and ``view_as_real`` gives it back (complex rotary: DeepSeek-V2,
Llama 4).
``x.size()`` of a token value is a size of the original layout, with no
token axes (``_size``).
"""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch
import torch.fx as fx

from ..graph.meta import ev as _ev
from .node_info import Kind, NodeInfo, RuleFailed, arg, hint, kind_of, shape_of, untagged
from .rule_registry import token_rule

__all__ = ["is_size_query"]

# Methods that read a tensor's sizes and return ints (a ``torch.Size`` or one entry of it), not a tensor.
_SIZE_METHODS = ("size",)


def is_size_query(node: fx.Node) -> bool:
    """Whether ``node`` is ``x.size()`` or ``x.size(d)``: its value is a size, not a tensor."""
    return node.op == "call_method" and node.target in _SIZE_METHODS


@token_rule(methods=_SIZE_METHODS)
def _size(node, info, B, S) -> NodeInfo:
    """``x.size()`` / ``x.size(d)``: ints of the original layout (B, S, f * S, feature sizes), no token axes.

    Dynamo records these where it traced ``x.shape`` with a symbolic size and
    a guard later made that size a constant (automatic dynamic shapes after a
    layout change: an input first seen in this layout, static, broadcast
    against a symbolic one), so a static graph may read its sizes off token
    values. Read as numbers they must be the original program's; an op that
    shapes a packed value from them re-derives its token axes instead
    (``rewrite.packed_shapes.rewrite_shapes``: ``b -> 1``, ``s``/``bs -> T * f``),
    and the rewrite computes them without building ``x`` in the original
    layout (``rewrite.packed_shapes.emit_original_size``).
    """
    return NodeInfo(Kind.NONE)


@token_rule(torch.reshape, torch.flatten, methods=("view", "reshape", "flatten", "unflatten"))
def _view(node, info, B, S) -> NodeInfo:
    src = node.args[0]
    in_shape = shape_of(src)
    out_shape = shape_of(node)
    in_tags = info[src].tags
    S = info[src].slen or S  # x[:, :-1] and x[:, 1:] have S - 1 columns
    groups = _group_dims(in_shape, out_shape)
    out: list[Optional[str]] = [None] * len(out_shape)
    for ins, outs in groups:
        tagged = [(d, in_tags[d]) for d in ins if in_tags[d] is not None]
        if not tagged:
            continue
        real_outs = [o for o in outs if out_shape[o] != 1]
        real_ins = [d for d in ins if in_shape[d] != 1]
        if not real_ins and len(tagged) == 1 and outs:
            # A token axis of size 1 (a batch of one row) kept as a size-1 dim.
            out[outs[0]] = tagged[0][1]
            continue
        if len(real_ins) == 1 and len(real_outs) == 1 and in_shape[real_ins[0]] == out_shape[real_outs[0]]:
            # One dim of the same size: its tags, with those of size-1 token axes merged into it ([1, S] -> [S]).
            merged = "".join(t for _, t in tagged)
            if merged not in ("b", "s", "bs"):
                raise RuleFailed(f"reshape merging {[t for _, t in tagged]}")
            ones = [o for o in outs if o < real_outs[0]]  # size-1 dims ahead of it
            if merged == "bs" and B == 1 and ones and out_shape[real_outs[0]] == S:
                # A one-row batch's [S] (merged from [1, S]) back to [1, S]: the batch axis returns
                # (an MoE block's reshape(batch, seq, hidden) of its flattened tokens).
                out[ones[-1]], out[real_outs[0]] = "b", "s"
                continue
            out[real_outs[0]] = merged
            continue
        kinds = [t for _, t in tagged]
        lead = real_ins[: len(tagged)]
        if lead != [d for d, _ in tagged]:
            raise RuleFailed("reshape that merges feature dims ahead of a token axis")
        if len(real_outs) == 1:  # merge
            merged = "".join(kinds)
            if merged not in ("s", "bs"):
                raise RuleFailed(f"reshape merging {kinds}")
            out[real_outs[0]] = merged
            continue
        tokens = math.prod(in_shape[d] for d, _ in tagged)
        if "".join(kinds) in ("s", "bs") and len(tagged) > 1 and out_shape[real_outs[0]] % tokens == 0:
            # [b, s, f] -> [b*s*g, f/g]: merged token-major, g entries per token (OLMo-hybrid's per-head gate).
            out[real_outs[0]] = "".join(kinds)
            continue
        if len(tagged) == 1 and len(real_ins) == 1:  # split
            kind = kinds[0]
            sizes = [out_shape[o] for o in real_outs]
            if kind == "bs" and sizes[0] == B and sizes[1] % S == 0:
                out[real_outs[0]], out[real_outs[1]] = "b", "s"
                if sizes[1] != S:
                    raise RuleFailed("reshape splitting the sequence axis")
                continue
            if kind in ("s", "bs") and sizes[0] % (S if kind == "s" else B * S) == 0:
                # [.., N*f] -> [.., N*g, f/g]: the first dim keeps whole tokens (token-major), g per token.
                out[real_outs[0]] = kind
                continue
        if len(tagged) == 1 and len(real_outs) > 1 and kinds[0] in ("s", "bs"):
            # [b*s*g, f/g] -> [b, s, f]: g entries per token gathered back into one token (the reverse of the
            # merged per-token split above).
            d, kind = tagged[0]
            first = [out_shape[o] for o in real_outs[:2]]
            if kind == "bs" and first == [B, S] and in_shape[d] % (B * S) == 0:
                out[real_outs[0]], out[real_outs[1]] = "b", "s"
                continue
            if kind == "s" and first[0] == S and in_shape[d] % S == 0:
                out[real_outs[0]] = "s"
                continue
        raise RuleFailed(f"reshape {in_shape} -> {out_shape} that splits a token axis")
    t = tuple(out)
    return NodeInfo(kind_of(t), t)


def _group_dims(a: list[int], b: list[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of dims of two shapes with equal element counts (row-major view semantics)."""
    groups = []
    i = j = 0
    while i < len(a) or j < len(b):
        gi, gj = [], []
        pa = pb = 1
        if i < len(a):
            gi.append(i); pa *= a[i]; i += 1
        if j < len(b):
            gj.append(j); pb *= b[j]; j += 1
        while pa != pb:
            if pa < pb and i < len(a):
                gi.append(i); pa *= a[i]; i += 1
            elif pb < pa and j < len(b):
                gj.append(j); pb *= b[j]; j += 1
            else:
                raise RuleFailed(f"view from {a} to {b}")
        # Trailing size-1 dims join the group they follow.
        while i < len(a) and a[i] == 1 and (j >= len(b) or b[j] != 1):
            gi.append(i); i += 1
        while j < len(b) and b[j] == 1 and (i >= len(a) or a[i] != 1):
            gj.append(j); j += 1
        groups.append((gi, gj))
    return groups


@token_rule(torch.transpose, torch.permute, torch.unsqueeze, torch.squeeze, torch.movedim,
            methods=("transpose", "permute", "unsqueeze", "squeeze", "expand", "movedim", "t"))
def _move(node, info, B, S) -> NodeInfo:
    src = node.args[0]
    t = list(info[src].tags)
    n = len(t)
    target = node.target if node.op == "call_method" else node.target.__name__
    args = node.args[1:]
    if target == "transpose":
        d0, d1 = (args[0] % n, args[1] % n) if args else (arg(node, 1, "dim0") % n, arg(node, 2, "dim1") % n)
        t[d0], t[d1] = t[d1], t[d0]
    elif target == "t":
        t = t[::-1]
    elif target == "permute":
        dims = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
        t = [t[d % n] for d in dims]
    elif target == "movedim":
        src_d, dst_d = args[0] % n, args[1] % n
        tag = t.pop(src_d)
        t.insert(dst_d, tag)
    elif target == "unsqueeze":
        d = arg(node, 1, "dim")
        d = d % (n + 1)
        t.insert(d, None)
    elif target == "squeeze":
        out_ev = _ev(node)
        in_shape = shape_of(src)
        dims = args if args else tuple(range(n))
        dims = {d % n for d in (dims[0] if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims)}
        dropped = [tag for d, tag in enumerate(t) if d in dims and in_shape[d] == 1]
        t = [tag for d, tag in enumerate(t) if not (d in dims and in_shape[d] == 1)]
        if "b" in dropped and "s" in t:
            # A one-row batch's [1, S, ...] squeezed to [S, ...] (veRL's remove-padding row, logits.squeeze(0)):
            # the sequence axis is then the merged one, as reshape makes it.
            t[t.index("s")] = "bs"
        assert len(t) == out_ev.dim()
    elif target == "expand":
        sizes = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
        sizes = [hint(_ev(x)) if isinstance(x, fx.Node) else x for x in sizes]
        in_shape = shape_of(src)
        extra = len(sizes) - n
        new = [None] * extra + t
        for d in range(n):
            if t[d] is None and in_shape[d] == 1 and sizes[extra + d] not in (-1, 1):
                # A column value or a constant broadcast over the batch gains a
                # batch axis; any other broadcast dim is a feature dim (e.g.
                # repeat_kv's). Either way the value is constant along it.
                if sizes[extra + d] == B and "b" not in t and "bs" not in t:
                    new[extra + d] = "b"
        t = new
    else:
        raise RuleFailed(f"no rule for {target}")
    t = tuple(t)
    return NodeInfo(kind_of(t), t)


@token_rule(torch.view_as_complex, torch.view_as_real)
def _complex_view(node, info, B, S) -> NodeInfo:
    """``view_as_complex``: ``[..., 2]`` reals -> ``[...]`` complex, the pair axis dropped (it must carry no token
    axis); ``view_as_real``: a trailing pair axis added. Each token's entries stay its own."""
    t = info[node.args[0]].tags
    if node.target is torch.view_as_real:
        return NodeInfo(kind_of(t), t + (None,))
    if not t or t[-1] is not None:
        raise RuleFailed("view_as_complex of a token axis")
    return NodeInfo(kind_of(t[:-1]), t[:-1])


@token_rule(operator.getitem)
def _getitem(node, info, B, S) -> NodeInfo:
    src, idx = node.args
    src_ev = _ev(src)
    if isinstance(src_ev, (tuple, list)):  # element of split/chunk/unbind output
        return NodeInfo(info[src].kind if info[src].kind is not Kind.ORIG else Kind.ORIG, info[src].tags)
    t = info[src].tags
    n = len(t)
    if not isinstance(idx, tuple):
        idx = (idx,)
    if any(isinstance(i, fx.Node) for i in idx):
        tensors = [i for i in idx if isinstance(i, fx.Node)]
        if len(tensors) == 1 and len(idx) == 1 and info[src].kind is Kind.NONE:
            it = info[tensors[0]].tags
            tt = it + (None,) * (n - 1)
            return NodeInfo(kind_of(tt), tt)
        raise RuleFailed("advanced indexing of a token value")
    n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    out: list[Optional[str]] = []
    d = 0
    shift, slen = info[src].shift, info[src].slen
    for i in idx:
        if i is Ellipsis:
            take = n - n_real
            out.extend(t[d : d + take])
            d += take
        elif i is None:
            out.append(None)
        elif isinstance(i, slice):
            if t[d] is not None:
                seq = _sequence_slice(i, hint(src_ev.shape[d]), t[d], info[src])
                if seq is not None:
                    shift, slen = seq
            out.append(t[d])
            d += 1
        elif isinstance(i, int):
            if t[d] is not None:
                raise RuleFailed("indexing a single position of a token axis")
            d += 1
        else:
            raise RuleFailed(f"index {i!r}")
    out.extend(t[d:])
    tt = tuple(out)
    return NodeInfo(kind_of(tt), tt, shift=shift, slen=slen)


def _sequence_slice(i: slice, size: int, tag: str, src: NodeInfo) -> Optional[tuple[int, int]]:
    """None for a full slice; ``(shift, slen)`` for ``[:-1]`` (drop the last column) or ``[1:]`` (the next tokens)."""
    stop = hint(_ev(i.stop)) if isinstance(i.stop, fx.Node) else i.stop
    start = hint(_ev(i.start)) if isinstance(i.start, fx.Node) else i.start
    if i.step not in (None, 1):
        raise RuleFailed("strided slice along a token axis")
    # Python's slice bounds: a negative one counts from the end, either is clamped to the axis.
    start = 0 if start is None else max(start + size, 0) if start < 0 else min(start, size)
    stop = size if stop is None else max(stop + size, 0) if stop < 0 else min(stop, size)
    if (start, stop) == (0, size):
        return None
    if tag != "s" or src.kind is not Kind.TOKEN or src.slen != size or src.shift != 0:
        raise RuleFailed("slice along a token axis (other than one next-token shift)")
    if (start, stop) == (0, size - 1):
        return 0, size - 1
    if (start, stop) == (1, size):
        return 1, size - 1
    raise RuleFailed("slice along a token axis (other than one next-token shift)")


@token_rule(torch.cat, torch.concatenate, torch.concat)  # the aliases: Zamba2 writes torch.concatenate
def _cat(node, info, B, S) -> NodeInfo:
    xs = node.args[0]
    dim = arg(node, 1, "dim", 0)
    real = [x for x in xs if not (isinstance(_ev(x), torch.Tensor) and _ev(x).dim() == 1 and _ev(x).numel() == 0)]
    if not real:
        return NodeInfo(Kind.NONE, untagged(_ev(node)))
    ts = [info[x].tags for x in real]
    n = len(ts[0])
    if len(real) > 1 and any(t[dim % n] is not None for t in ts):
        raise RuleFailed("concatenation along a token axis")
    return _merge_tags(node, ts)


@token_rule(torch.slice_scatter, methods=("slice_scatter",))
def _slice_scatter(node, info, B, S) -> NodeInfo:
    """``base.slice_scatter(src, dim, ...)`` along a dim without a token axis (a buffer filled slice by slice,
    as ``normalize.functionalize`` writes ``buf[..., a:b].copy_(src)``): each token's entries from its own."""
    base, src = node.args[0], arg(node, 1, "src")
    dim = arg(node, 2, "dim", 0)
    t = info[base].tags
    if not isinstance(dim, int) or t[dim % len(t)] is not None:
        raise RuleFailed("slice_scatter along a token axis")
    return _merge_tags(node, [t, info[src].tags])


@token_rule(torch.stack)
def _stack(node, info, B, S) -> NodeInfo:
    ts = [info[x].tags for x in node.args[0]]
    dim = arg(node, 1, "dim", 0)
    return _merge_tags(node, ts, insert_at=dim)


@token_rule(torch.split, torch.chunk, torch.unbind, methods=("split", "chunk", "unbind"))
def _split(node, info, B, S) -> NodeInfo:
    target = node.target
    t = info[node.args[0]].tags
    dim = arg(node, 2 if target in ("split", "chunk", torch.split, torch.chunk) else 1, "dim", 0)
    if t[dim % len(t)] is not None:
        raise RuleFailed("split along a token axis")
    if target in ("unbind", torch.unbind):
        t = t[: dim % len(t)] + t[dim % len(t) + 1:]
    return NodeInfo(kind_of(t), t)


def _merge_tags(node, ts, insert_at=None) -> NodeInfo:
    n = max(len(t) for t in ts)
    out: list[Optional[str]] = [None] * n
    for t in ts:
        for d, tag in enumerate(t):
            if tag is None:
                continue
            if out[d] not in (None, tag):
                raise RuleFailed("combines values with different token axes")
            out[d] = tag
    if any(t != tuple(out) for t in ts):
        raise RuleFailed("combines token and non-token values along one axis")
    if insert_at is not None:
        out.insert(insert_at % (n + 1), None)
    t = tuple(out)
    return NodeInfo(kind_of(t), t)
