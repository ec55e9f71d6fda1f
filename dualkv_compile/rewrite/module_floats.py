"""Module floats the packed graph passes to an op as Python numbers: baked in, so its compile never restarts.

Under ``dynamic=True`` Dynamo lifts a module's float attributes (an RMSNorm's ``eps``, a rotary
``attention_scaling``, an ``nn.Embedding``'s ``norm_type``, a ``LayerNorm``'s ``eps``) as 0-dim tensor
inputs that the graph reads with ``placeholder.item()``. The packed graph is traced by Dynamo again
(``runtime.nested_compile``), and AOTAutograd's ``tensorify_python_scalars`` pass turns each such float
back into a tensor where it feeds tensor arithmetic (``x + eps``). One that an op takes as a Python number
(``F.embedding(..., norm_type)``, ``F.layer_norm(..., eps)``) it cannot: it specialises the float and
restarts Dynamo's analysis of the whole graph (``TensorifyScalarRestartAnalysis``), after AOTAutograd had
traced the joint graph and missed its cache under a key no run ever saves. That wasted trace was most of a
warm start's compile time (issue 36; ``benchmarks/results/compile_warm_start_cpu_2026-11-27.md``).

``bake_module_floats`` replaces each such read with its value, as torch would have specialised it, and
returns the per-call checks (input index, value, what) the runner already keeps for attention scales: a
call where the module's float changed runs unpacked. Only module attributes are baked (their source is an
attribute of an ``nn.Module``): a float the loss function takes as an argument may change every step, and
stays as it was. Reads that feed only tensor arithmetic are left to ``tensorify_python_scalars``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..analysis.attention_match import item_of_placeholder

__all__ = ["bake_module_floats", "is_module_attribute"]

# Torch-level ops whose scalar operand AOTAutograd's tensorify pass turns into a tensor (aten add/mul/sub/div.Tensor).
_COMMUTATIVE = {operator.add, operator.mul, torch.add, torch.mul, "add", "mul", "add_", "mul_", "__add__", "__mul__",
                "__radd__", "__rmul__"}
_SECOND_OPERAND = {operator.sub, operator.truediv, torch.sub, torch.div, "sub", "div", "sub_", "div_", "__sub__",
                   "__truediv__"}


def _tensorified(use: fx.Node, value: fx.Node, depth: int = 0) -> bool:
    """True if every way ``use`` reads ``value`` (a Python float) is tensor arithmetic tensorify handles."""
    if use.op not in ("call_function", "call_method") or use.kwargs or depth > 8:
        return False
    positions = [i for i, a in enumerate(use.args) if a is value]
    if not positions:  # read inside a list or tuple operand: not an arithmetic operand
        return False
    out = use.meta.get("example_value")
    if out is None:  # a value the rewrite added (``add_packed``) carries no example value: its other operand tells
        others = [a for i, a in enumerate(use.args[:2]) if i not in positions]
        tensor = others and isinstance(others[0], fx.Node) and not isinstance(
            others[0].meta.get("example_value"), (torch.SymInt, torch.SymFloat, int, float))
        out = torch.empty(0) if tensor else None
    if isinstance(out, (torch.SymFloat, float)):  # scalar arithmetic (1 - eps): where its result goes decides
        arithmetic = use.target in _COMMUTATIVE or use.target in _SECOND_OPERAND
        return arithmetic and bool(use.users) and all(_tensorified(u, use, depth + 1) for u in use.users)
    if not isinstance(out, torch.Tensor):
        return False
    if use.target in _COMMUTATIVE:
        return all(i < 2 for i in positions)
    return use.target in _SECOND_OPERAND and positions == [1]


def is_module_attribute(placeholder: fx.Node) -> bool:
    """True if Dynamo lifted ``placeholder`` from an attribute of an ``nn.Module`` (its guard source says so)."""
    grapharg = placeholder.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return False
    try:
        guard = source.guard_source
        guard = guard() if callable(guard) else guard
        return bool(guard.is_unspecialized_nn_module() or guard.is_specialized_nn_module())
    except Exception:  # noqa: BLE001 - another torch's Source API: leave the float as it was
        return False


def bake_module_floats(gm: fx.GraphModule, example_inputs) -> list[tuple[int, float, str]]:
    """Bake in the module floats ``gm`` passes to an op as numbers (see the module docstring); the checks.

    ``example_inputs`` are the backend call's inputs, the first placeholders of ``gm`` in order. Changes
    ``gm`` in place and recompiles it when it bakes anything.
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    checks = []
    for item in list(gm.graph.find_nodes(op="call_method", target="item")):
        p = item_of_placeholder(item)
        if p is None or not item.users or all(_tensorified(u, item) for u in item.users):
            continue
        index = placeholders.index(p)
        example = example_inputs[index] if index < len(example_inputs) else None
        if not (isinstance(example, torch.Tensor) and example.dim() == 0 and example.is_floating_point()
                and example.device.type == "cpu" and is_module_attribute(p)):
            continue
        value = float(example)
        readers = ", ".join(u.name for u in item.users)
        for user in list(item.users):
            user.args = fx.node.map_arg(user.args, lambda n: value if n is item else n)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda n: value if n is item else n)
        gm.graph.erase_node(item)
        checks.append((index, value, f"{p.name} (read as a number by {readers})"))
    if checks:
        gm.recompile()
    return checks
