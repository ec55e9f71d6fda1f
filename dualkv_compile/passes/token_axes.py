"""Analysis: tag every value of a Dynamo FX graph with its token axes.

Contract
    Input: a torch-level FX graph with static shapes (every node carries
    ``meta["example_value"]``), the placeholders that hold token inputs
    (``input_ids``, ``attention_mask``, ``position_ids``, ``inputs_embeds``) and
    the batch's ``B`` and ``S``.
    Output: ``TokenAxes``: for each node a ``NodeInfo`` with one tag per
    dimension (``"b"`` the batch axis, ``"s"`` the sequence axis, ``"bs"`` the two
    merged batch-major, or None) and a *kind*:

        TOKEN   per-token value with a batch and a sequence axis, computable on
                the packed stream (batch axis of size 1, sequence axis of size T)
        COLUMN  depends on the column only (e.g. ``arange(S)``, ``position_ids``
                of shape ``[1, S]``); packed by gathering each token's column
        BCAST   a constant expanded over the batch axis (``x[None].expand(B, ...)``,
                as rotary tables are built from ``position_ids.shape[0]``); on
                the packed stream the expand is to 1
        NONE    no token axes (parameters, scalars, constants)
        ORIG    must be computed in the original ``[B, S]`` layout: it mixes
                tokens (reduction, shift or slice along the sequence), or derives
                from a value that does; ``cause`` says which node and why

    and the graph's attention matches. The graph is not modified.

Rules are per op: pointwise ops broadcast tags; linear/matmul/embedding keep
the token axes of their token operand; view/reshape/flatten group dimensions
and may merge ``b`` and ``s`` into ``bs`` (or split it back); transpose,
permute, unsqueeze, expand and indexing move tags; reductions over feature
dimensions drop them. Anything else that touches a token value is ORIG.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .attention_match import AttentionMatch, find_attention

__all__ = ["Kind", "NodeInfo", "TokenAxes", "Refusal", "analyze_token_axes"]


class Kind(enum.Enum):
    TOKEN = "token"
    COLUMN = "column"
    BCAST = "bcast"
    NONE = "none"
    ORIG = "orig"


Tags = tuple[Optional[str], ...]


@dataclasses.dataclass
class NodeInfo:
    kind: Kind
    tags: Tags = ()
    cause: Optional[str] = None  # for ORIG: the first reason in its ancestry
    # TOKEN values only. shift 1: column c holds the value of the token at
    # column c + 1 (``x[:, 1:]``, the next-token targets). slen: the length of
    # the sequence axis in the original layout (S, or S - 1 after ``x[:, :-1]``
    # or ``x[:, 1:]``). The packed value is the same either way: one per token.
    shift: int = 0
    slen: Optional[int] = None


@dataclasses.dataclass
class TokenAxes:
    """``info`` per node; ``B``/``S`` the batch's sizes (the example's, for dynamic-shape graphs)."""

    B: int
    S: int
    info: dict[fx.Node, NodeInfo]
    attention: list[AttentionMatch]
    token_inputs: dict[str, fx.Node]
    refusals: list[str]


class Refusal(Exception):
    """The graph cannot be rewritten; the message says why."""


class _Fail(Exception):
    """No per-token rule applies: the value is computed in the original layout."""


class _Coupling(Exception):
    """An op that couples tokens of a packed value: the whole graph is refused."""


_POINTWISE_FUNCS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.pow,
    operator.neg, operator.pos, operator.and_, operator.or_, operator.xor, operator.invert, operator.mod,
    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
    torch.add, torch.sub, torch.mul, torch.div, torch.pow, torch.rsqrt, torch.sqrt, torch.exp, torch.log,
    torch.tanh, torch.sigmoid, torch.sin, torch.cos, torch.neg, torch.abs, torch.where, torch.clamp,
    torch.maximum, torch.minimum, torch.erf, torch.reciprocal, torch.square, torch.masked_fill,
    F.silu, F.gelu, F.relu, F.tanh, F.sigmoid, F.softplus, F.mish, F.leaky_relu, torch._C._nn.gelu,
    torch.nn.functional.hardtanh, torch.log1p, torch.expm1, torch.sign, torch.logical_and, torch.logical_or,
    torch.logical_not, torch.nan_to_num, torch.gather,
}
_POINTWISE_METHODS = {
    "to", "float", "half", "bfloat16", "double", "type_as", "contiguous", "clone", "detach", "pow", "rsqrt",
    "sqrt", "exp", "log", "sin", "cos", "neg", "abs", "sigmoid", "tanh", "mul", "add", "sub", "div", "clamp",
    "type", "masked_fill", "requires_grad_", "__and__", "__or__", "__invert__", "long", "int", "bool",
    "log1p", "expm1", "square", "reciprocal", "float_power", "nan_to_num", "where", "fill_", "zero_", "gather",
}
_REDUCE_METHODS = {"mean", "sum", "amax", "amin", "norm", "var", "std", "logsumexp", "prod"}
_REDUCE_FUNCS = {torch.mean, torch.sum, torch.amax, torch.amin, torch.norm, torch.var, torch.std, torch.logsumexp}
_SOFTMAX_LIKE = {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax}
_SOFTMAX_METHODS = {"softmax", "log_softmax"}
_SIDE_EFFECTS = {torch._C._set_grad_enabled, torch._C._log_api_usage_once}
_LIKE_FUNCS = {torch.ones_like, torch.zeros_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like}
_COUPLING_FUNCS = {
    F.batch_norm: "batch_norm mixes values across the batch",
    torch.batch_norm: "batch_norm mixes values across the batch",
    F.instance_norm: "instance_norm mixes values along the sequence",
}


def _ev(x):
    return x.meta.get("example_value") if isinstance(x, fx.Node) else None


def hint(x) -> int:
    """A size as an int: symbolic sizes (dynamic-shape graphs) by the example's value."""
    if isinstance(x, torch.SymInt):
        return int(x.node.hint)
    return int(x)


