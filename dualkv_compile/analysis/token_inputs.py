"""Analysis: which placeholders of a Dynamo graph hold token inputs, and the batch's ``[B, S]``.

Contract
    Input: a Dynamo ``GraphModule`` and its example inputs.
    Output: ``TokenInputs``, each placeholder with its ``Role``, for ``analyze_token_axes``:

        ``INPUT_IDS``, ``ATTENTION_MASK``, ``POSITION_IDS``, ``INPUTS_EMBEDS``
            placeholders whose names say so (``L_kwargs_input_ids_``, ``L_batch_attention_mask_`` ...);
            at most one of each
        ``CARRIED``  placeholders laid out ``[B, S, ...]`` (hidden states, positions, logits a
            graph receives from the graph before it)
        ``COLUMN``   placeholders laid out ``[1, S, ...]`` (values of the column only)

    and ``(B, S)`` for a graph without token ids (from its attention's query, else the layout current
    while it is compiled), or ``Refusal`` when there is nothing to pack.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Iterator, Optional, Sequence

import torch
import torch.fx as fx

from ..layout.carried import ActiveLayout
from ..graph import Refusal
from ..graph.meta import ev as _ev
from .attention_match import AttentionMatch
from .node_info import hint

__all__ = ["Role", "TokenInput", "TokenInputs", "carried_batch_shape", "complete_token_inputs", "find_token_inputs", "token_major_inputs"]


class Role(enum.Enum):
    """What a token input of a graph is."""

    INPUT_IDS = "input_ids"
    ATTENTION_MASK = "attention_mask"
    POSITION_IDS = "position_ids"
    INPUTS_EMBEDS = "inputs_embeds"
    CARRIED = "carried"  # [B, S, ...]: a value received from an earlier graph (hidden states, positions, logits)
    COLUMN = "column"  # [1, S, ...]: a value of the column only (rotary tables)


# The roles found by a placeholder's name, at most one placeholder each.
NAMED_ROLES = (Role.INPUT_IDS, Role.ATTENTION_MASK, Role.POSITION_IDS, Role.INPUTS_EMBEDS)


@dataclasses.dataclass(frozen=True)
class TokenInput:
    role: Role
    node: fx.Node
    dims: tuple[int, int] = (0, 1)  # the b and s axes: (1, 2) for multimodal rotary positions [k, B, S]

    def __str__(self) -> str:
        """``input_ids``; ``carried:<placeholder>`` and ``column:<placeholder>`` for the token-major ones."""
        return self.role.value if self.role in NAMED_ROLES else f"{self.role.value}:{self.node.name}"


@dataclasses.dataclass(frozen=True)
class TokenInputs:
    """A graph's token inputs in discovery order; a placeholder appears once."""

    items: tuple[TokenInput, ...] = ()

    def __iter__(self) -> Iterator[TokenInput]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, role: Role) -> bool:
        return any(t.role is role for t in self.items)

    def get(self, role: Role) -> Optional[fx.Node]:
        """The placeholder of a named role, or None."""
        return next((t.node for t in self.items if t.role is role), None)

    def of(self, role: Role) -> list[fx.Node]:
        """Every placeholder with ``role``, in order."""
        return [t.node for t in self.items if t.role is role]

    def role_of(self, node: fx.Node) -> Optional[Role]:
        return next((t.role for t in self.items if t.node is node), None)

    def __add__(self, other: "TokenInputs") -> "TokenInputs":
        return TokenInputs(self.items + other.items)


def find_token_inputs(graph: fx.Graph) -> TokenInputs:
    """Placeholders whose names say they are token inputs (``L_kwargs_input_ids_``, ``L_batch_attention_mask_`` ...).

    Of several names with a role in them, the one that ends with it wins (``L_batch_input_ids_`` over
    veRL's ``L_batch_input_ids_rmpad_rolled_``, the labels), then the shortest (``input_ids_rmpad``
    over ``input_ids_rmpad_rolled``), whatever order the graph reads them in."""
    found: dict[Role, tuple[tuple[bool, int], fx.Node]] = {}
    placeholders = list(graph.find_nodes(op="placeholder"))
    for node in placeholders:
        name = node.name.lower()
        if not isinstance(_ev(node), torch.Tensor):
            continue
        for role in NAMED_ROLES:
            if role.value in name:
                rank = (not name.rstrip("_").endswith(role.value), len(name))
                if role not in found or rank < found[role][0]:
                    found[role] = (rank, node)
    order = sorted(found, key=lambda role: placeholders.index(found[role][1]))
    return TokenInputs(tuple(TokenInput(role, found[role][1]) for role in order))


