"""Module floats the packed graph reads: baked in as numbers, so its compile never restarts and holds no CPU code.

Under ``dynamic=True`` Dynamo lifts a module's float attributes (an RMSNorm's ``eps``, a rotary
``attention_scaling``, an ``nn.Embedding``'s ``norm_type``, a ``LayerNorm``'s ``eps``) as 0-dim CPU tensor
inputs that the graph reads with ``placeholder.item()``. The packed graph is traced by Dynamo again
(``runtime.nested_compile``), and AOTAutograd's ``tensorify_python_scalars`` pass handles each such float
one of two ways:

* where an op takes it as a Python number (``F.embedding(..., norm_type)``, ``F.layer_norm(..., eps)``),
  it specialises the float and restarts Dynamo's analysis of the whole graph
  (``TensorifyScalarRestartAnalysis``), after AOTAutograd had traced the joint graph and missed its cache
  under a key no run ever saves: most of a warm start's compile time on the CPU
  (docs/benchmarks.md, "Behind the code");
* where it feeds tensor arithmetic (``x + eps``), it turns the read into tensor ops on the 0-dim CPU tensor
  (``scalar_tensor``, ``convert_element_type``), which Inductor compiles as C++ even in a CUDA graph. Loading
  a cached graph with C++ code makes Inductor probe the host CPU's vector instruction sets, and torch 2.11
  probes by starting a Python process that imports torch, once per instruction set: most of a GPU host's
  warm start (docs/benchmarks.md, "Behind the code").

``bake_module_floats`` replaces every such read with its value, as torch would have specialised it without
``dynamic=True``, and returns the per-call checks (input index, value, what) the runner already keeps for
attention scales: a call where a module's float changed runs unpacked. Only module attributes are baked
(their source is an attribute of an ``nn.Module``): a float the loss function takes as an argument may
change every step, and stays as it was.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph import item_of_placeholder
from ..graph.meta import grapharg as _grapharg

__all__ = ["bake_module_floats", "is_module_attribute"]


def is_module_attribute(placeholder: fx.Node) -> bool:
    """True if Dynamo lifted ``placeholder`` from an attribute of an ``nn.Module`` (its guard source says so)."""
    grapharg = _grapharg(placeholder)
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
    """Bake in the module floats ``gm`` reads (see the module docstring); the per-call checks.

    ``example_inputs`` are the backend call's inputs, the first placeholders of ``gm`` in order. Changes
    ``gm`` in place and recompiles it when it bakes anything.
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    checks = []
    for item in list(gm.graph.find_nodes(op="call_method", target="item")):
        p = item_of_placeholder(item)
        if p is None or not item.users:
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