def shape_of(x) -> list[int]:
    """The example shape of node ``x`` (hints for symbolic sizes)."""
    return [hint(d) for d in _ev(x).shape]


def _is_tensor(x) -> bool:
    return isinstance(_ev(x), torch.Tensor)


def analyze_token_axes(gm: fx.GraphModule, token_inputs: dict[str, fx.Node], batch_shape: Optional[tuple[int, int]] = None) -> TokenAxes:
    """Tag every node (see the module docstring).

    ``B`` and ``S`` come from ``input_ids``; a graph without them (a part of
    a model after a graph break) is analysed when ``batch_shape`` gives them,
    its token-major inputs named in ``token_inputs`` under the roles
    ``"carried:<name>"`` (``[B, S, ...]``: hidden states, positions) and
    ``"column:<name>"`` (``[1, S, ...]``: values of the column only).
    """
    graph = gm.graph
    refusals: list[str] = []
    for node in graph.nodes:
        if node.op == "call_function" and "flex_attention" in getattr(node.target, "__name__", str(node.target)):
            raise Refusal(
                f"{node.name}: flex_attention with a block mask made outside this graph (Hugging Face's "
                "\"flex_attention\" implementation) cannot be checked or rebuilt for the packed stream; "
                "use attn_implementation=\"sdpa\" or \"eager\""
            )
    ids = token_inputs.get("input_ids")
    if ids is None and batch_shape is None:
        raise Refusal(
            "no input_ids among this graph's inputs: the layout is detected from token ids "
            "(a graph break may have split the model, leaving this part without them)"
        )
    if ids is not None:
        if _ev(ids).dim() != 2:
            raise Refusal(f"input_ids has shape {shape_of(ids)}, expected [B, S]")
        B, S = shape_of(ids)
    else:
        B, S = batch_shape
    for node in graph.find_nodes(op="placeholder"):
        name = node.name.lower()
        if "past_key" in name or "cache" in name and "cache_position" not in name:
            raise Refusal(f"{node.name}: a KV cache is passed in; packed training needs the full sequence in one call")

    matches = find_attention(graph)
    by_output = {m.output: m for m in matches}
    internal = {n for m in matches for n in m.nodes if n is not m.output}
    info: dict[fx.Node, NodeInfo] = {}
    for node in graph.nodes:
        if node.op == "output":
            continue
        try:
            if node in internal:
                info[node] = NodeInfo(Kind.ORIG, cause=f"{node.name}: inside an attention pattern")
            elif node in by_output:
                info[node] = _attention_info(by_output[node], info)
            else:
                info[node] = _rule(node, info, token_inputs, B, S)
        except _Fail as e:
            info[node] = NodeInfo(Kind.ORIG, _untagged(_ev(node)), cause=f"{node.name}: {e}")
        except _Coupling as e:
            refusals.append(f"{node.name}: {e}")
            info[node] = NodeInfo(Kind.ORIG, cause=f"{node.name}: {e}")
    for m in matches:
        if m.refusal:
            refusals.append(m.refusal)
        elif info[m.output].kind is not Kind.TOKEN:
            refusals.append(f"{m.output.name}: attention cannot run on the packed stream: {info[m.output].cause}")
    return TokenAxes(B, S, info, matches, token_inputs, refusals)


