"""The sliding window and chunk size an attention mask's computation applies, read exactly from the graph.

Contract
    Input: the mask node of an attention (a Dynamo graph, nodes with ``meta["example_value"]``).
    Output: ``MaskWindows(window, chunk, unknown)``: the sliding window (keys with ``q - kv < window``; 0
    for none) and the chunk size (``q // chunk == kv // chunk``; 0 for none) the mask's comparisons apply,
    and the comparisons of a query with a key index that are neither those nor causal (then the caller
    must not trust the two numbers). The graph is not modified.

Assumes the mask is built the way Hugging Face's mask functions build it (``masking_utils``): pointwise
comparisons of a query index and a key index, integer tensors broadcast as ``[..., S, 1]`` and
``[..., 1, S]`` (that is how the two are told apart), shifted by integer constants: ``kv > q - w``
(``sliding_window_overlay``), ``q - kv < w``, ``|q - kv| <= w``, and ``(kv - o) // c == (q - o) // c``
with the same offset ``o`` on both sides (``chunked_overlay``'s left padding) or none. Each form is
normalised to ``q - kv < w`` or ``<= w`` before its window is read, so ``>`` against ``>=`` is exact, not a
guess. Windows count on the mask's columns, which within a row are the sequence's depth plus its left
padding; the layout's windows count on depth (``layout.segments``), so a sliding window is the same rule
and a chunk is the same rule once the left padding is subtracted, as ``chunked_overlay`` does. The
runtime mask check compares the first call's masks with the depth rule on its batch.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
import torch.fx as fx

from ..graph.meta import ev as _ev
from .node_info import hint

__all__ = ["MaskWindows", "mask_windows"]

_ADD = {operator.add, torch.add}
_SUB = {operator.sub, torch.sub}
_FLOORDIV = {operator.floordiv, torch.floor_divide}
_CMP = {operator.lt: "<", operator.le: "<=", operator.gt: ">", operator.ge: ">=", operator.eq: "==", operator.ne: "!=",
        torch.lt: "<", torch.le: "<=", torch.gt: ">", torch.ge: ">=", torch.eq: "==", torch.ne: "!="}
_CMP_METHODS = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=", "__lt__": "<", "__le__": "<=",
                "__gt__": ">", "__ge__": ">=", "__eq__": "==", "__ne__": "!="}
_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


@dataclasses.dataclass(frozen=True)
class MaskWindows:
    window: int = 0
    chunk: int = 0
    unknown: tuple[str, ...] = ()  # comparisons of a query and a key index this module cannot read


def _const(x) -> Optional[int]:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _role(n: fx.Node) -> Optional[str]:
    """"q" for an integer index laid out ``[..., S, 1]``, "kv" for ``[..., 1, S]`` (S > 1), else None."""
    ev = _ev(n)
    if not isinstance(ev, torch.Tensor) or ev.dim() < 2 or ev.dtype.is_floating_point or ev.dtype == torch.bool:
        return None
    rows, cols = hint(ev.shape[-2]), hint(ev.shape[-1])
    if rows > 1 and cols == 1:
        return "q"
    if rows == 1 and cols > 1:
        return "kv"
    return None


class _Keys:
    """Structural keys, memoised for one ``mask_windows`` call: two nodes computing the same op of the same operands
    (``lp[b]`` written twice) get the same key.

    A node's key is the first node met with its structure (op, target, and its operands' keys), a placeholder's or
    get_attr's the node itself; so a key hashes and compares in constant time, and each node is keyed once, in
    topological order (an explicit stack, no recursion). A nested tuple of the operands' keys, built recursively, is
    the same equivalence but costs time exponential in the depth of shared subexpressions (``x = f(x, x)`` chains,
    such as DeepSeek-V4's hyper-connections' Sinkhorn iterations), to build and to hash."""

    def __init__(self):
        self._memo: dict[fx.Node, fx.Node] = {}
        self._classes: dict[tuple, fx.Node] = {}

    def __call__(self, n) -> object:
        if isinstance(n, fx.Node):
            if n not in self._memo:
                self._visit(n)
            return self._memo[n]
        if isinstance(n, (list, tuple)):
            return (type(n).__name__, *(self(a) for a in n))
        if isinstance(n, slice):
            return ("slice", self(n.start), self(n.stop), self(n.step))
        try:
            hash(n)
            return n
        except TypeError:
            return ("unhashable", repr(n))

    def _visit(self, root: fx.Node) -> None:
        stack = [root]
        while stack:
            n = stack[-1]
            if n in self._memo:
                stack.pop()
                continue
            if n.op in ("placeholder", "get_attr"):
                self._memo[n] = n
                stack.pop()
                continue
            missing = [a for a in n.all_input_nodes if a not in self._memo]
            if missing:
                stack.extend(missing)
                continue
            stack.pop()
            struct = (n.op, n.target, self(n.args), tuple(sorted((k, self(v)) for k, v in n.kwargs.items())))
            self._memo[n] = self._classes.setdefault(struct, n)


class _Memo:
    """What one ``mask_windows`` call memoises: structural keys, and ``_affine``'s and ``_mentions_both``'s results
    by (node, depth) (each a pure function of those; the depth caps their walks, so it is part of the answer)."""

    def __init__(self):
        self.key = _Keys()
        self.affine: dict[tuple[fx.Node, int], Optional[tuple[dict, int]]] = {}
        self.mentions: dict[tuple[fx.Node, int], frozenset] = {}


def _affine(x, memo: _Memo, depth: int = 0) -> Optional[tuple[dict, int]]:
    """``x`` as ``(terms, const)``: a sum of coefficient-weighted terms (the index roles "q"/"kv", or any other
    node by its structural key) plus an integer constant; None if it is not such a sum. Callers must not modify
    the returned dict (memoised, shared)."""
    c = _const(x)
    if c is not None:
        return {}, c
    if not isinstance(x, fx.Node) or depth > 8:
        return None
    if (x, depth) in memo.affine:
        return memo.affine[x, depth]
    if x.op == "call_function" and (x.target in _ADD or x.target in _SUB) and len(x.args) == 2 and not x.kwargs:
        a, b = _affine(x.args[0], memo, depth + 1), _affine(x.args[1], memo, depth + 1)
        if a is None or b is None:
            out = None
        else:
            sign = -1 if x.target in _SUB else 1
            terms = dict(a[0])
            for k, v in b[0].items():
                terms[k] = terms.get(k, 0) + sign * v
            out = {k: v for k, v in terms.items() if v}, a[1] + sign * b[1]
    else:
        role = _role(x)
        out = ({role: 1} if role is not None else {memo.key(x): 1}), 0
    memo.affine[x, depth] = out
    return out


def _compare(n: fx.Node) -> Optional[tuple[str, object, object]]:
    if n.op == "call_function" and n.target in _CMP and len(n.args) == 2:
        return _CMP[n.target], n.args[0], n.args[1]
    if n.op == "call_method" and n.target in _CMP_METHODS and len(n.args) == 2:
        return _CMP_METHODS[n.target], n.args[0], n.args[1]
    return None


def _distance_bound(op: str, a, b, memo: _Memo) -> Optional[tuple[str, int]]:
    """``("<", w)`` or ``("<=", w)``... for ``q - kv op w`` if ``a op b`` is such a comparison of a query and a key
    index (both roles, coefficients +1/-1, nothing else); the causal ``q - kv >= 0`` comes back as ``(">=", 0)``."""
    fa, fb = _affine(a, memo), _affine(b, memo)
    if fa is None or fb is None:
        return None
    terms = dict(fa[0])
    for k, v in fb[0].items():
        terms[k] = terms.get(k, 0) - v
    terms = {k: v for k, v in terms.items() if v}
    gamma = fa[1] - fb[1]  # (a - b) = alpha q + beta kv + gamma
    if set(terms) != {"q", "kv"} or terms["q"] != -terms["kv"] or abs(terms["q"]) != 1:
        return None
    if terms["q"] == -1:  # -(q - kv) + gamma op 0  <=>  (q - kv) - gamma flip(op) 0
        op, gamma = _FLIP[op], -gamma
    return op, -gamma  # q - kv op -gamma


def _chunk(op: str, a, b, memo: _Memo) -> Optional[int]:
    """c if ``a op b`` is ``(kv - o) // c == (q - o) // c`` (either side, the same offset o or none), else None."""
    if op != "==":
        return None
    sides = []
    for x in (a, b):
        if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target in _FLOORDIV and len(x.args) == 2):
            return None
        c = _const(x.args[1])
        f = _affine(x.args[0], memo)
        if c is None or c <= 0 or f is None:
            return None
        sides.append((c, f))
    (c0, (t0, k0)), (c1, (t1, k1)) = sides
    roles = [{r for r in t if r in ("q", "kv")} for t in (t0, t1)]
    if c0 != c1 or k0 != k1 or {frozenset(r) for r in roles} != {frozenset({"q"}), frozenset({"kv"})}:
        return None
    rest0 = {k: v for k, v in t0.items() if k not in ("q", "kv")}
    rest1 = {k: v for k, v in t1.items() if k not in ("q", "kv")}
    if rest0 != rest1 or t0.get("q", t0.get("kv")) != 1 or t1.get("q", t1.get("kv")) != 1:
        return None
    return c0


