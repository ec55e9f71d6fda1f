"""Find the attention computations of a Dynamo FX graph.

Contract
    Input: a torch-level FX graph as Dynamo hands it to a backend (nodes carry ``meta["example_value"]``).
    Output: one ``AttentionMatch`` per attention, in graph order: its q/k/v nodes (``[B, H, S, D]``), mask node
    (or None), causality, scale, softcap, sinks, window and chunk, the node of its output, and in ``refusal`` why it
    cannot run packed (None if it can). The graph is not modified.

Recognised forms
    * ``scaled_dot_product_attention(q, k, v, attn_mask=..., dropout_p=..., is_causal=..., scale=...,
      enable_gqa=...)``, as Hugging Face's "sdpa" implementation traces to.
    * Hugging Face's "eager" attention: ``matmul(q, k.transpose(2, 3)) * scale (-> / c -> tanh -> * c) (+ mask)
      -> softmax(dim=-1) (-> .to(dtype)) (-> dropout) -> matmul(., v)``, the optional middle part Gemma 2's logit
      softcap c (``AttentionMatch.softcap``).
    * gpt-oss's eager attention with learnable sinks (``sink_pattern``; ``AttentionMatch.sinks``, ``[Hq]``).

A mask's sliding window and chunks are read exactly (``mask_windows``) into ``AttentionMatch.window`` / ``chunk``.
Refused (``AttentionMatch.refusal``): dropout that can be active, a non-causal attention without a mask, and a
window spelled in a form not read exactly (``mask_window`` finds it) unless the mask's S fits in it (S <= w: it
never binds; a symbolic S is a guard, so Dynamo recompiles, and this refuses, once S outgrows it). A ``dropout_p``,
``scale`` or softcap read from an input (``placeholder.item()``, as Dynamo lifts module floats under
``dynamic=True``) is recorded in ``AttentionMatch.scalar_inputs`` (``"scale"``, ``"scale_divisor"`` for ``/``,
``"softcap"``; ``scale`` then holds only the constant factors): the backend resolves it from the example inputs
and checks it on every call.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..graph.match import item_of_placeholder
from ..graph.meta import ev as _ev
from .mask_windows import mask_windows
from .sink_pattern import drops_last_column, sink_logits

__all__ = ["AttentionMatch", "find_attention", "item_of_placeholder", "default_scale", "resolve_scalar_inputs", "mask_window"]

_SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_MATMUL = {torch.matmul, operator.matmul}
_SOFTMAX = {F.softmax, torch.softmax}
_CASTS = {"to", "float", "type_as", "contiguous"}
_SCALE_OPS = {operator.mul, operator.truediv, torch.mul, torch.div}
_TANH = {torch.tanh, torch.nn.functional.tanh}
_COMPARE = {operator.gt, operator.ge, operator.lt, operator.le, torch.gt, torch.ge, torch.lt, torch.le}
_COMPARE_METHODS = {"gt", "ge", "lt", "le", "__gt__", "__ge__", "__lt__", "__le__"}
_OFFSET = {operator.sub, operator.add, torch.sub, torch.add}
_CHUNK = {operator.floordiv, operator.mod, torch.floor_divide, torch.remainder}


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionMatch:
    output: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: Optional[fx.Node]
    is_causal: bool
    scale: Optional[float]
    kind: str  # "sdpa" or "eager"
    nodes: tuple[fx.Node, ...] = ()  # the eager pattern's internal nodes
    refusal: Optional[str] = None
    # "dropout_p"/"scale" -> the placeholder whose .item() gives it
    scalar_inputs: dict = dataclasses.field(default_factory=dict)
    softcap: float = 0.0  # the logit softcap (Gemma 2), 0.0 for none
    window: int = 0  # sliding window on token depth (q - kv < window), 0 for none
    chunk: int = 0  # chunked attention on token depth (q // chunk == kv // chunk), 0 for none
    sinks: Optional[fx.Node] = None  # gpt-oss: the node holding the [Hq] sink logits (any shape of Hq elements)


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _is_method(node, names) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target in names


def _scalar(x) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def find_attention(graph: fx.Graph) -> list[AttentionMatch]:
    matches = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _SDPA:
            matches.append(_window_checked(_match_sdpa(node)))
        elif node.target in _SOFTMAX:
            m = _match_eager(node)
            if m is not None:
                matches.append(_window_checked(m))
    return matches


def _window_checked(m: AttentionMatch) -> AttentionMatch:
    """``m`` with its mask's windows read exactly (``mask_windows``); refused if its mask has a window (sliding or
    chunked) that cannot be read exactly and can bind at the mask's sequence length."""
    if m.mask is None or m.refusal is not None:
        return m
    read = mask_windows(m.mask)
    if not read.unknown:
        return dataclasses.replace(m, window=read.window, chunk=read.chunk)
    w = mask_window(m.mask)
    if w is None:
        return m
    ev = _ev(m.mask)
    S = ev.shape[-1] if isinstance(ev, torch.Tensor) else None
    # S <= w: no two columns are w apart, so the window masks nothing. A symbolic S is guarded here.
    if S is not None and bool(S <= w):
        return m
    length = "unknown" if S is None else S if isinstance(S, int) else f"{S}, symbolic, above {w} on this call"
    return dataclasses.replace(m, refusal=(
        f"{m.output.name}: the attention mask has a sliding or chunked window of {w} tokens built by comparisons "
        f"({', '.join(read.unknown)}) that are not the forms dualkv reads exactly; packing is exact only while "
        f"sequences fit in it, and this graph's sequence length is {length}"))


