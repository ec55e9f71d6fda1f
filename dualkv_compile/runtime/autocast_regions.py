"""Autocast regions of a Dynamo graph as ``with torch.autocast(...)`` blocks, so Dynamo can trace the graph again.

Dynamo writes a ``with torch.autocast(...)`` of the traced code (Hugging Face's rotary embedding
disables autocast to compute cos/sin in float32) as a pair of calls, ``_enter_autocast(...)`` and
``_exit_autocast(mode)``. ``nested_compile`` traces the packed graph with Dynamo again (for its dynamic
sizes); Dynamo before torch 2.12 runs such a call while tracing, changes the process's autocast state,
and fails ("Global autocast state changed while dynamo tracing"), so under ``torch.autocast`` the
packed graph never ran. Here each outermost pair becomes a call of ``run_autocast_region`` on a
submodule holding the nodes between them, which Dynamo traces as an ordinary ``with`` block; pairs
nested inside are handled the same way within the submodule.

Guarantees: the returned module computes what ``gm`` computes, with the same autocast state around
every op; a graph without autocast calls is returned unchanged.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from ..graph.meta import copy_meta

__all__ = ["has_autocast_calls", "autocast_regions_as_with_blocks", "run_autocast_region"]

_ENTER, _EXIT = torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast


def run_autocast_region(autocast_args: tuple, region: torch.nn.Module, *inputs):
    """``region(*inputs)`` under ``torch.autocast(*autocast_args)`` (``_enter_autocast``'s positional arguments)."""
    with torch.autocast(*autocast_args):
        return region(*inputs)


def has_autocast_calls(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target in (_ENTER, _EXIT) for n in gm.graph.nodes)


def autocast_regions_as_with_blocks(gm: fx.GraphModule) -> fx.GraphModule:
    """See the module docstring. Raises ``ValueError`` for enter/exit calls that are not properly paired."""
    if not has_autocast_calls(gm):
        return gm
    chunk, depth, args_of = 0, 0, {}
    partition: dict[fx.Node, int] = {}
    drop = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        is_enter = n.op == "call_function" and n.target is _ENTER
        is_exit = n.op == "call_function" and n.target is _EXIT
        if depth == 0 and is_enter:
            chunk += 1
            args_of[chunk] = tuple(n.args)
            if n.kwargs:
                raise ValueError(f"{n.name}: _enter_autocast with keyword arguments")
            drop.append(n)
            depth = 1
            continue
        if depth == 1 and is_exit:
            if any(u.op != "output" and u not in drop for u in n.users):
                raise ValueError(f"{n.name}: the result of _exit_autocast is read")
            drop.append(n)
            depth = 0
            chunk += 1
            continue
        depth += is_enter - is_exit
        if depth < 0:
            raise ValueError(f"{n.name}: _exit_autocast without its _enter_autocast")
        partition[n] = chunk
    if depth:
        raise ValueError("an _enter_autocast without its _exit_autocast")

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    for n in reversed(drop):
        copy = env[n]
        for user in list(copy.users):
            # The output tuple may name the enter/exit results (Dynamo frees them with `= None` only in code).
            user.replace_input_with(copy, None)
        graph.erase_node(copy)
    flat = fx.GraphModule(gm, graph)
    parts = {env[n]: p for n, p in partition.items()}
    split = split_module(flat, gm, lambda node: parts[node], keep_original_order=True)

    for node in list(split.graph.find_nodes(op="call_module")):
        index = int(node.target.rsplit("_", 1)[1])
        if index not in args_of:
            continue
        region = autocast_regions_as_with_blocks(getattr(split, node.target))
        setattr(split, node.target, region)
        with split.graph.inserting_before(node):
            module = split.graph.get_attr(node.target)
            call = split.graph.call_function(run_autocast_region, (args_of[index], module, *node.args), dict(node.kwargs))
        copy_meta(node, call)
        node.replace_all_uses_with(call)
        split.graph.erase_node(node)
    split.graph.lint()
    split.recompile()
    return split