def _mentions_both(x, memo: _Memo, depth: int = 0) -> frozenset:
    """The index roles ("q", "kv") ``x`` reads within 8 steps back."""
    if not isinstance(x, fx.Node) or depth > 8:
        return frozenset()
    if (x, depth) not in memo.mentions:
        role = _role(x)
        if role is not None:
            out = frozenset({role})
        else:
            out = frozenset().union(*(_mentions_both(a, memo, depth + 1) for a in x.all_input_nodes))
        memo.mentions[x, depth] = out
    return memo.mentions[x, depth]


def mask_windows(mask: fx.Node, limit: int = 2000) -> MaskWindows:
    """The windows ``mask``'s computation applies (see the module docstring). Walks at most ``limit`` nodes back."""
    seen, stack = set(), [mask]
    windows, chunks, unknown = [], [], []
    memo = _Memo()
    while stack and len(seen) < limit:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
        cmp = _compare(n)
        if cmp is None:
            continue
        op, a, b = cmp
        if _mentions_both(a, memo) | _mentions_both(b, memo) != {"q", "kv"}:
            continue  # not a comparison of a query with a key (a padding mask, a position check)
        if op == "==" and _same_lookup(a, b, memo):
            continue  # ids[b, q] == ids[b, kv]: sequences packed into a row, which the layout's sequences are
        c = _chunk(op, a, b, memo)
        if c is not None:
            chunks.append(c)
            continue
        bound = _abs_bound(op, a, b, memo) or _distance_bound(op, a, b, memo)
        if bound is None:
            unknown.append(n.name)
            continue
        rel, w = bound
        if rel == ">=" and w <= 0 or rel == ">" and w <= -1:
            continue  # q - kv >= 0 (or weaker): the causal part, which the forest mask holds
        if rel == "<" and w >= 1:
            windows.append(w)
        elif rel == "<=" and w >= 0:
            windows.append(w + 1)
        else:
            unknown.append(n.name)
    if len(set(chunks)) > 1:
        unknown.append(f"chunks of {sorted(set(chunks))}")
    return MaskWindows(min(windows, default=0), chunks[0] if len(set(chunks)) == 1 else 0, tuple(unknown))


