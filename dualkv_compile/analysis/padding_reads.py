"""Analysis of a packed graph: where the program reads, into a result, a position that packing zeroes.

Packing never computes padding positions: ``unpack`` fills them with zeros (docs/design.md, semantics 8), where the
original program had some value. A next-token value (``x[:, 1:]``-aligned, shift 1) is also zero where the token
*before* its target is padding: the log-prob of a row's first valid token reads the logits of the padding column
before it, which the packed stream does not have (a left-padded row, an empty prompt).

A graph output may hold those zeros (documented). A computation that reads them must not, unless it multiplies
them by zero: ``(pg * response_mask).sum()`` reads every position of ``pg``, but the mask is zero at padding and at
the prompt's first token. This pass follows each unpacked value through the ops of the original layout that keep
positions apart (pointwise ops, ops over trailing dims, slices along the sequence), noting every multiplication by
a value computed from the graph's inputs alone (a loss mask, an advantage), until it is a graph output (fine) or
read by anything else (a reduction over tokens, a shift, an index): a ``Read``, whose factors the runner evaluates
per call, packing only if one of them is zero at every position packing zeroed. A sum over the token axes taken on
the packed stream (``rewrite.weighted_reductions``) is a ``Read`` of every position too.

Contract
    Input: the packed ``GraphModule`` (after any fusion), whose last ``num_packed_inputs`` placeholders are the
    layout's, and the original graph it was packed from (a factor that needs no gradient is evaluated there, on the
    original inputs). Output: the ``Read``s, each with its ``unpack_tokens`` source (shift, truncation), the slices
    along the sequence on the way, and the factors with the slices in force where each applies. For a call,
    ``nonzero_masks`` evaluates where a read's factors are nonzero (from the inputs alone, no layout) and
    ``tainted_where`` applies them to the call's layout. The graph is not modified.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
import torch.fx as fx

from ..graph.meta import ev as _ev, original, picked_rank as _picked_rank, unpacked_rank, weighted
from ..layout.packed_ops import unpack_merged, unpack_tokens
from .token_rules import POINTWISE_FUNCS, POINTWISE_METHODS, REDUCE_FUNCS, REDUCE_METHODS, SOFTMAX_LIKE, SOFTMAX_METHODS

__all__ = ["Read", "find_padding_reads", "nonzero_masks", "tainted_where"]

# Products, and the bitwise and of booleans (``picked & mask``): zero wherever the factor is.
_MUL = {operator.mul, torch.mul, "mul", operator.and_, torch.logical_and, "__and__", "logical_and"}
# Ops along dims past the token axes ([B, L, ...]: their positions stay apart).
_TRAILING_FUNCS = SOFTMAX_LIKE | REDUCE_FUNCS | {torch.gather, torch.squeeze, torch.unsqueeze}
_TRAILING_METHODS = SOFTMAX_METHODS | REDUCE_METHODS | {"gather", "squeeze", "unsqueeze"}
# A projection of the last dim (an lm_head over ``hidden[:, -k:]``, as ``logits_to_keep`` slices it).
_LINEAR = {torch._C._nn.linear, torch.nn.functional.linear}


@dataclasses.dataclass(frozen=True)
class Read:
    """The value ``unpack`` made at ``source``, read by ``reader`` after ``slices`` along the sequence.

    ``factors``: ``(node, slices, rank)``, each an input-only value the read
    value was multiplied by on the way, with the slices in force and the
    value's rank there.
    """

    source: fx.Node
    reader: fx.Node
    shift: int
    truncate: bool
    slices: tuple[tuple, ...] = ()  # (start, stop) of each slice
    factors: tuple[tuple[fx.Node, tuple[tuple, ...], Optional[int]], ...] = ()
    merged: bool = False  # rows and columns merged into one axis (``x.reshape(-1, H)``), token-major


def _arg(n: fx.Node, i: int, name: str, default=None):
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _is(n: fx.Node, funcs, methods) -> bool:
    return (n.op == "call_function" and n.target in funcs) or (n.op == "call_method" and n.target in methods)


def _trailing_dims_only(n: fx.Node, src: fx.Node) -> bool:
    """An op along dims >= 2 of ``src`` (or none): positions (dims 0 and 1) stay apart."""
    dim = _arg(n, 2 if n.target in ("norm", torch.norm) else 1, "dim")  # norm takes p before dim
    if n.target in ("squeeze", "unsqueeze", torch.squeeze, torch.unsqueeze, "sum", "mean", torch.sum, torch.mean) and dim is None:
        return False
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    rank = _rank(src)
    if rank is None or not all(isinstance(d, int) for d in dims):
        return False
    return all((d % (rank + (1 if n.target in ("unsqueeze", torch.unsqueeze) else 0))) >= 2 for d in dims)


def _rank(n) -> Optional[int]:
    ev = _ev(n)
    if isinstance(ev, torch.Tensor):
        return ev.dim()
    return unpacked_rank(n)  # set by pack_graph on unpack nodes


def _column_slice(n: fx.Node) -> Optional[tuple]:
    """``x[:, a:b, ...]`` (full in dim 0, a unit-step int slice in dim 1, nothing else): ``(a, b)``; else None.

    A tuple, not a slice: slices are unhashable before Python 3.12, and reads are kept in sets."""
    if not (n.op == "call_function" and n.target is operator.getitem):
        return None
    idx = n.args[1]
    idx = idx if isinstance(idx, tuple) else (idx,)
    if len(idx) < 2 or idx[0] != slice(None) or not isinstance(idx[1], slice) or idx[1].step not in (None, 1):
        return None
    if not all(isinstance(x, (int, type(None))) for x in (idx[1].start, idx[1].stop)):
        return None
    if any(not (i == slice(None) or i is Ellipsis) for i in idx[2:]):
        return None
    return idx[1].start, idx[1].stop


# Ops that map zero to zero, through which a factor applied before ``unpack`` (on the packed stream) still
# zeroes the unpacked value: eager's value there is ``g(garbage * 0) = 0``, packing's the unpacked zero.
_ZERO_PRESERVING = {operator.neg, torch.neg, "neg", "to", "float", "double", "half", "bfloat16", "type_as", "squeeze", "unsqueeze"}


def _needs_no_gradient(original: fx.GraphModule) -> dict[str, bool]:
    """Per node name of the original graph: whether it and all it reads need no gradient (masks, ids: cheap, exact)."""
    cheap: dict[str, bool] = {}
    for n in original.graph.nodes:
        ev = _ev(n)
        own = not (isinstance(ev, torch.Tensor) and (ev.requires_grad or isinstance(ev, torch.nn.Parameter)))
        own = own and "_parameters_" not in n.name
        cheap[n.name] = own and all(cheap[a.name] for a in n.all_input_nodes)
    return cheap


def _packed_factors(x: fx.Node, cheap: dict[str, bool], originals: dict[str, fx.Node]) -> tuple:
    """Factors applied on the packed stream before ``unpack`` of ``x``: ``((original node, (), rank),)`` or ``()``."""
    while True:
        name = original(x)
        if name is not None and cheap.get(name) and name in originals:
            # The value itself needs no gradient (a mask): eager's value at a zeroed position, read off the original.
            return ((originals[name], (), _rank(originals[name])),)
        if _is(x, _MUL, _MUL):
            for a in x.args[:2]:
                name = original(a)
                if name is not None and cheap.get(name) and name in originals:
                    o = originals[name]
                    return ((o, (), _rank(originals.get(original(x), o))),)
            return ()
        if _is(x, _ZERO_PRESERVING, _ZERO_PRESERVING) and isinstance(x.args[0], fx.Node):
            x = x.args[0]
            continue
        return ()


def find_padding_reads(gm: fx.GraphModule, num_packed_inputs: int, original: Optional[fx.GraphModule] = None) -> list[Read]:
    """See the module docstring. ``original``: the graph ``gm`` was packed from (factors on the packed stream)."""
    cheap = _needs_no_gradient(original) if original is not None else {}
    originals = {n.name: n for n in original.graph.nodes} if original is not None else {}
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    layout_inputs = set(placeholders[len(placeholders) - num_packed_inputs:])
    # Values of the original layout computed from the graph's own inputs alone (no packed value).
    input_only: dict[fx.Node, bool] = {}
    for n in gm.graph.nodes:
        input_only[n] = n not in layout_inputs and all(input_only[a] for a in n.all_input_nodes)

    reads: list[Read] = []
    for u in gm.graph.nodes:
        if weighted(u) is not None:
            # A sum over the token axes on the packed stream reads every position of the original layout,
            # as the same sum of the unpacked value would; factors applied before it are credited.
            # Factors are credited where the token axes lead, as they are laid out in the check below.
            shift, truncate, merged, leading = weighted(u)
            factors = _packed_factors(u.args[0], cheap, originals) if leading else ()
            reads.append(Read(u, u, shift, truncate, factors=factors, merged=merged))
            continue
        # Entries of an unpacked value (gather_unpacked, or the fused op standing for it), zero at padding as unpack
        # leaves them; graph.meta.picked_rank holds their index's rank.
        picked_rank = _picked_rank(u)
        picked = picked_rank is not None
        if u.op == "call_function" and u.target is unpack_merged or picked_rank == 2:
            shift, truncate = (0, False) if picked else u.args[5:7]
            reads.extend(Read(u, user, shift, truncate, merged=True) for user in u.users if user.op != "output")
            continue
        if picked:
            b_dim, s_dim, shift, truncate = 0, 1, 0, False
        elif u.op == "call_function" and u.target is unpack_tokens:
            _, _, _, _, b_dim, s_dim, shift, truncate = u.args[:8]
        else:
            continue
        seen = set()
        frontier = [(u, Read(u, u, shift, truncate, factors=_packed_factors(u.args[0], cheap, originals)))]
        while frontier:
            value, path = frontier.pop()
            for user in value.users:
                if user.op == "output" or (user, path) in seen:
                    continue
                seen.add((user, path))
                step = dataclasses.replace(path, reader=user)
                others = [a for a in user.all_input_nodes if a is not value]
                if (b_dim, s_dim) != (0, 1):
                    reads.append(step)
                elif _column_slice(user) is not None:
                    frontier.append((user, dataclasses.replace(step, slices=path.slices + (_column_slice(user),))))
                elif _is(user, POINTWISE_FUNCS, POINTWISE_METHODS) and _rank(user) == _rank(value) and not _is(
                    user, {torch.gather}, {"gather"}
                ):
                    # Other operands derived from packed values are followed from their own unpack.
                    if _is(user, _MUL, _MUL) and len(others) == 1 and input_only[others[0]]:
                        step = dataclasses.replace(step, factors=path.factors + ((others[0], path.slices, _rank(value)),))
                    frontier.append((user, step))
                elif _is(user, _TRAILING_FUNCS, _TRAILING_METHODS) and user.args[0] is value and _trailing_dims_only(user, value):
                    frontier.append((user, step))
                elif _is(user, _LINEAR, ()) and user.args[0] is value and (_rank(value) or 0) >= 3:
                    frontier.append((user, step))
                else:
                    reads.append(step)
    return reads


def _window_host(columns: int, slices: tuple[tuple, ...]) -> range:
    """The columns ``slices`` select, applied in turn to ``range(columns)``, as a host range."""
    index = range(columns)
    for sl in slices:
        index = index[slice(*sl)]
    return index


def _window(columns: int, slices: tuple[tuple, ...], device) -> torch.Tensor:
    """``_window_host``'s columns as an index tensor on ``device``."""
    r = _window_host(columns, slices)
    return torch.arange(len(r), device=device) * r.step + r.start


