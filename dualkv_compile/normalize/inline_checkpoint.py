"""Inline activation-checkpoint regions, keeping their recompute tags.

Contract
    Input: a Dynamo ``GraphModule`` that may call the higher-order op
    ``torch.ops.higher_order.tag_activation_checkpoint`` (what Dynamo makes of ``torch.utils.checkpoint.checkpoint(fn,
    *args, use_reentrant=False)``, Hugging Face's gradient checkpointing included): ``hop(body, *args,
    **checkpoint_kwargs)``, ``body`` a ``get_attr`` of a ``GraphModule`` subgraph, its result read through
    ``getitem``.
    Output: ``gm`` itself when it holds no region; otherwise a new ``GraphModule`` (``gm`` and its subgraphs are left
    unchanged: the caller's fallback keeps running them) computing the same values with every region's body copied
    into the graph in place of its call. Each copied ``call_function``/``call_method``/``call_module`` node carries
    the recompute tags ``recompute = CheckpointPolicy.PREFER_RECOMPUTE`` and ``ac_graph_id`` (one id per region,
    increasing in graph order), what plain checkpointing puts on the nodes it traces. Placeholders keep their
    ``example_value`` meta, so the token-axis analysis runs on the inlined graph as on any flat graph.
    Refused (``Refusal``): a region with a ``context_fn`` (selective checkpointing: its per-op policy would meet
    other ATen ops after the rewrite, e.g. SDPA become the shared-prompt attention op).

The tags reach AOTAutograd's partitioners, so the packed regions are recomputed in the backward as the original
ones were, with no ``activation_memory_budget`` setting (how: docs/design.md, "Checkpointing").
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from .functionalize import eliminate_dead_code
from ..graph import Refusal, copy_graph_module
from ..graph.meta import TAGGED_OPS, copy_meta, mark_recompute

log = logging.getLogger("dualkv_compile")

__all__ = ["inline_checkpoint_regions", "checkpoint_regions"]


def _is_checkpoint_hop(n: fx.Node) -> bool:
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    return n.op == "call_function" and (
        n.target is hop
        or (isinstance(n.target, torch._ops.HigherOrderOperator) and "checkpoint" in type(n.target).__name__.lower())
    )


def checkpoint_regions(gm: fx.GraphModule) -> list[fx.Node]:
    """The calls of ``tag_activation_checkpoint`` in ``gm``'s graph, in graph order."""
    return [n for n in gm.graph.nodes if _is_checkpoint_hop(n)]


def _body_of(gm: fx.GraphModule, call: fx.Node) -> fx.GraphModule:
    body_node = call.args[0]
    if not (isinstance(body_node, fx.Node) and body_node.op == "get_attr"):
        raise Refusal(f"{call.name}: activation checkpoint region whose body is not a get_attr of a subgraph")
    body = operator.attrgetter(body_node.target)(gm)
    if not isinstance(body, fx.GraphModule):
        raise Refusal(f"{call.name}: activation checkpoint region whose body is a {type(body).__name__}, expected a GraphModule")
    return body


def inline_checkpoint_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its activation-checkpoint regions inlined and tagged (see the module docstring)."""
    regions = checkpoint_regions(gm)
    if not regions:
        return gm
    for call in regions:
        ctx = getattr(_body_of(gm, call), "meta", {}).get("_checkpoint_context_fn")
        if ctx is not None:
            raise Refusal(
                f"{call.name}: selective activation checkpointing (context_fn={getattr(ctx, '__name__', type(ctx).__name__)}) "
                "decides per ATen op what to save, and the rewrite replaces some of those ops; only plain "
                "torch.utils.checkpoint regions (no context_fn) are rewritten"
            )
    out = copy_graph_module(gm)
    next_id = 1
    # Regions nested inside a body are copied as calls and inlined on a later round.
    while True:
        calls = checkpoint_regions(out)
        if not calls:
            break
        for call in calls:
            _inline_one(out, call, next_id)
            next_id += 1
    eliminate_dead_code(out.graph)  # in-place ops stay, read or not
    out.graph.lint()
    out.recompile()
    log.info("dualkv: inlined %d activation checkpoint region(s), tagged for recomputation", next_id - 1)
    return out


def _inline_one(gm: fx.GraphModule, call: fx.Node, region_id: int) -> None:
    body = _body_of(gm, call)
    unknown = set(call.kwargs) - {"use_reentrant", "preserve_rng_state", "determinism_check", "debug", "early_stop"}
    if unknown:
        raise Refusal(f"{call.name}: activation checkpoint region with arguments {sorted(unknown)} the rewrite does not know")
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    args = list(call.args[1:])
    if len(args) != len(placeholders):
        raise Refusal(f"{call.name}: activation checkpoint region with {len(args)} inputs for {len(placeholders)} body placeholders")
    env: dict[fx.Node, object] = dict(zip(placeholders, args))
    result = None
    with gm.graph.inserting_before(call):
        for n in body.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                result = fx.map_arg(n.args[0], lambda x: env[x])
                continue
            if n.op == "get_attr":
                # A constant or a nested region's body: move it onto the parent under a fresh name.
                name = _fresh_attr(gm, f"{call.name}_{n.target.replace('.', '_')}")
                setattr(gm, name, operator.attrgetter(n.target)(body))
                new = gm.graph.get_attr(name)
                copy_meta(n, new)
            else:
                new = gm.graph.node_copy(n, lambda x: env[x])
                if n.op in TAGGED_OPS:
                    mark_recompute(new, region_id)
            env[n] = new
    if not isinstance(result, (tuple, list)):
        call.replace_all_uses_with(result)
    for user in list(call.users):
        if not (user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)):
            raise Refusal(f"{call.name}: the result of an activation checkpoint region is read by {user.format_node()}, expected getitem")
        user.replace_all_uses_with(result[user.args[1]])
        gm.graph.erase_node(user)
    body_node = call.args[0]
    gm.graph.erase_node(call)
    if not body_node.users:
        gm.graph.erase_node(body_node)
        still_read = any(n.op == "get_attr" and n.target == body_node.target for n in gm.graph.nodes)
        if not still_read and "." not in body_node.target:
            delattr(gm, body_node.target)


def _fresh_attr(gm: fx.GraphModule, base: str) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name
