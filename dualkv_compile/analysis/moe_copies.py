"""Token-axis rules of expert-major copies of the tokens: Llama 4's MoE dispatch (``Llama4TextMoe``).

Llama 4 runs every expert on every token, each copy weighted by the token's router score for that expert::

    routed_in = hidden.repeat(E, 1)                  # [N, D] -> [E*N, D]: entry e*N + t is copy e of token t
    scores = router_scores.transpose(0, 1).reshape(-1, 1)   # [E*N, 1], the same order
    x = (routed_in * scores).view(E, -1, D)          # [E, N, D]: bmm per expert (Llama4TextExperts)
    out = shared_expert(hidden) + bmm(...).view(-1, D).reshape(E, -1, D).sum(dim=0)

Entry e*N + t of a merged copies axis only meets entry e*N + t of another value laid out the same way, so every
value of the dispatch is, at copy e of token t, a function of token t's values alone: token-local, exact on the
packed stream (T tokens for N = B * S). Its merged axis is in no order ``unpack`` can restore, so such a value is
ROUTED (tag ``"r"``, ``Route(what="copies", factor=k)``): computed on the packed stream only, never unpacked (an
output of one refuses the graph), its axis sized ``T * k`` (``rewrite.packed_shapes.token_size``).

Rules (values with one token axis ``"bs"`` of one entry per token, shift 0): ``x.repeat(..)`` ``k > 1`` times
along the token axis makes copies; a view merging a feature dim of ``k > 1`` with the token axis behind it,
``[.., k, N, ..] -> [.., k*N, ..]``, makes copies (a refinement of ``shape_rules``' view rule:
``rule_registry.refine_rule``); ``copies_rule`` (called by ``moe_rules.routed_rule`` for every node reading
copies) accepts the exact split back, ``[.., k*N, ..] -> [.., k, N, ..]`` (TOKEN again), and ops whose ordinary
rule keeps the copies axis where it is, entry for entry. By that rule anything else along the copies axis couples
tokens and refuses the graph (``Coupling``; the cases: docs/design.md, "MoE dispatch"). Copies of a value with
more than one entry per token are not made (computed in the original layout).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph.meta import ev as _ev
from .node_info import Coupling, Kind, NodeInfo, Route, RuleFailed, hint, kind_of, op_name, shape_of
from .rule_registry import refine_rule, rule_for, token_rule

__all__ = ["copies_rule"]

_VIEWS = ("view", "reshape", "flatten", "unflatten")
_VIEW_FUNCS = (torch.reshape, torch.flatten)


def _copies(info, x) -> bool:
    i = info.get(x) if isinstance(x, fx.Node) else None
    return i is not None and i.kind is Kind.ROUTED and i.route is not None and i.route.what == "copies"


def _one_per_token(i: NodeInfo, shape, B: int):
    """The dim of ``i``'s one token axis, ``"bs"`` with one entry per token at shift 0; None otherwise."""
    token = [d for d, t in enumerate(i.tags) if t is not None]
    if i.kind is not Kind.TOKEN or len(token) != 1 or i.tags[token[0]] != "bs" or i.shift or i.slen is None:
        return None
    return token[0] if shape[token[0]] == B * i.slen else None


@token_rule(methods=("repeat",))
def _repeat(node, info, B, S) -> NodeInfo:
    """``x.repeat(*counts)``: each dim tiled ``counts[d]`` times (whole, copy-major), new dims in front."""
    src = node.args[0]
    counts = node.args[1:]
    if len(counts) == 1 and isinstance(counts[0], (tuple, list)):
        counts = counts[0]
    counts = [hint(_ev(c)) if isinstance(c, fx.Node) else c for c in counts]
    t = info[src].tags
    extra = len(counts) - len(t)
    if node.kwargs or extra < 0 or not all(isinstance(c, int) for c in counts):
        raise RuleFailed("repeat with counts this rule does not read")
    out = [None] * extra + list(t)
    tiled = [d for d, tag in enumerate(t) if tag is not None and counts[extra + d] != 1]
    if not tiled:
        return NodeInfo(kind_of(tuple(out)), tuple(out))
    d = tiled[0]
    k = counts[extra + d]
    if _one_per_token(info[src], shape_of(src), B) != d or k < 2:
        raise RuleFailed(f"repeat along the {t[d]} axis of a value with token axes {t}")
    out[extra + d] = "r"
    return NodeInfo(Kind.ROUTED, tuple(out), slen=info[src].slen, route=Route(node, "copies", k))


