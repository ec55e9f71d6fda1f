"""Find the attention computations of a Dynamo FX graph.

Contract
    Input: a torch-level FX graph as Dynamo hands it to a backend (nodes carry
    ``meta["example_value"]``).
    Output: one ``AttentionMatch`` per attention, in graph order, naming its
    q/k/v nodes (``[B, H, S, D]``), its mask node (or None), whether it is
    causal, its scale, and the node whose value is the attention output. The
    graph is not modified.

Recognised forms
    * ``scaled_dot_product_attention(q, k, v, attn_mask=..., dropout_p=...,
      is_causal=..., scale=..., enable_gqa=...)``, as Hugging Face's "sdpa"
      implementation traces to.
    * Hugging Face's "eager" attention: ``matmul(q, k.transpose(2, 3)) * scale
      (+ mask) -> softmax(dim=-1) (-> .to(dtype)) (-> dropout) -> matmul(., v)``.
An attention with dropout that can be active is reported through
``AttentionMatch.refusal``; so is a non-causal attention without a mask.
A ``dropout_p`` or ``scale`` that is a graph value read from an input
(``placeholder.item()``, as Dynamo lifts module floats under
``dynamic=True``) is recorded in ``AttentionMatch.scalar_inputs``: the backend
resolves it from the example inputs and checks it on every call. In the eager
form that is ``matmul * scaling.item()`` (key ``"scale"``, or ``"scale_divisor"``
for ``/``; ``AttentionMatch.scale`` then holds only the constant factors) and
``dropout(p=attention_dropout.item())``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

__all__ = ["AttentionMatch", "find_attention", "item_of_placeholder", "default_scale", "resolve_scalar_inputs"]

_SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_MATMUL = {torch.matmul, operator.matmul}
_SOFTMAX = {F.softmax, torch.softmax}
_CASTS = {"to", "float", "type_as", "contiguous"}
_SCALE_OPS = {operator.mul, operator.truediv, torch.mul, torch.div}


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
            matches.append(_match_sdpa(node))
        elif node.target in _SOFTMAX:
            m = _match_eager(node)
            if m is not None:
                matches.append(m)
    return matches


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
    if x.op == "call_function" and x.target in (operator.add, torch.add):
        a, b = x.args[:2]
        internal.append(x)
        x, mask = (a, b) if _reaches_matmul(a) else (b, a)
    scale = 1.0
    scalar_inputs: dict = {}
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
            if src is None or scalar_inputs:
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
    # Walk forward to the matmul with v through casts and dropout.
    y, refusal = softmax, None
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
    return AttentionMatch(u, q, k, v, mask, False, scale, "eager", tuple(internal), refusal, scalar_inputs)


def item_of_placeholder(x) -> Optional[fx.Node]:
    """The placeholder ``p`` if ``x`` is ``p.item()``, else None."""
    if isinstance(x, fx.Node) and x.op == "call_method" and x.target == "item":
        src = x.args[0]
        if isinstance(src, fx.Node) and src.op == "placeholder":
            return src
    return None


def _norm_dims(node: fx.Node) -> list[int]:
    ndim = node.args[0].meta["example_value"].dim()
    return [d % ndim for d in node.args[1:3]]


def _reaches_matmul(x) -> bool:
    """True if ``x`` is a matmul, or a matmul scaled by multiplications/divisions (either operand of a product)."""
    if not isinstance(x, fx.Node) or x.op != "call_function":
        return False
    if x.target in _MATMUL:
        return True
    if x.target in (operator.truediv, torch.div):
        return bool(x.args) and _reaches_matmul(x.args[0])
    if x.target in (operator.mul, torch.mul):
        return any(_reaches_matmul(a) for a in x.args[:2])
    return False


def default_scale(q: fx.Node) -> float:
    return 1.0 / math.sqrt(q.meta["example_value"].shape[-1])


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
