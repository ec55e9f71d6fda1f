"""Analysis: which placeholders of a Dynamo graph hold token inputs, and the batch's ``[B, S]``.

Contract
    Input: a Dynamo ``GraphModule`` and its example inputs.
    Output: the token inputs by role, for ``analyze_token_axes``:

        ``"input_ids"``, ``"attention_mask"``, ``"position_ids"``, ``"inputs_embeds"``
            placeholders whose names say so (``L_kwargs_input_ids_``, ``L_batch_attention_mask_`` ...)
        ``"carried:<name>"``  placeholders laid out ``[B, S, ...]`` (hidden states, positions, logits a
            graph receives from the graph before it)
        ``"column:<name>"``   placeholders laid out ``[1, S, ...]`` (values of the column only)

    and ``(B, S)`` for a graph without token ids (from its attention's query, else the layout current
    while it is compiled), or ``Refusal`` when there is nothing to pack.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from .. import active_layout
from .attention_match import find_attention
from .token_axes import Refusal, hint

__all__ = ["TOKEN_INPUT_ROLES", "carried_batch_shape", "complete_token_inputs", "find_token_inputs", "token_major_inputs"]

TOKEN_INPUT_ROLES = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")


def find_token_inputs(graph: fx.Graph) -> dict[str, fx.Node]:
    """Placeholders whose names say they are token inputs (``L_kwargs_input_ids_``, ``L_batch_attention_mask_`` ...)."""
    found: dict[str, fx.Node] = {}
    for node in graph.find_nodes(op="placeholder"):
        name = node.name.lower()
        for role in TOKEN_INPUT_ROLES:
            if role in name and role not in found and isinstance(node.meta.get("example_value"), torch.Tensor):
                found[role] = node
    return found


def complete_token_inputs(gm: fx.GraphModule, example_inputs, found: dict) -> tuple[dict[str, fx.Node], Optional[tuple[int, int]]]:
    """``found`` (``find_token_inputs``) with the token-major placeholders added, and the batch shape of a graph
    without token ids (None with them: ``analyze_token_axes`` reads it off ``input_ids``)."""
    if "input_ids" in found:
        ids_shape = found["input_ids"].meta["example_value"].shape
        if tuple(ids_shape[:2]) == (1, 1) and not any(isinstance(d, torch.SymInt) for d in ids_shape[:2]):
            # Dynamo specialises sizes of 1, so this graph only ever sees a single token: nothing
            # to share or to pack (and the analysis cannot tell its size-1 token axes from broadcasts).
            raise Refusal("a [1, 1] batch (one row of one token): nothing to share, so nothing to pack")
        B, S = (hint(d) for d in ids_shape[:2])
        return {**found, **token_major_inputs(gm, example_inputs, found, B, S, floating_3d_only=True)}, None
    # A part of a model after a graph break: its layout is carried from an earlier graph or detected from its inputs.
    batch_shape = carried_batch_shape(gm)
    return token_major_inputs(gm, example_inputs, {}, *batch_shape), batch_shape


def is_parameter(node: fx.Node, example) -> bool:
    name = node.name.lower()
    return isinstance(example, torch.nn.Parameter) or "_parameters_" in name or "_buffers_" in name


def token_major_inputs(gm, example_inputs, known: dict, B: int, S: int, floating_3d_only: bool = False) -> dict[str, fx.Node]:
    """Placeholders laid out ``[B, S, ...]`` (role ``"carried:<name>"``) or ``[1, S, ...]`` (``"column:<name>"``).

    Hidden states, position embeddings and position ids a graph receives
    from the graph before it. Parameters and buffers are not token-major; a
    4-D mask ``[B, 1, S, S]`` is not either (it is checked, then dropped).
    With token ids in the graph only floating-point inputs of rank 3 or more
    are added (hidden states, logits): ``[B, S]`` loss inputs stay as they were.
    """
    found: dict[str, fx.Node] = {}
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    taken = set(known.values())
    for i, node in enumerate(placeholders):
        ev = node.meta.get("example_value")
        example = example_inputs[i] if i < len(example_inputs) else None
        if node in taken or not isinstance(ev, torch.Tensor) or ev.dim() < 2 or is_parameter(node, example):
            continue
        if floating_3d_only and not (ev.dtype.is_floating_point and ev.dim() >= 3):
            continue
        lead = (hint(ev.shape[0]), hint(ev.shape[1]))
        if lead == (B, S):
            found[f"carried:{node.name}"] = node
        elif lead == (1, S) and B > 1 and not floating_3d_only:
            found[f"column:{node.name}"] = node
    return found


def carried_batch_shape(gm) -> tuple[int, int]:
    """``(B, S)`` of a graph without token ids: its attention's query, else the layout current while it is compiled."""
    for m in find_attention(gm.graph):
        q = m.q.meta.get("example_value")
        if isinstance(q, torch.Tensor) and q.dim() == 4:
            return hint(q.shape[0]), hint(q.shape[2])
    active = active_layout.current()
    if active is None:
        raise Refusal(
            "no input_ids among this graph's inputs and no attention to find its batch by, and no layout was current "
            "when it was compiled (a graph break may have split the model, leaving this part without them)"
        )
    return active.layout.batch_size, active.layout.seq_len