def _non_unit(shape) -> list[tuple[int, int]]:
    return [(d, n) for d, n in enumerate(shape) if n != 1]


def _copies_view(node: fx.Node, info, B: int):
    """The merge ``[.., k, N, ..] -> [.., k*N, ..]`` of a TOKEN value (copies) or the split of a copies value back
    (TOKEN); None for any other view."""
    method, function = node.op == "call_method", node.op == "call_function"
    if not (method and node.target in _VIEWS or function and node.target in _VIEW_FUNCS):
        return None
    src = node.args[0]
    i, in_shape, out_shape = info[src], shape_of(src), shape_of(node)
    ins, outs = _non_unit(in_shape), _non_unit(out_shape)
    if i.kind is Kind.TOKEN:
        d = _one_per_token(i, in_shape, B)
        pos = [j for j, (dim, _) in enumerate(ins) if dim == d]
        if d is None or not pos or pos[0] == 0 or i.tags[ins[pos[0] - 1][0]] is not None:
            return None
        j = pos[0]
        k, n = ins[j - 1][1], ins[j][1]
        if [s for _, s in outs] != [s for _, s in ins[: j - 1]] + [k * n] + [s for _, s in ins[j + 1 :]]:
            return None
        tags = [None] * len(out_shape)
        tags[outs[j - 1][0]] = "r"
        return NodeInfo(Kind.ROUTED, tuple(tags), slen=i.slen, route=Route(node, "copies", k))
    if not _copies(info, src):
        return None
    d = i.tags.index("r")
    k, n = i.route.factor, B * i.slen
    j = next(j for j, (dim, _) in enumerate(ins) if dim == d)
    if [s for _, s in outs] != [s for _, s in ins[:j]] + [k, n] + [s for _, s in ins[j + 1 :]]:
        return None
    tags = [None] * len(out_shape)
    tags[outs[j + 1][0]] = "bs"
    return NodeInfo(Kind.TOKEN, tuple(tags), slen=i.slen)


@refine_rule(*_VIEW_FUNCS, methods=_VIEWS)
def _merge_copies(node, info, B, S):
    """A TOKEN value's ``[.., k, N, ..] -> [.., k*N, ..]``: copies (module docstring); None for other views."""
    return _copies_view(node, info, B) if info[node.args[0]].kind is Kind.TOKEN else None


def copies_rule(node: fx.Node, info, B, S) -> NodeInfo:
    """The ``NodeInfo`` of a node reading copies (and no ORIG value), or ``Coupling`` naming the op."""
    name = op_name(node)
    routed = [info[a] for a in node.all_input_nodes if info[a].kind is Kind.ROUTED]
    if not all(_copies(info, a) for a in node.all_input_nodes if info[a].kind is Kind.ROUTED):
        raise Coupling(f"{name} combines expert-major copies of the tokens with an expert sort's values")
    if len({(r.route.factor, r.slen) for r in routed}) > 1:
        raise Coupling(f"{name} combines expert-major copies of the tokens of different counts")
    first = routed[0]
    view = _copies_view(node, info, B)
    if view is not None:
        return view
    rule = rule_for(node)
    if rule is None:
        raise Coupling(f"no token-axis rule for {name} of expert-major copies of the tokens")
    try:
        res = rule(node, info, B, S)
    except RuleFailed as e:
        raise Coupling(f"{name} of expert-major copies of the tokens: {e}") from None
    if res.kind is not Kind.ROUTED or res.tags.count("r") != 1 or any(t not in (None, "r") for t in res.tags):
        raise Coupling(f"{name} moves expert-major copies of the tokens to token axes {res.tags}")
    return NodeInfo(Kind.ROUTED, res.tags, slen=first.slen, route=Route(first.route.order, "copies", first.route.factor))
