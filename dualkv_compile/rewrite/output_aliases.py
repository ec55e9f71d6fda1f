"""Rewrite: graph outputs that share storage in the original program share it in the packed one.

Contract
    Input: the packer (``pack_graph._Packer``) after every node was translated, and the original graph's
    output leaves.
    Output: ``{output leaf: node of the packed graph}`` for the leaves that are views of a value another output
    views too (``h`` and ``h.view(-1, d)``), or of a graph input: each is its view ops (the original ones)
    replayed on the original form of the value they view, its root (``unpack`` of it, or the input itself).
    The other leaves are not in it: their original form (``orig_of``) is what the output returns.

Why: each token value leaves the packed region through an ``unpack`` of its own, a new tensor. Dynamo makes
the values a graph break splits live outputs of the graph before it, aliases included, and the program after
the break may change one of them in place; the original program's other aliases see the change (docs/design.md,
semantics 9), separate unpacks did not (a ``flat.mul_(2)`` of ``flat = h.view(-1, d)`` after the break left
``h`` as it was). Replayed views alias their root's one unpack, or the input, as the original outputs do.

A view is found by its example value: a node whose value shares the storage of its first argument's (``view``,
``reshape`` where it aliases, ``transpose``, basic slicing, ``detach``), not an in-place op. Multi-output
views (``split``, ``unbind``: the root is a tuple) are not followed, nor a view whose root has no original form
(``orig_of`` refuses): those keep their own unpack.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..analysis.node_info import Kind
from ..normalize.functionalize import mutated_input
from ..graph import Refusal
from ..graph.meta import ev, example_storage as _storage

__all__ = ["aliased_outputs"]


def aliased_outputs(packer, leaves) -> dict[fx.Node, fx.Node]:
    """See the module docstring."""
    nodes = [a for a in leaves if isinstance(a, fx.Node)]
    count: dict[StorageWeakRef, int] = {}
    for a in dict.fromkeys(nodes):
        key = _storage(a)
        if key is not None:
            count[key] = count.get(key, 0) + 1
    replayed: dict[fx.Node, fx.Node] = {}
    for a in dict.fromkeys(nodes):
        chain = _view_chain(a, packer.axes)
        if chain is None:
            continue
        root = chain[-1]
        if root.op != "placeholder" and count.get(_storage(a), 0) < 2:
            continue  # the only output of its storage: nothing to alias, its unpack is a tensor of its own
        try:
            value = packer.orig_of(root)
            for node, parent in zip(reversed(chain[:-1]), reversed(chain[1:])):
                value = packer.copy(node, lambda x, parent=parent, value=value: value if x is parent else packer.orig_of(x))
        except Refusal:
            continue  # its own unpack (the nodes emitted on the way are dead: DCE drops them)
        replayed[a] = value
    return replayed


def _view_chain(a: fx.Node, axes) -> Optional[list[fx.Node]]:
    """``[a, its operand, ..., root]`` where each is a view of the next (same storage, not an in-place op) and the
    root is not (it made the storage), a token value or a graph input; None where ``a`` is no such view."""
    chain = [a]
    while True:
        x = chain[-1]
        info = axes.info.get(x)
        if info is None or info.kind is not Kind.TOKEN or (x.op != "placeholder" and info.from_inputs):
            return None  # a value the packed graph computes in the original layout keeps its own translation
        if x.op == "placeholder":
            break
        src = x.args[0] if x.op in ("call_function", "call_method") and x.args else None
        if not isinstance(src, fx.Node) or mutated_input(x) is not None or _storage(src) is None or _storage(src) != _storage(x):
            break
        chain.append(src)
    return chain if len(chain) > 1 else None
