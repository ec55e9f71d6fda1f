"""Keyword arguments that fill a call's leading positional parameters, moved into its positional arguments.

Contract
    Input: a Dynamo ``GraphModule``.
    Output: ``gm`` itself when no ``call_function`` node passes by keyword a leading parameter that the rules read
    by position; otherwise a new ``GraphModule`` (``gm`` is left unchanged: the caller's fallback keeps running it)
    in which those calls read positionally: ``F.linear(input=x, weight=w)`` becomes ``F.linear(x, w)``,
    ``torch.sum(input=x, dim=-1)`` becomes ``torch.sum(x, dim=-1)``. The leading parameters are the first two for
    linear, embedding, matmul/bmm, the norms, ``torch.reshape`` (input and shape) and grouped matmuls, the first
    for every other call; of a method, its sizes where the rewrite reads them (``x.reshape(shape=s)`` becomes
    ``x.reshape(s)``; ``view``, ``expand``, ``new_*`` likewise); nothing after them moves (``dim=-1``, ``bias=b``
    stay keywords, as other rules read them by name). A keyword moves only while the call binds to exactly the
    same arguments both ways (``torch.fx.operator_schemas.normalize_function``, given the arguments' types where
    the call is overloaded); a call whose signature cannot be resolved stays as it is.

Why: the token-axis rules and the rewrite read an op's operands by position (``node.args[0]`` is the input of
``F.linear``), as Dynamo writes most calls; a model that passed them by keyword would otherwise make the backend
raise ``IndexError``, and with it the user's ``torch.compile`` call.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.operator_schemas import normalize_function

from ..graph import copy_graph_module
from ..graph.meta import ev as _example_value

__all__ = ["positional_args"]


def _type_of(value):
    """The type ``normalize_function`` matches an overload by: a graph value's example value's (a tensor's:
    ``torch.Tensor``), else the constant's own; None where the graph recorded no example value."""
    if isinstance(value, fx.Node):
        ev = _example_value(value)
        return torch.Tensor if isinstance(ev, torch.Tensor) else (None if ev is None else type(ev))
    return type(value)


def _bound(target, args, kwargs) -> Optional[dict]:
    """Every parameter of ``target(*args, **kwargs)`` by name, in signature order; None if it cannot be bound.

    An overloaded builtin binds only with the arguments' types (``torch.var(input=x, dim=-1)`` on any torch;
    ``torch.sum`` and most others on torch 2.12), so a call that does not bind untyped is tried typed."""
    arg_types = tuple(_type_of(a) for a in args)
    kwarg_types = {k: _type_of(v) for k, v in kwargs.items()}
    attempts = [{}]
    if None not in arg_types and None not in kwarg_types.values():
        attempts.append(dict(arg_types=arg_types, kwarg_types=kwarg_types))
    for types in attempts:
        try:
            # Signature lookups of arbitrary callables raise all sorts of errors: any of them means "unknown".
            full = normalize_function(target, tuple(args), dict(kwargs), normalize_to_only_use_kwargs=True, **types)
        except Exception:
            full = None
        if full is not None:
            return dict(full.kwargs)
    return None


def _same(a: dict, b: dict) -> bool:
    if list(a) != list(b):
        return False
    # fx Nodes compare by identity; the other values are Python constants (a tensor constant compares
    # by identity too, never elementwise).
    return all(x is y or (not hasattr(x, "__torch_function__") and x == y) for x, y in zip(a.values(), b.values()))


# How many leading parameters the rules read by position: two operands (the norms' and reshape's shape), else
# the input.
_GROUPED_MM = (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None))  # by torch version
_TWO_LEADING = {F.linear, torch._C._nn.linear, F.embedding, torch.embedding, torch.matmul, torch.bmm, F.layer_norm,
                F.rms_norm, torch.layer_norm, torch.rms_norm, torch.reshape} | {f for f in _GROUPED_MM if f is not None}


def _positional_form(node: fx.Node) -> Optional[tuple[tuple, dict]]:
    """``(args, kwargs)`` of ``node`` with the leading parameters the rules read made positional where they
    came by keyword; None if none move."""
    leading = 2 if node.target in _TWO_LEADING else 1
    if len(node.args) >= leading:
        return None
    full = _bound(node.target, node.args, node.kwargs)
    if full is None:
        return None
    args, kwargs, moved = list(node.args), dict(node.kwargs), []
    for name in list(full)[len(args):leading]:
        if name not in kwargs:
            break
        args.append(kwargs.pop(name))
        moved.append(name)
    # Back off from the last moved keyword until the call binds to the same arguments (keyword-only ones).
    while moved:
        again = _bound(node.target, args, kwargs)
        if again is not None and _same(again, full):
            return tuple(args), kwargs
        kwargs[moved.pop()] = args.pop()
    return None


# Tensor methods whose sizes the rewrite reads by position, and the keyword those sizes may come by.
_SIZE_METHODS = {"reshape": "shape", "view": "size", "expand": "size", "new_empty": "size", "new_zeros": "size",
                 "new_ones": "size", "new_full": "size"}


def _method_form(node: fx.Node) -> Optional[tuple[tuple, dict]]:
    """``x.reshape(shape=s)`` as ``x.reshape(s)`` (and the other size methods); None if nothing moves."""
    name = _SIZE_METHODS.get(node.target)
    if name is None or len(node.args) != 1 or name not in node.kwargs:
        return None
    kwargs = dict(node.kwargs)
    return (node.args[0], kwargs.pop(name)), kwargs


def positional_args(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with leading keyword arguments of its calls made positional (see the module docstring)."""
    forms = {}
    for node in gm.graph.nodes:
        if node.kwargs and node.op in ("call_function", "call_method"):
            form = _positional_form(node) if node.op == "call_function" else _method_form(node)
            if form is not None:
                forms[node] = form
    if not forms:
        return gm
    env: dict[fx.Node, fx.Node] = {}
    out = copy_graph_module(gm, env)
    for node, (args, kwargs) in forms.items():
        copy = env[node]
        copy.args = fx.map_arg(args, lambda n: env[n])
        copy.kwargs = fx.map_arg(kwargs, lambda n: env[n])
    out.recompile()
    return out