def _untagged(ev) -> Tags:
    """No token axes, one entry per dimension of the example value (none for non-tensors)."""
    return (None,) * ev.dim() if isinstance(ev, torch.Tensor) else ()


def _attention_info(m: AttentionMatch, info) -> NodeInfo:
    qkv = [info.get(x) for x in (m.q, m.k, m.v)]
    for name, i in zip("qkv", qkv):
        if i is None or i.kind is not Kind.TOKEN:
            cause = i.cause if i is not None and i.cause else f"{name} is not a per-token value"
            return NodeInfo(Kind.ORIG, cause=cause)
        if i.tags != ("b", None, "s", None):
            return NodeInfo(Kind.ORIG, cause=f"{name} has token axes {i.tags}, expected [b, heads, s, dim]")
    return NodeInfo(Kind.TOKEN, ("b", None, "s", None), slen=qkv[0].slen)


def _rule(node: fx.Node, info, token_inputs, B, S) -> NodeInfo:
    ev = _ev(node)
    if node.op == "placeholder":
        for role, ph in token_inputs.items():
            if ph is node:
                return _input_info(role, ev, B, S)
        return NodeInfo(Kind.NONE, _untagged(_ev(node)))
    if node.op == "get_attr":
        return NodeInfo(Kind.NONE, _untagged(_ev(node)))
    ins = [info[a] for a in node.all_input_nodes]
    if node.op == "call_function" and node.target in _SIDE_EFFECTS:
        return NodeInfo(Kind.NONE)
    orig = [i for i in ins if i.kind is Kind.ORIG]
    if orig:
        return NodeInfo(Kind.ORIG, _untagged(_ev(node)), cause=orig[0].cause)
    if all(i.kind is Kind.NONE for i in ins):
        if node.op == "call_method" and node.target == "expand":
            return _move(node, info, B, S)
        return _creation_info(node, ev, B, S)
    # From here on at least one input is TOKEN or COLUMN.
    if node.op == "call_function" and node.target in _COUPLING_FUNCS:
        raise _Coupling(_COUPLING_FUNCS[node.target])
    if node.op == "call_function" and node.target in (F.dropout, torch.dropout):
        p, training = _arg(node, 1, "p", 0.5), _arg(node, 2, "training", True)
        if p != 0 and training is not False:
            raise _Coupling(f"dropout p={p} in training mode draws different masks for the copies of a shared prompt")
        return _same(node, info)
    if node.op == "call_method" and node.target in ("cumsum", "cumprod") or node.op == "call_function" and node.target in (torch.cumsum, torch.cumprod):
        src = node.args[0]
        dim = _arg(node, 1, "dim")
        t = info[src].tags
        if isinstance(dim, int) and t and t[dim % len(t)] in ("s", "bs"):
            raise _Coupling("cumulative sum along the sequence axis couples tokens beyond causal attention")
        return _same(node, info)
    if not isinstance(ev, (torch.Tensor, tuple, list)):
        raise _Fail(f"{_op_name(node)} of a token value gives a non-tensor")
    res = _token_rule(node, info, B, S)
    if res.kind in (Kind.TOKEN, Kind.COLUMN) and res.slen is None:
        _inherit_shift(node, res, info)
    return res