def complete_token_inputs(
    gm: fx.GraphModule,
    example_inputs,
    found: TokenInputs,
    attention: Sequence[AttentionMatch] = (),
    current_layout: Optional[ActiveLayout] = None,
) -> tuple[TokenInputs, Optional[tuple[int, int]]]:
    """``found`` (``find_token_inputs``) with the token-major placeholders added, and the batch shape of a graph
    without token ids (None with them: ``analyze_token_axes`` reads it off ``input_ids``), found from its
    ``attention`` or else ``current_layout`` (the layout current in the thread while it is compiled)."""
    if Role.INPUT_IDS in found:
        ids_shape = _ev(found.get(Role.INPUT_IDS)).shape
        if tuple(ids_shape[:2]) == (1, 1) and not any(isinstance(d, torch.SymInt) for d in ids_shape[:2]):
            # Dynamo specialises sizes of 1, so this graph only ever sees a single token: nothing
            # to share or to pack (and the analysis cannot tell its size-1 token axes from broadcasts).
            raise Refusal("a [1, 1] batch (one row of one token): nothing to share, so nothing to pack")
        B, S = (hint(d) for d in ids_shape[:2])
        return found + token_major_inputs(gm, example_inputs, found, B, S, floating_3d_only=True), None
    # A part of a model after a graph break: its layout is carried from an earlier graph or detected from its inputs.
    batch_shape = carried_batch_shape(attention, current_layout)
    return token_major_inputs(gm, example_inputs, TokenInputs(), *batch_shape), batch_shape


def is_parameter(node: fx.Node, example) -> bool:
    name = node.name.lower()
    return isinstance(example, torch.nn.Parameter) or "_parameters_" in name or "_buffers_" in name


def token_major_inputs(gm, example_inputs, known: TokenInputs, B: int, S: int, floating_3d_only: bool = False) -> TokenInputs:
    """Placeholders laid out ``[B, S, ...]`` (role ``CARRIED``) or ``[1, S, ...]`` (``COLUMN``), not in ``known``.

    Hidden states, position embeddings and position ids a graph receives
    from the graph before it. Parameters and buffers are not token-major; a
    4-D mask ``[B, 1, S, S]`` is not either (it is checked, then dropped).
    With token ids in the graph only floating-point inputs of rank 3 or more
    are added (hidden states, logits): ``[B, S]`` loss inputs stay as they were.
    """
    found: list[TokenInput] = []
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    taken = {t.node for t in known}
    for i, node in enumerate(placeholders):
        ev = _ev(node)
        example = example_inputs[i] if i < len(example_inputs) else None
        if node in taken or not isinstance(ev, torch.Tensor) or ev.dim() < 2 or is_parameter(node, example):
            continue
        if floating_3d_only and not (ev.dtype.is_floating_point and ev.dim() >= 3):
            continue
        lead = (hint(ev.shape[0]), hint(ev.shape[1]))
        if lead == (B, S):
            found.append(TokenInput(Role.CARRIED, node))
        elif _multimodal_positions(ev, B, S):
            found.append(TokenInput(Role.CARRIED, node, (1, 2)))
        elif lead == (1, S) and B > 1 and not floating_3d_only:
            found.append(TokenInput(Role.COLUMN, node))
    return TokenInputs(tuple(found))


def _multimodal_positions(ev: torch.Tensor, B: int, S: int) -> bool:
    """An integer ``[k, B, S]`` input, 1 < k <= 4 and k != B (a ``[B, B, S]`` one could be batch-major): the rotary
    positions of a vision-language model (Qwen's M-RoPE rows: temporal, height, width, and text in newer versions),
    handed from the graph that computed them."""
    if ev.dim() != 3 or ev.dtype.is_floating_point or ev.dtype is torch.bool:
        return False
    k, b, s = (hint(d) for d in ev.shape)
    return (b, s) == (B, S) and 1 < k <= 4 and k != B


def carried_batch_shape(attention: Sequence[AttentionMatch], current_layout: Optional[ActiveLayout]) -> tuple[int, int]:
    """``(B, S)`` of a graph without token ids: its attention's query, else the layout current while it is compiled."""
    for m in attention:
        q = _ev(m.q)
        if isinstance(q, torch.Tensor) and q.dim() == 4:
            return hint(q.shape[0]), hint(q.shape[2])
    if current_layout is None:
        raise Refusal(
            "no input_ids among this graph's inputs and no attention to find its batch by, and no layout was current "
            "when it was compiled (a graph break may have split the model, leaving this part without them)"
        )
    return current_layout.layout.batch_size, current_layout.layout.seq_len