def mask_window(mask: fx.Node, limit: int = 2000) -> Optional[int]:
    """The smallest window a mask's computation applies, or None: ``kv > q - w`` style comparisons
    of an index offset by a constant w (``|w|``), ``q - kv < w`` (``|w|``), or chunks ``q // w``
    and ``q % w``. Walks at most ``limit`` nodes back from ``mask``."""
    seen, stack, windows = set(), [mask], []
    while stack and len(seen) < limit:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        w = _window_of(n)
        if w:
            windows.append(w)
        stack.extend(n.all_input_nodes)
    return min(windows) if windows else None


def _window_of(n: fx.Node) -> Optional[int]:
    def const(x):
        return abs(x) if isinstance(x, int) and not isinstance(x, bool) and x != 0 else None

    def offset(x):  # index +- constant, or index - index
        if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target in _OFFSET and len(x.args) == 2):
            return None, False
        a, b = x.args
        c = const(b) if isinstance(a, fx.Node) else const(a) if isinstance(b, fx.Node) else None
        return c, isinstance(a, fx.Node) and isinstance(b, fx.Node)

    if n.op == "call_function" and n.target in _CHUNK and len(n.args) == 2 and isinstance(n.args[0], fx.Node):
        return const(n.args[1])
    if not (n.op == "call_function" and n.target in _COMPARE or n.op == "call_method" and n.target in _COMPARE_METHODS):
        return None
    if len(n.args) != 2:
        return None
    found = []
    for x, other in (n.args, reversed(n.args)):
        c, of_two = offset(x)
        if c is not None and isinstance(other, fx.Node):
            found.append(c)  # kv > q - w
        if of_two and const(other) is not None:
            found.append(const(other))  # q - kv < w
        if isinstance(x, fx.Node) and x.op == "call_function" and x.target in (abs, torch.abs) and const(other):
            found.append(const(other))  # |q - kv| <= w
    return min(found) if found else None


def _match_sdpa(node: fx.Node) -> AttentionMatch:
    q, k, v = node.args[:3]
    mask = _arg(node, 3, "attn_mask")
    dropout = _arg(node, 4, "dropout_p", 0.0)
    is_causal = bool(_arg(node, 5, "is_causal", False))
    scale = _arg(node, 6, "scale")
    scalar_inputs = {}
    for name, value in (("dropout_p", dropout), ("scale", scale)):
        src = item_of_placeholder(value)
        if src is not None:
            scalar_inputs[name] = src
    if "dropout_p" in scalar_inputs:
        dropout = 0.0  # checked against the input on every call
    if "scale" in scalar_inputs:
        scale = None
    refusal = None
    if not isinstance(dropout, (int, float)) or dropout != 0:
        refusal = f"{node.name}: attention dropout_p={dropout} couples the copies of a shared prompt (dropout in training mode)"
    elif mask is None and not is_causal:
        refusal = f"{node.name}: bidirectional attention (no mask, is_causal=False) is not the causal pattern the kernels implement"
    elif not isinstance(scale, (int, float, type(None))):
        refusal = f"{node.name}: attention scale is not a constant"
    return AttentionMatch(node, q, k, v, mask, is_causal, scale, "sdpa", (), refusal, scalar_inputs)


