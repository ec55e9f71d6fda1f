"""Token-axis rules of MoE routing and expert dispatch, as Hugging Face writes them (Qwen2/3-MoE, Mixtral, Llama 4).

Routing is per token: the router's logits, their softmax, ``topk`` over the experts, and the expert outputs
weighted and summed over the top-k are each a function of the token's own hidden state, so the packed stream
computes them exactly. Registered here (``rule_registry`` has the registry and the contract of a rule):

* ``topk``, ``sort``, ``argsort`` along a feature dim, ``one_hot`` of expert ids, and ``repeat_interleave`` along
  a token axis keep the token axes;
* ``histc`` and ``bincount`` of a token value count over every token of the batch: computed in the original
  layout (``RuleFailed``), as a load-balancing loss's statistics are;
* ``sort`` of a 1-D integer value along its merged token axis starts the grouped dispatch (gathers by the
  permutation, ``histc`` + ``cumsum`` group offsets, grouped matmuls, the inverse permutation): each step is a
  ``Kind.ROUTED`` value (``node_info.Route`` says which), computed on the packed stream only; the result read
  through the inverse permutation is, at each token, the same function of that token's inputs whatever the
  order or number of tokens sorted. ``routed_rule`` (called by the driver for every node that reads a ROUTED
  value) accepts exactly those steps, each checked, and hands Llama 4's expert-major copies to
  ``moe_copies.copies_rule``; anything else reading a ROUTED value couples tokens and refuses the graph.

Capacity-limited routing (tokens dropped when an expert is full) needs a cumulative count along the token axis,
which ``_cumulative`` refuses (docs/design.md, "MoE dispatch").
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..graph.meta import ev as _ev
from .node_info import Coupling, Kind, NodeInfo, Route, RuleFailed, arg, hint, kind_of, op_name, shape_of
from .moe_copies import copies_rule
from .rule_registry import rule_for, token_rule
from .token_reductions import weighted_histc_rule

__all__ = ["routed_rule"]


@token_rule(torch.topk, torch.sort, torch.argsort, methods=("topk", "sort", "argsort"))
def _select(node, info, B, S) -> NodeInfo:
    """``topk``/``sort``/``argsort`` along a feature dim: each token's own values, reordered or selected."""
    src = node.args[0]
    t = info[src].tags
    name = op_name(node)
    dim = arg(node, 2, "dim", -1) if name == "topk" else arg(node, 1, "dim", -1)
    if not isinstance(dim, int):
        raise RuleFailed(f"{name} with dim {dim!r}")
    if t[dim % len(t)] is None:
        return NodeInfo(kind_of(t), t)
    if name == "sort" and _expert_sort(node, info[src], B):
        n = shape_of(src)[0]
        return NodeInfo(Kind.ROUTED, ("r",), slen=info[src].slen, route=Route(node, "sort", n // (B * info[src].slen)))
    raise RuleFailed(f"{name} along a token axis")


def _expert_sort(node, src: NodeInfo, B) -> bool:
    """An ascending sort of 1-D integer ids along their merged token axis (the grouped dispatch's)."""
    ev = _ev(node.args[0])
    return (
        src.kind is Kind.TOKEN and src.tags == ("bs",) and src.shift == 0 and src.slen is not None
        and not ev.dtype.is_floating_point and not ev.dtype.is_complex and ev.dtype is not torch.bool
        and arg(node, 2, "descending", False) is False and hint(ev.shape[0]) % (B * src.slen) == 0
    )


@token_rule(F.one_hot)
def _one_hot(node, info, B, S) -> NodeInfo:
    classes = arg(node, 1, "num_classes", -1)
    if not isinstance(classes, int) or classes < 1:
        # The default counts classes from the largest id over every token: the packed stream may not hold it.
        raise RuleFailed("one_hot with num_classes inferred from the largest id over every token")
    t = info[node.args[0]].tags + (None,)
    return NodeInfo(kind_of(t), t)


@token_rule(torch.histc, torch.bincount, methods=("histc", "bincount"))
def _count(node, info, B, S) -> NodeInfo:
    if op_name(node) == "histc":
        return weighted_histc_rule(node, info, B, S)  # counts weighted by multiplicity, or RuleFailed
    # bincount's length follows the largest entry, padding's included: not a weighted sum of the packed tokens.
    raise RuleFailed(f"{op_name(node)} counts entries over every token of the batch")


@token_rule(torch.scatter, methods=("scatter",))
def _scatter_within_token(node, info, B, S) -> NodeInfo:
    """``mask.scatter(1, idx, 1)`` along a dim without a token axis, index (and source) per token: each token's
    own entries (DeepSeek-V3's group-limited routing marks each token's top groups)."""
    base, dim, index = node.args[:3]
    src = arg(node, 3, "src", arg(node, 3, "value"))
    t = info[base].tags
    if not isinstance(dim, int) or t[dim % len(t)] is not None:
        raise RuleFailed("scatter along a token axis")
    if set(node.kwargs) - {"src", "value"} or len(node.args) > 4:
        raise RuleFailed("scatter with a reduction")
    ts = [info[index].tags] + ([info[src].tags] if isinstance(src, fx.Node) else [])
    token_dims = [d for d, tag in enumerate(t) if tag is not None]
    if any(x != t for x in ts) or any(hint(_ev(index).shape[d]) != hint(_ev(base).shape[d]) for d in token_dims):
        raise RuleFailed("scatter whose index does not follow its tensor's token axes")
    return NodeInfo(kind_of(t), t)


@token_rule(torch.repeat_interleave, methods=("repeat_interleave",))
def _repeat_interleave(node, info, B, S) -> NodeInfo:
    """Each entry repeated k times in place: along a merged or sequence axis, still token-major."""
    t = info[node.args[0]].tags
    repeats, dim = arg(node, 1, "repeats"), arg(node, 2, "dim")
    if dim is None and len(t) == 1:
        dim = 0  # without a dim the input is flattened first: a 1-d value keeps its order
    if not isinstance(repeats, int) or not isinstance(dim, int):
        raise RuleFailed("repeat_interleave without an int count and dim")
    if t[dim % len(t)] not in (None, "bs", "s"):
        raise RuleFailed(f"repeat_interleave along the {t[dim % len(t)]} axis")
    return NodeInfo(kind_of(t), t)


# ---------------------------------------------------------------- the grouped dispatch (ROUTED values)

_CASTS = {"to", "float", "int", "long", "double", "half", "bfloat16", "type"}
_GROUPED_MM = {torch._grouped_mm, getattr(F, "grouped_mm", torch._grouped_mm)}
_GROUPED_MM_OPS = {"transformers::grouped_mm_fallback"}
_RANDOM_LIKE = {torch.rand_like, torch.randn_like, torch.randint_like}


def routed_rule(node: fx.Node, info, B, S) -> NodeInfo:
    """The ``NodeInfo`` of a node reading a ROUTED value, or ``Coupling`` naming the op."""
    ins = [info[a] for a in node.all_input_nodes]
    name = op_name(node)
    if any(i.kind is Kind.ORIG for i in ins):
        raise Coupling(f"{name} combines MoE routing values with a value computed in the original layout")
    if node.target in _RANDOM_LIKE:
        # The original draws for every copy of a shared prompt's entries, the packed stream once for all of them.
        raise Coupling(f"{name} draws different values for the copies of a shared prompt")
    if any(i.kind is Kind.ROUTED and i.route.what == "copies" for i in ins):
        return copies_rule(node, info, B, S)  # Llama 4's expert-major copies (moe_copies)
    orders = {i.route.order for i in ins if i.kind is Kind.ROUTED}
    if len(orders) > 1:
        raise Coupling(f"{name} combines the values of two expert sorts")
    (order,) = orders
    for step in (_sort_element, _gather, _floordiv, _empty_like, _inverse, _histc, _offsets, _grouped_mm):
        res = step(node, info, B, order)
        if res is not None:
            return res
    return _entrywise(node, info, B, S, order)


def _routed(tags, order: fx.Node, info, what: str, factor: int = 1) -> NodeInfo:
    return NodeInfo(Kind.ROUTED, tuple(tags), slen=info[order].slen, route=Route(order, what, factor))


def _route(info, x):
    i = info.get(x) if isinstance(x, fx.Node) else None
    return i.route if i is not None and i.kind is Kind.ROUTED else None


def _sort_element(node, info, B, order):
    """``sort(ids)[0]``: the sorted keys; ``[1]``: the permutation, indices into the merged token axis."""
    if node.target is not operator.getitem or getattr(_route(info, node.args[0]), "what", None) != "sort":
        return None
    src = info[node.args[0]]
    if node.args[1] == 0:
        return _routed(("r",), order, info, "keys")
    return _routed(("r",), order, info, "perm", src.route.factor)


def _index(node):
    idx = node.args[1]
    if isinstance(idx, tuple) and len(idx) == 1:
        idx = idx[0]
    return idx if isinstance(idx, fx.Node) else None


def _gather(node, info, B, order):
    """``x[perm]``: a token value read in sorted order; ``v[inverse]``: sorted values back in token order."""
    if node.target is not operator.getitem or not isinstance(_ev(node.args[0]), torch.Tensor):
        return None
    src, idx = node.args[0], _index(node)
    route, s = _route(info, idx), info[src]
    if route is None or route.what not in ("perm", "inverse"):
        return None
    rest = s.tags[1:]
    if any(t is not None for t in rest):
        raise Coupling(f"{op_name(node)}: MoE routing indices into a value with token axes {s.tags}")
    if route.what == "perm":
        if s.kind is not Kind.TOKEN or s.tags[:1] != ("bs",) or s.shift or s.slen != info[order].slen:
            raise Coupling(f"{op_name(node)}: a sort permutation indexes a value that is not per token ({s.tags})")
        if shape_of(src)[0] != B * s.slen * route.factor:
            raise Coupling(f"{op_name(node)}: a sort permutation indexes a token axis of {shape_of(src)[0]} entries, "
                           f"not {route.factor} per token")
        return _routed(("r",) + rest, order, info, "values")
    if s.kind is not Kind.ROUTED or s.tags[:1] != ("r",) or s.route.what not in ("keys", "values"):
        raise Coupling(f"{op_name(node)}: an inverse permutation indexes a value that is not in sorted order")
    return NodeInfo(Kind.TOKEN, ("bs",) + rest, slen=info[idx].slen)


def _floordiv(node, info, B, order):
    """``perm // k``: entry indices with k entries per token -> token indices (the top-k's token)."""
    if node.target is not operator.floordiv:
        return None
    route, k = _route(info, node.args[0]), node.args[1]
    if route is None or route.what != "perm":
        return None
    if not isinstance(k, int) or k <= 0 or route.factor % k:
        raise Coupling(f"floordiv of a sort permutation by {k!r}, not a divisor of its {route.factor} entries per token")
    return _routed(("r",), order, info, "perm", route.factor // k)


def _empty_like(node, info, B, order):
    if node.target is not torch.empty_like:
        return None
    if info[node.args[0]].tags != ("r",):
        raise Coupling("empty_like of a MoE routing value that is not 1-D in sorted order")
    return _routed(("r",), order, info, "empty")


def _inverse(node, info, B, order):
    """``inv[perm] = arange(n)`` on ``inv = empty_like(perm)``: each entry's position in the sorted order.

    Exact on the packed stream because ``perm`` is a whole permutation of the entries, so every entry of
    ``inv`` is written; the packed graph writes ``arange(T * top_k)`` (pack_graph).
    """
    if node.target is not operator.setitem:
        return None
    target, value = node.args[0], node.args[2]
    route, t_route = _route(info, _index(node)), _route(info, target)
    why = None
    if t_route is None or t_route.what != "empty":
        why = "writes into a MoE routing value other than a fresh empty_like"
    elif route is None or route.what != "perm" or route.factor != info[order].route.factor:
        why = "is not indexed by a whole sort permutation"
    elif not _is_arange(value, shape_of(target)[0]):
        why = "does not write arange(n), n the sorted length"
    elif _read_before(target, node):
        why = f"{target.name} is read before it is written"
    if why is not None:
        raise Coupling(f"setitem {why}")
    info[target] = NodeInfo(Kind.ROUTED, ("bs",), slen=info[order].slen, route=Route(order, "inverse", route.factor))
    return NodeInfo(Kind.ROUTED, (), slen=info[order].slen, route=Route(order, "mutation"))


def _is_arange(value, n: int) -> bool:
    if not (isinstance(value, fx.Node) and value.op == "call_function" and value.target is torch.arange):
        return False
    args = tuple(hint(_ev(a)) if isinstance(a, fx.Node) else a for a in value.args)
    return args in ((n,), (0, n), (0, n, 1)) and set(value.kwargs) <= {"device", "dtype", "layout", "pin_memory", "requires_grad"}


def _read_before(target: fx.Node, node: fx.Node) -> bool:
    n = target.next
    while n is not node:
        if n in target.users:
            return True
        n = n.next
    return False


def _histc(node, info, B, order):
    """``histc(keys, bins=E, min=0, max=E-1 or E)``: entries per expert, each integer id in its own bin."""
    if op_name(node) != "histc":
        return None
    route = _route(info, node.args[0])
    bins, lo, hi = arg(node, 1, "bins", 100), arg(node, 2, "min", 0), arg(node, 3, "max", 0)
    if route.what != "keys":
        raise Coupling("histc of MoE routing values other than the sorted expert ids")
    if not all(isinstance(v, (int, float)) for v in (bins, lo, hi)) or lo >= hi:
        raise Coupling(f"histc of the sorted expert ids with bounds {lo!r}, {hi!r}")
    for j in range(int(bins)):
        h = torch.histc(torch.tensor([float(j)]), bins=int(bins), min=lo, max=hi)
        if h[j] != 1:
            raise Coupling(f"histc(bins={bins}, min={lo}, max={hi}) does not give expert id {j} a bin of its own")
    return _routed((None,), order, info, "counts")


def _offsets(node, info, B, order):
    if op_name(node) != "cumsum" or getattr(_route(info, node.args[0]), "what", None) != "counts":
        return None
    if arg(node, 1, "dim") not in (0, -1):
        raise Coupling("cumsum of expert counts along another dim")
    return _routed((None,), order, info, "offsets")


def _grouped_mm(node, info, B, order):
    """``grouped_mm(x, w[E, K, N], offs)``: row i of sorted-order ``x`` times its expert's weight."""
    target = node.target
    qual = getattr(getattr(target, "overloadpacket", target), "_qualified_op_name", None)
    if target not in _GROUPED_MM and qual not in _GROUPED_MM_OPS:
        return None
    x, w, offs = node.args[0], node.args[1], arg(node, 2, "offs")
    rx, ro = _route(info, x), _route(info, offs)
    if rx is None or rx.what not in ("keys", "values") or info[x].tags != ("r", None):
        raise Coupling(f"{op_name(node)} of a value that is not [entries in sorted order, features]")
    if ro is None or ro.what != "offsets":
        raise Coupling(f"{op_name(node)} with group offsets other than those of its sort")
    if info[w].kind is not Kind.NONE or _ev(w).dim() != 3 or shape_of(w)[0] != shape_of(offs)[0]:
        raise Coupling(f"{op_name(node)} with a weight that is not [experts, K, N] for its {shape_of(offs)[0]} groups")
    if node.kwargs.get("bias") is not None:
        raise Coupling(f"{op_name(node)} with a bias")
    return _routed(("r", None), order, info, "values")


def _entrywise(node, info, B, S, order) -> NodeInfo:
    """Any other op on sorted keys or values: its ordinary rule, which must keep the one sorted axis."""
    name = op_name(node)
    read = [info[a].route.what for a in node.all_input_nodes if info[a].kind is Kind.ROUTED]
    bad = [w for w in read if w not in ("keys", "values")]
    if bad:
        raise Coupling(f"{name} reads the MoE routing's {bad[0]} as data (it depends on every token of the batch)")
    rule = rule_for(node)
    if rule is None:
        raise Coupling(f"no token-axis rule for {name} of expert-sorted values")
    try:
        res = rule(node, info, B, S)
    except RuleFailed as e:
        raise Coupling(f"{name} of expert-sorted values: {e}") from None
    if res.kind is not Kind.ROUTED or res.tags.count("r") != 1 or any(t not in (None, "r") for t in res.tags):
        raise Coupling(f"{name} moves expert-sorted values to token axes {res.tags}")
    keys = read == ["keys"] and node.op == "call_method" and node.target in _CASTS
    return _routed(res.tags, order, info, "keys" if keys else "values")