def _same_lookup(a, b, memo: _Memo) -> bool:
    """``a`` and ``b`` read one tensor at the query and at the key index (``ids[b, q]`` and ``ids[b, kv]``): a group
    rule (Hugging Face's ``packed_sequence_mask`` of position-id restarts) on data, not on lengths; the mask check
    compares it with the layout's sequences."""
    def lookup(x):
        if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target is operator.getitem and len(x.args) == 2):
            return None
        idx = x.args[1] if isinstance(x.args[1], tuple) else (x.args[1],)
        roles = [_role(i) if isinstance(i, fx.Node) else None for i in idx]
        return x.args[0], tuple(r for r in roles if r), tuple(memo.key(i) for i, r in zip(idx, roles) if r is None)

    la, lb = lookup(a), lookup(b)
    return la is not None and lb is not None and la[0] is lb[0] and la[2] == lb[2] and {la[1], lb[1]} == {("q",), ("kv",)}


def _abs_bound(op: str, a, b, memo: _Memo) -> Optional[tuple[str, int]]:
    """``|q - kv| op w`` (or ``w flip(op) |q - kv|``) as ``(op, w)``: with the causal mask, the window ``q - kv op w``."""
    for x, c, o in ((a, b, op), (b, a, _FLIP[op])):
        if isinstance(x, fx.Node) and x.op == "call_function" and x.target in (abs, torch.abs) and _const(c) is not None:
            d = x.args[0]
            if isinstance(d, fx.Node) and d.op == "call_function" and d.target in _SUB and len(d.args) == 2:
                inner = _distance_bound(">=", d.args[0], d.args[1], memo)  # just to read the roles: q - kv or kv - q
                if inner is not None and o in ("<", "<="):
                    return o, _const(c)
    return None
