"""The lm_head side of ``fuse_linear_log_prob``'s pattern: recognisers of the nodes from the lm_head to the log-softmax.

Contract
    Each function looks at one FX node and returns what it is (the operand,
    the scale, the log-softmax's input) or None / a sentence saying why it
    is not; none changes the graph. ``fuse_linear_log_prob`` walks the chain
    with them (its docstring lists what matches).
"""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..graph import is_call, item_of_placeholder
from ..graph.meta import ev as _ev

__all__ = [
    "LINEAR", "LOG_SOFTMAX", "SOFTMAX", "identity_getitem", "python_scale", "input_scalar", "scalar_op",
    "upcast_operand", "log_softmax_input", "linear_operands", "batch_squeeze", "example_value",
]

LINEAR = (torch._C._nn.linear, F.linear)
LOG_SOFTMAX = (torch.log_softmax, F.log_softmax, torch.special.log_softmax)
SOFTMAX = (torch.softmax, F.softmax, torch.special.softmax)
_DIVIDE_FUNCTIONS = (operator.truediv, torch.div, torch.true_divide)
_MULTIPLY_FUNCTIONS = (operator.mul, torch.mul)
_DIVIDE_METHODS = ("div", "true_divide", "__truediv__")
_MULTIPLY_METHODS = ("mul", "multiply", "__mul__", "__rmul__")


def identity_getitem(n: fx.Node) -> bool:
    """``n`` is ``x[:, :]`` / ``x[...]``: full slices only."""
    if not (n.op == "call_function" and n.target is operator.getitem and len(n.args) == 2):
        return False
    idx = n.args[1]
    idx = idx if isinstance(idx, tuple) else (idx,)
    return all(i is Ellipsis or i == slice(None, None, None) for i in idx)


def python_scale(s) -> Optional[float]:
    """``s`` as a float if it is a finite nonzero Python number, else None."""
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s == 0:
        return None
    return float(s)


def input_scalar(n) -> Optional[fx.Node]:
    """The placeholder a Python number is read from: ``placeholder.item()`` of a 0-dim float tensor (a float lifted
    by Dynamo), or a SymFloat placeholder; else None."""
    if not isinstance(n, fx.Node):
        return None
    src = item_of_placeholder(n)
    if src is not None:
        value = _ev(src)
        return src if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype.is_floating_point else None
    if n.op == "placeholder" and isinstance(_ev(n), (float, torch.SymFloat)):
        return n
    return None


def scalar_op(n: fx.Node) -> "Optional[tuple[fx.Node, float | fx.Node, bool]] | str":
    """(tensor operand, scale, divide) if ``n`` multiplies or divides by a number, the scale a Python number or the
    node reading it from an input; why not if it is a multiply/divide otherwise; None if it is neither."""
    divide = is_call(n, _DIVIDE_FUNCTIONS, _DIVIDE_METHODS)
    multiply = is_call(n, _MULTIPLY_FUNCTIONS, _MULTIPLY_METHODS)
    if not (divide or multiply):
        return None
    if len(n.args) != 2 or n.kwargs:
        return f"{n.name}: a {'divide' if divide else 'multiply'} with arguments {n.args} {dict(n.kwargs)}, not tensor and number"
    a, b = n.args
    if multiply and (not isinstance(a, fx.Node) or input_scalar(a) is not None):
        a, b = b, a  # number * tensor
    scale = b if input_scalar(b) is not None else python_scale(b)
    if not isinstance(a, fx.Node) or scale is None:
        return f"{n.name}: {'divides' if divide else 'multiplies'} by {b!r}, not a finite nonzero Python number"
    return a, scale, divide


def upcast_operand(n: fx.Node) -> Optional[fx.Node]:
    """The tensor ``n`` casts to float32 (``.float()``, ``.to(torch.float32)``), else None."""
    if n.op != "call_method" or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    if n.target == "float" and len(n.args) == 1 and not n.kwargs:
        return n.args[0]
    if n.target == "to":
        if len(n.args) == 2 and not n.kwargs and n.args[1] == torch.float32:
            return n.args[0]
        if len(n.args) == 1 and dict(n.kwargs) == {"dtype": torch.float32}:
            return n.args[0]
    return None


def log_softmax_input(n: fx.Node) -> "fx.Node | str":
    """The input of ``n`` if it is a log-softmax over the last dim of a 3-D value, else why not."""
    if not is_call(n, LOG_SOFTMAX, ("log_softmax",)):
        return f"the gathered log-probs come from {n.format_node()}, not a log_softmax"
    if not n.args or not isinstance(n.args[0], fx.Node):
        return f"{n.name}: log_softmax without a tensor input"
    kwargs = dict(n.kwargs)
    dim = n.args[1] if len(n.args) > 1 else kwargs.pop("dim", None)
    kwargs.pop("_stacklevel", None)
    if kwargs.pop("dtype", None) is not None or len(n.args) > 2 or kwargs:
        return f"{n.name}: log_softmax with further arguments {n.args[2:]} {dict(n.kwargs)}"
    if dim not in (-1, 2):
        return f"{n.name}: log_softmax over dim {dim!r}, not the vocabulary (last) dim"
    return n.args[0]


def linear_operands(n: fx.Node) -> "tuple[fx.Node, fx.Node] | str":
    """(input, weight) of the lm_head ``n`` (no bias), else why not."""
    args = list(n.args) + [None] * (3 - len(n.args))
    h, w, bias = args[0], args[1], n.kwargs.get("bias", args[2])
    if set(n.kwargs) - {"bias"} or len(n.args) > 3:
        return f"{n.name}: linear with arguments {n.args} {dict(n.kwargs)}"
    if bias is not None:
        return f"{n.name}: the lm_head has a bias"
    if not isinstance(h, fx.Node) or not isinstance(w, fx.Node):
        return f"{n.name}: linear of non-tensor operands"
    return h, w


def batch_squeeze(n: fx.Node) -> bool:
    """``x.squeeze(0)`` (or ``torch.squeeze(x, 0)``) of the packed ``[1, T, V]`` logits: veRL's ``logits.squeeze(0)``."""
    if not (n.op == "call_method" and n.target == "squeeze" or n.op == "call_function" and n.target is torch.squeeze):
        return False
    return len(n.args) == 2 and n.args[1] == 0 and not n.kwargs


def example_value(node: fx.Node, placeholders: list, example_inputs) -> Optional[torch.Tensor]:
    """``node``'s example tensor: its meta, else (a placeholder of the packed graph) the example inputs'."""
    value = _ev(node)
    if value is None and node in placeholders and example_inputs is not None:
        i = placeholders.index(node)
        value = example_inputs[i] if i < len(example_inputs) else None
    return value if isinstance(value, torch.Tensor) else None