def _match_eager(softmax: fx.Node) -> Optional[AttentionMatch]:
    dim = _arg(softmax, 1, "dim")
    x = softmax.args[0]
    if dim not in (-1, 3) or not isinstance(x, fx.Node):
        return None
    internal = [softmax]
    mask = None
    sinks, x = sink_logits(x, internal)
    if x.op == "call_function" and x.target in (operator.add, torch.add):
        a, b = x.args[:2]
        internal.append(x)
        x, mask = (a, b) if _reaches_matmul(a) or _softcap(a) is not None else (b, a)
    scale, softcap = 1.0, 0.0
    scalar_inputs: dict = {}
    capped = _softcap(x)
    if capped is not None:
        x, softcap, cap_nodes = capped
        internal.extend(cap_nodes)
        if isinstance(softcap, fx.Node):
            scalar_inputs["softcap"], softcap = softcap, 0.0  # resolved from the example inputs, checked per call
    while isinstance(x, fx.Node) and x.op == "call_function" and x.target in _SCALE_OPS:
        if len(x.args) != 2 or x.kwargs:
            return None  # torch.div(..., rounding_mode=...), keyword operands: not a plain scale
        a, b = x.args
        divide = x.target in (operator.truediv, torch.div)
        if _reaches_matmul(a):
            t, c = a, b
        elif not divide and _reaches_matmul(b):
            t, c = b, a
        else:
            return None
        s = _scalar(c)
        if s is None:
            # Under dynamic=True Dynamo lifts the module's float (HF's `self.scaling`) to an input read
            # as `placeholder.item()`: resolved from the example inputs by the backend, checked per call.
            src = item_of_placeholder(c)
            if src is None or "scale" in scalar_inputs or "scale_divisor" in scalar_inputs:
                return None
            scalar_inputs["scale_divisor" if divide else "scale"] = src
            s = 1.0
        scale = scale / s if divide else scale * s
        internal.append(x)
        x = t
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target in _MATMUL):
        return None
    q, kt = x.args[:2]
    internal.append(x)
    if not (_is_method(kt, {"transpose"}) and sorted(_norm_dims(kt)) in ([2, 3],)):
        return None
    k = kt.args[0]
    internal.append(kt)
    # Walk forward to the matmul with v through casts and dropout (and, with sinks, the dropped sink column).
    y, refusal = softmax, None
    if sinks is not None:
        users = list(y.users)
        if len(users) != 1 or not drops_last_column(users[0]):
            return None
        y = users[0]
        internal.append(y)
    while True:
        users = list(y.users)
        if len(users) != 1:
            return None
        u = users[0]
        if _is_method(u, _CASTS):
            internal.append(u)
            y = u
            continue
        if u.op == "call_function" and u.target in (F.dropout, torch.dropout):
            p = _arg(u, 1, "p", 0.5)
            training = _arg(u, 2, "training", True)
            src = item_of_placeholder(p)
            if training is False:
                pass  # inactive, whatever p is
            elif src is not None:
                scalar_inputs["dropout_p"] = src  # the backend refuses a nonzero one, and checks it per call
            elif p != 0 and training is not False:
                refusal = f"{u.name}: attention dropout p={p} in training mode couples the copies of a shared prompt"
            internal.append(u)
            y = u
            continue
        break
    if not (u.op == "call_function" and u.target in _MATMUL and u.args[0] is y):
        return None
    v = u.args[1]
    if mask is None and refusal is None:
        refusal = f"{u.name}: eager attention without a mask is bidirectional, not the causal pattern the kernels implement"
    return AttentionMatch(u, q, k, v, mask, False, scale, "eager", tuple(internal), refusal, scalar_inputs, softcap,
                          sinks=sinks)


