"""Token-axis rules for reductions over every token of the batch (docs/design.md, semantics 12).

A sum over the token axes of the original layout counts a shared token once per sequence that holds it. On the
packed stream the same sum is taken with each token weighted by that count (``layout.packed_ops.token_weights``),
in one pass over the packed tokens rather than by unpacking the operand into ``[B, S, ...]``: an MoE router's
load-balancing statistics, a loss's token sum or mean.

Covered: ``sum`` and ``mean`` over dims that include every token axis of the operand (or over all dims);
``scatter_add`` and ``index_add`` into a value without token axes along the operand's one token axis (expert
counts); ``histc`` with a given range. The result has no token axes (kind NONE with ``NodeInfo.weighted``).

Assumptions and what is checked elsewhere
    * The original sums padding positions too. Packing does not compute them, so the weighted sum equals the
      original only where a factor zeroes them (a mask multiplied in); ``analysis.padding_reads`` reports each
      weighted reduction as a read and the runner checks its factors per call.
    * A reduction whose token operands come from the token inputs alone (a mask's sum) is not weighted: it is
      computed in the original layout from the inputs (exact at padding too); the rule raises ``RuleFailed``.
    * Other reductions over tokens (``amax``, ``var``, ``logsumexp``, a sum over the sequence of each row) are not
      sums of per-token terms the layout can weight: ``RuleFailed``, computed in the original layout.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph.meta import ev as _ev
from .node_info import Kind, NodeInfo, RuleFailed, Weighted, arg, op_name, reduced_dims

__all__ = ["weighted_reduction", "weighted_scatter", "weighted_histc_rule"]

_SUMS = {"sum": "sum", "mean": "mean", torch.sum: "sum", torch.mean: "mean"}


def _token_dims(tags) -> list[int]:
    return [d for d, t in enumerate(tags) if t is not None]


def _check_operand(x: fx.Node, info, what: str, inputs_only_ok: bool = False) -> None:
    i = info[x]
    if i.kind is not Kind.TOKEN:
        raise RuleFailed(f"{what} of a {i.kind.value} value over the token axes")
    if i.from_inputs and not inputs_only_ok:
        raise RuleFailed(f"{what} over the token axes of a value of the inputs alone (computed in the original layout)")
    merged = [t for t in i.tags if t == "bs"]
    split = [t for t in i.tags if t in ("b", "s")]
    if not ((len(merged) == 1 and not split) or (not merged and sorted(split) == ["b", "s"])):
        raise RuleFailed(f"{what} of a value with token axes {i.tags}")


def weighted_reduction(node: fx.Node, info, B: int, S: int) -> NodeInfo:
    """``x.sum(dims)`` / ``x.mean(dims)`` with ``dims`` covering every token axis of ``x`` (or all dims)."""
    op = _SUMS.get(node.target)
    if op is None or node.op not in ("call_function", "call_method"):
        raise RuleFailed(f"{op_name(node)} along a token axis")
    x = node.args[0]
    _check_operand(x, info, op)
    tags = info[x].tags
    if not set(_token_dims(tags)) <= reduced_dims(arg(node, 1, "dim"), len(tags)):
        raise RuleFailed(f"{op} along some token axes only (per row or per column)")
    if op == "mean" and not _ev(node).dtype.is_floating_point:
        raise RuleFailed("mean of an integer value")
    return _none(node, Weighted(op, x))


def weighted_scatter(node: fx.Node, info, B: int, S: int) -> NodeInfo:
    """``base.scatter_add(dim, index, src)`` / ``base.index_add(dim, index, src)``: ``base`` without token axes,
    ``index`` and ``src`` carrying one token axis, at ``dim`` (expert counts summed over tokens)."""
    name = op_name(node)
    if name not in ("scatter_add", "index_add"):
        raise RuleFailed(f"{name} over a token axis")
    base, dim, index = node.args[0], arg(node, 1, "dim"), arg(node, 2, "index")
    src = arg(node, 3, "src", node.kwargs.get("source"))
    if set(node.kwargs) - {"src", "source"} or not isinstance(dim, int):
        raise RuleFailed(f"{name} with arguments this rule does not read")
    if not isinstance(base, fx.Node) or info[base].kind is not Kind.NONE or not isinstance(src, fx.Node):
        raise RuleFailed(f"{name} into a value with token axes")
    if not isinstance(index, fx.Node) or info[index].kind is not Kind.TOKEN:
        raise RuleFailed(f"{name} with an index without token axes")
    # Counts of model values (top-k expert ids) weighted by a mask: the source may be of the inputs alone.
    _check_operand(src, info, name, inputs_only_ok=not info[index].from_inputs)
    s_info, i_info = info[src], info[index]
    d = dim % len(s_info.tags)
    if s_info.tags[d] != "bs" or [t for t in s_info.tags if t is not None] != ["bs"]:
        raise RuleFailed(f"{name} whose source has token axes {s_info.tags} (one merged token axis at dim {dim} expected)")
    if name == "scatter_add":
        same = i_info.tags == s_info.tags and _ev(index).shape == _ev(src).shape
    else:
        same = i_info.tags == ("bs",) and _ev(index).shape[0] == _ev(src).shape[d]
    if not same or (i_info.shift, i_info.slen) != (s_info.shift, s_info.slen):
        raise RuleFailed(f"{name} whose index and source lie along different token axes")
    return _none(node, Weighted(name, src))


def weighted_histc_rule(node: fx.Node, info, B: int, S: int) -> NodeInfo:
    """``torch.histc(x, bins, min, max)`` with a fixed range (``min < max``): entries counted with their weight."""
    x = node.args[0]
    _check_operand(x, info, "histc")
    lo, hi = arg(node, 2, "min", 0), arg(node, 3, "max", 0)
    if not isinstance(arg(node, 1, "bins", 100), int) or not all(isinstance(v, (int, float)) for v in (lo, hi)) or not lo < hi:
        raise RuleFailed("histc whose range is taken from the data (min >= max) or not a constant")
    return _none(node, Weighted("histc", x))


def _none(node: fx.Node, weighted: Weighted) -> NodeInfo:
    ev = _ev(node)
    return NodeInfo(Kind.NONE, (None,) * ev.dim(), weighted=weighted)