def _columns(read: Read, seq_len: int) -> int:
    """The columns of the value ``read`` reads: ``S - 1`` for a next-token value or a truncated one, else ``S``."""
    return seq_len - 1 if read.shift or read.truncate else seq_len


def nonzero_masks(read: Read, factors: dict[fx.Node, torch.Tensor], batch_size: int, seq_len: int) -> list:
    """Where each factor of ``read`` is nonzero, from the factors' values alone (no layout): ``(mask, slices)``
    per factor that lines up with the read, ``mask`` bool ``[1 or B, n]`` over the columns that ``slices``
    select (``slices`` None: a merged read's ``[B, C]`` mask over all its columns). Factors that do not line up
    get no credit and are left out. On the factors' device; ``tainted_where`` applies them."""
    B, C = batch_size, _columns(read, seq_len)
    out = []
    if read.merged:
        # No slice is followed along a merged axis; a factor counts if its first dim is that axis,
        # token-major (``mask.reshape(-1)``, its ``repeat_interleave(k)``, ``[:, None]``).
        for node, _, _ in read.factors:
            f = factors[node]
            if isinstance(f, torch.Tensor) and f.dim() >= 1 and f.shape[0] % (B * C) == 0 and f.shape[0] > 0:
                out.append(((f != 0).reshape(B, C, -1).any(-1), None))
        return out
    for node, slices, rank in read.factors:
        f = factors[node]
        if not isinstance(f, torch.Tensor) or rank is None or f.dim() > rank:
            continue  # a Python number, or shapes that do not line up with the read: no credit
        f = f.reshape((1,) * (rank - f.dim()) + tuple(f.shape))
        nonzero = (f != 0).flatten(2).any(-1) if rank > 2 else (f != 0)
        n = len(_window_host(C, slices))
        if nonzero.shape[1] not in (1, n) or nonzero.shape[0] not in (1, B):
            continue
        out.append((nonzero, slices))
    return out


def tainted_where(read: Read, valid: torch.Tensor, masks: list, linked: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Whether ``read`` reads a position packing zeroed (``valid``: the call's ``[B, S]`` non-padding mask) where
    none of ``masks`` (``nonzero_masks``) is zero: a 0-d bool tensor on ``valid``'s device. ``linked``
    (``[B, S - 1]``): where columns ``c`` and ``c + 1`` hold consecutive tokens of one sequence (default: both
    valid). A next-token value elsewhere reads across a sequence boundary (another sequence packed into the row,
    or padding), which the packed stream does not compute."""
    if read.shift:
        taint = ~(valid[:, 1:] & valid[:, :-1] if linked is None else linked)
    elif read.truncate:
        taint = ~valid[:, :-1]
    else:
        taint = ~valid
    B, C = taint.shape
    taint = taint.clone()
    for mask, slices in masks:
        mask = mask.to(taint.device)
        if slices is None:
            taint &= mask
            continue
        cols = _window(C, slices, taint.device)
        taint[:, cols] &= mask.expand(B, cols.numel())
    if read.merged:
        return taint.any()
    return taint[:, _window(C, read.slices, taint.device)].any()