def _softcap(x):
    """``(scores, c, nodes)`` if ``x`` is ``tanh(scores / c) * c`` (a logit softcap), else None.

    ``c`` is a positive constant, or the placeholder both ``c``'s read as ``.item()`` (Dynamo's
    lifted module float); ``nodes`` are the three of the pattern.
    """
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target in (operator.mul, torch.mul)):
        return None
    if len(x.args) != 2 or x.kwargs:
        return None
    for t, c in (x.args, reversed(x.args)):
        is_tanh = isinstance(t, fx.Node) and (t.op == "call_function" and t.target in _TANH or _is_method(t, {"tanh"}))
        if not is_tanh or len(t.args) != 1 or t.kwargs:
            continue
        d = t.args[0]
        if not (isinstance(d, fx.Node) and d.op == "call_function" and d.target in (operator.truediv, torch.div)):
            continue
        if len(d.args) != 2 or d.kwargs or not _reaches_matmul(d.args[0]):
            continue
        cap = _cap_value(c, d.args[1])
        if cap is not None:
            return d.args[0], cap, [x, t, d]
    return None


def _cap_value(a, b):
    """The softcap both operands give: an equal positive constant, or the one placeholder read by both."""
    ca, cb = _scalar(a), _scalar(b)
    if ca is not None and ca == cb and ca > 0 and math.isfinite(ca):
        return ca
    sa, sb = item_of_placeholder(a), item_of_placeholder(b)
    return sa if sa is not None and sa is sb else None


def _norm_dims(node: fx.Node) -> list[int]:
    ndim = _ev(node.args[0]).dim()
    return [d % ndim for d in node.args[1:3]]


def _reaches_matmul(x) -> bool:
    """True if ``x`` is a matmul, or a matmul scaled by multiplications/divisions (either operand of a product).
    Each node is visited once: a chain of products reading one value twice (``x * x``) stays linear."""
    todo, seen = [x], set()
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n.op != "call_function" or n in seen:
            continue
        seen.add(n)
        if n.target in _MATMUL:
            return True
        if n.target in (operator.truediv, torch.div):
            todo.extend(n.args[:1])
        elif n.target in (operator.mul, torch.mul):
            todo.extend(n.args[:2])
    return False


def default_scale(q: fx.Node) -> float:
    return 1.0 / math.sqrt(_ev(q).shape[-1])


def resolve_scalar_inputs(
    matches: list[AttentionMatch], placeholders: list[fx.Node], example_inputs
) -> tuple[list[AttentionMatch], list[tuple[int, float, str]], list[str]]:
    """Matches with their ``scalar_inputs`` resolved from the example inputs; the per-call checks; refusals.

    ``dropout_p``/``scale`` read from graph inputs (module floats Dynamo
    lifts under ``dynamic=True``): the packed graph bakes them in, the runner
    checks each ``(input index, value, what)`` on every call (they are module
    attributes, so they change only if the user changes them, and then that
    call runs unpacked). A dropout that is not zero is a refusal, like a
    constant one. Eager attention's scale may also carry constant factors
    (``m.scale``); SDPA's is None here.
    """
    resolved, checks, refusals = [], [], []
    for m in matches:
        scale, refusal = m.scale, m.refusal
        for what, src in m.scalar_inputs.items():
            index = placeholders.index(src)
            value = float(example_inputs[index])
            checks.append((index, value, f"{m.output.name}.{what}"))
            if what == "scale":
                scale = value * (scale if scale is not None else 1.0)
            elif what == "softcap":
                if value > 0 and math.isfinite(value):
                    m = dataclasses.replace(m, softcap=value)
                elif not refusal:
                    refusal = f"{m.output.name}: attention logit softcap {value} (not a positive finite number)"
                    refusals.append(refusal)
            elif what == "scale_divisor":
                if value == 0 or not math.isfinite(value):
                    if not refusal:
                        refusal = f"{m.output.name}: attention scores divided by {value}"
                        refusals.append(refusal)
                else:
                    scale = (scale if scale is not None else 1.0) / value
            elif value != 0 and not refusal:
                refusal = f"{m.output.name}: attention dropout_p={value} couples the copies of a shared prompt (dropout in training mode)"
                refusals.append(refusal)
        resolved.append(dataclasses.replace(m, scale=scale, refusal=refusal))
    return resolved, checks, refusals