def _inherit_shift(node: fx.Node, res: NodeInfo, info) -> None:
    """A result's shift and sequence length follow its token operands.

    Operands of different shifts meet in the next-token pattern (log-probs at
    column c with the ids at column c + 1): the result is indexed by the
    target token (shift 1) and the rewrite reads the shift-0 operand at each
    token's predecessor. Only pointwise ops and gathers may mix shifts.
    """
    toks = [info[a] for a in node.all_input_nodes if info[a].kind in (Kind.TOKEN, Kind.COLUMN)]
    shifts = {i.shift for i in toks}
    res.shift = max(shifts)
    res.slen = min(i.slen for i in toks)
    if len(shifts) > 1:
        pointwise = node.op == "call_function" and node.target in _POINTWISE_FUNCS or node.op == "call_method" and node.target in _POINTWISE_METHODS
        if not pointwise:
            raise _Fail(f"{_op_name(node)} combines values shifted along the sequence")
        if any(i.kind is Kind.COLUMN and i.shift == 0 for i in toks):
            raise _Fail("combines a column value with next-token values")


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _op_name(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _kind(tags: Tags) -> Kind:
    if any(t in ("s", "bs") for t in tags):
        return Kind.TOKEN if any(t in ("b", "bs") for t in tags) else Kind.COLUMN
    if "b" in tags:
        # Only expands of constants make batch-only tags (see _move), so the
        # value is the same in every row.
        return Kind.BCAST
    return Kind.NONE


def _input_info(role: str, ev, B: int, S: int) -> NodeInfo:
    shape = [hint(d) for d in ev.shape]
    if role.startswith("carried:") or role == "inputs_embeds":
        return NodeInfo(Kind.TOKEN, ("b", "s") + (None,) * (ev.dim() - 2), slen=S)
    if role.startswith("column:"):
        return NodeInfo(Kind.COLUMN, (None, "s") + (None,) * (ev.dim() - 2), slen=S)
    if ev.dim() != 2 or shape[1] != S or shape[0] not in (1, B):
        return NodeInfo(Kind.ORIG, _untagged(ev), cause=f"{role} has shape {shape}, expected [B, S]")
    if shape[0] == 1 and B > 1:
        return NodeInfo(Kind.COLUMN, (None, "s"), slen=S)
    return NodeInfo(Kind.TOKEN, ("b", "s"), slen=S)


def _creation_info(node: fx.Node, ev, B: int, S: int) -> NodeInfo:
    if node.op == "call_function" and node.target is torch.arange and isinstance(ev, torch.Tensor):
        # arange(S) is the column index (positions, cache_position); arange(B)
        # the row index, which only a mask builds on.
        if ev.dim() == 1 and hint(ev.shape[0]) == S and S != B:
            return NodeInfo(Kind.COLUMN, ("s",), slen=S)
    if isinstance(ev, torch.Tensor):
        return NodeInfo(Kind.NONE, (None,) * ev.dim())
    return NodeInfo(Kind.NONE)


def _same(node, info) -> NodeInfo:
    i = info[node.args[0]]
    return NodeInfo(_kind(i.tags), i.tags, shift=i.shift, slen=i.slen)


def _token_rule(node: fx.Node, info, B: int, S: int) -> NodeInfo:
    op, target = node.op, node.target
    if op == "call_function" and target in _POINTWISE_FUNCS or op == "call_method" and target in _POINTWISE_METHODS:
        return _broadcast(node, info, B, S)
    if op == "call_function" and target in _LIKE_FUNCS:
        return _same(node, info)
    if op == "call_function" and target in (F.linear, torch._C._nn.linear):
        x, w = node.args[0], node.args[1]
        b = _arg(node, 2, "bias")
        if info[w].kind is not Kind.NONE or (isinstance(b, fx.Node) and info[b].kind is not Kind.NONE):
            raise _Fail("linear with a token-dependent weight")
        t = info[x].tags
        if t[-1] is not None:
            raise _Fail("linear over a token axis")
        return NodeInfo(_kind(t), t)
    if op == "call_function" and target in (F.embedding, torch.embedding):
        ids, w = node.args[0], node.args[1]
        if info[w].kind is not Kind.NONE:
            raise _Fail("embedding with a token-dependent table")
        t = info[ids].tags + (None,)
        return NodeInfo(_kind(t), t)
    if op == "call_function" and target in (torch.matmul, operator.matmul, torch.bmm):
        return _matmul(node, info)
    if op == "call_method" and target in ("view", "reshape") or op == "call_function" and target is torch.reshape:
        return _view(node, info, B, S)
    if op == "call_method" and target in ("flatten", "unflatten") or op == "call_function" and target in (torch.flatten,):
        return _view(node, info, B, S)
    if op == "call_method" and target in ("transpose", "permute", "unsqueeze", "squeeze", "expand", "movedim", "t") or op == "call_function" and target in (torch.transpose, torch.permute, torch.unsqueeze, torch.squeeze, torch.movedim):
        return _move(node, info, B, S)
    if op == "call_function" and target is operator.getitem:
        return _getitem(node, info, B, S)
    if op == "call_function" and target is torch.cat:
        return _cat(node, info)
    if op == "call_function" and target is torch.stack:
        ts = [info[x].tags for x in node.args[0]]
        dim = _arg(node, 1, "dim", 0)
        return _merge_tags(node, ts, insert_at=dim)
    if op == "call_method" and target in ("split", "chunk", "unbind") or op == "call_function" and target in (torch.split, torch.chunk, torch.unbind):
        t = info[node.args[0]].tags
        dim = _arg(node, 2 if target in ("split", "chunk", torch.split, torch.chunk) else 1, "dim", 0)
        if t[dim % len(t)] is not None:
            raise _Fail("split along a token axis")
        if target in ("unbind", torch.unbind):
            t = t[: dim % len(t)] + t[dim % len(t) + 1:]
        return NodeInfo(_kind(t), t)
    if op == "call_method" and target in _REDUCE_METHODS or op == "call_function" and target in _REDUCE_FUNCS:
        return _reduce(node, info)
    if op == "call_function" and target in _SOFTMAX_LIKE or op == "call_method" and target in _SOFTMAX_METHODS:
        t = info[node.args[0]].tags
        dim = _arg(node, 1, "dim")
        if dim is None or t[dim % len(t)] is not None:
            raise _Fail("softmax along a token axis")
        return NodeInfo(_kind(t), t)
    if op == "call_function" and target in (F.layer_norm, F.rms_norm, torch.layer_norm, torch.rms_norm):
        t = info[node.args[0]].tags
        shape = node.args[1]
        if any(x is not None for x in t[len(t) - len(shape):]):
            raise _Fail("normalisation over a token axis")
        return NodeInfo(_kind(t), t)
    raise _Fail(f"no token-axis rule for {_op_name(node)}")


def _matmul(node, info) -> NodeInfo:
    """``[..., M, K] @ [..., K, N]``: batch dims broadcast, M keeps a's tag, N b's; K must carry none.

    Covers projections (a token value times a weight) and rotary tables built
    as ``inv_freq[:, None] @ positions[None, :]`` (a column value on the right).
    """
    a, b = node.args[:2]
    ta, tb = info[a].tags, info[b].tags
    if len(ta) < 2 or len(tb) < 2:
        raise _Fail("matmul with a vector operand")
    if ta[-1] is not None or tb[-2] is not None:
        raise _Fail("matmul that contracts over a token axis")
    n = max(len(ta), len(tb))
    batch_a = (None,) * (n - len(ta)) + ta[:-2]
    batch_b = (None,) * (n - len(tb)) + tb[:-2]
    batch = []
    for x, y in zip(batch_a, batch_b):
        if x is not None and y is not None and x != y:
            raise _Fail("matmul broadcasting different token axes")
        batch.append(x if x is not None else y)
    for x, xt in ((a, batch_a), (b, batch_b)):
        if info[x].kind is Kind.NONE:
            shape = [1] * (n - len(_ev(x).shape)) + shape_of(x)
            if any(tag is not None and shape[d] > 1 for d, tag in enumerate(batch)):
                raise _Fail("matmul broadcasting a constant over a token axis")
    t = tuple(batch) + (ta[-2], tb[-1])
    if sum(tag is not None for tag in t) > sum(tag is not None for tag in ta + tb) or (ta[-2] is not None and tb[-1] is not None):
        raise _Fail("matmul between two token values (attention-like)")
    return NodeInfo(_kind(t), t)


def _broadcast(node, info, B, S) -> NodeInfo:
    ev = _ev(node)
    if not isinstance(ev, torch.Tensor):
        raise _Fail("pointwise op without a tensor result")
    n = ev.dim()
    if node.target in ("gather", torch.gather):
        dim = _arg(node, 1, "dim")
        if not isinstance(dim, int) or info[node.args[0]].tags[dim % n] is not None:
            raise _Fail("gather along a token axis")
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
                raise _Fail(f"broadcasts token axis {tags[off + d]} against {tag}")
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
                raise _Fail(f"combines a constant of length {hint(a_ev.shape[d])} with the {tags[off + d]} axis")
    t = tuple(tags)
    return NodeInfo(_kind(t), t)


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
        if len(real_ins) == 1 and len(real_outs) == 1 and in_shape[real_ins[0]] == out_shape[real_outs[0]]:
            out[real_outs[0]] = tagged[0][1]
            continue
        kinds = [t for _, t in tagged]
        lead = real_ins[: len(tagged)]
        if lead != [d for d, _ in tagged]:
            raise _Fail("reshape that merges feature dims ahead of a token axis")
        if len(real_outs) == 1:  # merge
            merged = "".join(kinds)
            if merged not in ("s", "bs"):
                raise _Fail(f"reshape merging {kinds}")
            out[real_outs[0]] = merged
            continue
        if len(tagged) == 1 and len(real_ins) == 1:  # split
            kind = kinds[0]
            sizes = [out_shape[o] for o in real_outs]
            if kind == "bs" and sizes[0] == B and sizes[1] % S == 0:
                out[real_outs[0]], out[real_outs[1]] = "b", "s"
                if sizes[1] != S:
                    raise _Fail("reshape splitting the sequence axis")
                continue
            if kind == "s" and sizes[0] == S:
                out[real_outs[0]] = "s"
                continue
        raise _Fail(f"reshape {in_shape} -> {out_shape} that splits a token axis")
    t = tuple(out)
    return NodeInfo(_kind(t), t)


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
                raise _Fail(f"view from {a} to {b}")
        # Trailing size-1 dims join the group they follow.
        while i < len(a) and a[i] == 1 and (j >= len(b) or b[j] != 1):
            gi.append(i); i += 1
        while j < len(b) and b[j] == 1 and (i >= len(a) or a[i] != 1):
            gj.append(j); j += 1
        groups.append((gi, gj))
    return groups


def _move(node, info, B, S) -> NodeInfo:
    src = node.args[0]
    t = list(info[src].tags)
    n = len(t)
    target = node.target if node.op == "call_method" else node.target.__name__
    args = node.args[1:]
    if target == "transpose":
        d0, d1 = (args[0] % n, args[1] % n) if args else (_arg(node, 1, "dim0") % n, _arg(node, 2, "dim1") % n)
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
        d = _arg(node, 1, "dim")
        d = d % (n + 1)
        t.insert(d, None)
    elif target == "squeeze":
        out_ev = _ev(node)
        in_shape = shape_of(src)
        dims = args if args else tuple(range(n))
        dims = {d % n for d in (dims[0] if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims)}
        t = [tag for d, tag in enumerate(t) if not (d in dims and in_shape[d] == 1)]
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
        raise _Fail(f"no rule for {target}")
    t = tuple(t)
    return NodeInfo(_kind(t), t)


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
            return NodeInfo(_kind(tt), tt)
        raise _Fail("advanced indexing of a token value")
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
                raise _Fail("indexing a single position of a token axis")
            d += 1
        else:
            raise _Fail(f"index {i!r}")
    out.extend(t[d:])
    tt = tuple(out)
    return NodeInfo(_kind(tt), tt, shift=shift, slen=slen)


def _sequence_slice(i: slice, size: int, tag: str, src: NodeInfo) -> Optional[tuple[int, int]]:
    """None for a full slice; ``(shift, slen)`` for ``[:-1]`` (drop the last column) or ``[1:]`` (the next tokens)."""
    stop = hint(_ev(i.stop)) if isinstance(i.stop, fx.Node) else i.stop
    start = hint(_ev(i.start)) if isinstance(i.start, fx.Node) else i.start
    if i.step not in (None, 1):
        raise _Fail("strided slice along a token axis")
    start = 0 if start is None else start
    stop = size if stop is None else (stop + size if stop < 0 else min(stop, size))
    if (start, stop) == (0, size):
        return None
    if tag != "s" or src.kind is not Kind.TOKEN or src.slen != size or src.shift != 0:
        raise _Fail("slice along a token axis (other than one next-token shift)")
    if (start, stop) == (0, size - 1):
        return 0, size - 1
    if (start, stop) == (1, size):
        return 1, size - 1
    raise _Fail("slice along a token axis (other than one next-token shift)")


def _cat(node, info) -> NodeInfo:
    xs = node.args[0]
    dim = _arg(node, 1, "dim", 0)
    real = [x for x in xs if not (isinstance(_ev(x), torch.Tensor) and _ev(x).dim() == 1 and _ev(x).numel() == 0)]
    if not real:
        return NodeInfo(Kind.NONE, _untagged(_ev(node)))
    ts = [info[x].tags for x in real]
    n = len(ts[0])
    if len(real) > 1 and any(t[dim % n] is not None for t in ts):
        raise _Fail("concatenation along a token axis")
    return _merge_tags(node, ts)


def _merge_tags(node, ts, insert_at=None) -> NodeInfo:
    n = max(len(t) for t in ts)
    out: list[Optional[str]] = [None] * n
    for t in ts:
        for d, tag in enumerate(t):
            if tag is None:
                continue
            if out[d] not in (None, tag):
                raise _Fail("combines values with different token axes")
            out[d] = tag
    if any(t != tuple(out) for t in ts):
        raise _Fail("combines token and non-token values along one axis")
    if insert_at is not None:
        out.insert(insert_at % (n + 1), None)
    t = tuple(out)
    return NodeInfo(_kind(t), t)


def _reduce(node, info) -> NodeInfo:
    src = node.args[0]
    t = list(info[src].tags)
    n = len(t)
    dim = _arg(node, 1, "dim")
    keepdim = _arg(node, 2, "keepdim", False)
    if dim is None:
        raise _Fail("reduction over all axes, token axes included")
    dims = {d % n for d in (dim if isinstance(dim, (tuple, list)) else (dim,))}
    if any(t[d] is not None for d in dims):
        raise _Fail("reduction along a token axis")
    out = tuple(None if d in dims else tag for d, tag in enumerate(t)) if keepdim else tuple(tag for d, tag in enumerate(t) if d not in dims)
    return NodeInfo(_kind(out), out)
