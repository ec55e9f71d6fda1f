"""``analyze``: the one entry of the analysis, from a Dynamo graph to the facts the rewrite and the runner use.

Contract
    Input: a Dynamo ``GraphModule`` (checkpoint regions inlined, in-place ops
    functionalized), its example inputs, and the layout current in the thread
    while it is compiled (``layout.carried.current()``; None if none).
    Output: an ``Analysis``, frozen: the token axes of every node
    (``TokenAxes``), the attention matches with their scalar inputs resolved,
    the per-call checks of those scalars, the reason the graph cannot be
    rewritten (None when it can), and its recurrent layers with whether the
    padding before a row's tokens is neutral to each (``padding_neutral``). Nobody edits it afterwards.
    Raises ``Refusal`` when there is nothing to analyse (no token inputs and
    no batch shape to find them by, a KV cache, flex_attention with an outside
    block mask, a ``[1, 1]`` batch).
    The graph is not modified.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.fx as fx

from ..graph.meta import ev as _ev
from ..layout.carried import ActiveLayout
from .attention_match import AttentionMatch, find_attention, resolve_scalar_inputs
from .node_info import Kind
from .padding_neutral import padding_neutrality
from .recurrent_rules import recurrent_kind
from .token_axes import TokenAxes, analyze_token_axes
from .token_inputs import Role, TokenInputs, complete_token_inputs, find_token_inputs

__all__ = ["Analysis", "analyze", "floating_carried"]


@dataclasses.dataclass(frozen=True)
class Analysis:
    axes: TokenAxes
    # (input index, value, what) per module scalar baked into the packed graph: the runner checks each per call.
    scalar_checks: tuple[tuple[int, float, str], ...]
    refusal: Optional[str]
    # (node, layer kind, why its padding is not neutral or None) per recurrent layer on the packed stream
    # (analysis.padding_neutral; one computed in the original layout runs as the original op).
    recurrent: tuple = ()

    @property
    def attention(self) -> list[AttentionMatch]:
        return self.axes.attention

    @property
    def token_inputs(self) -> TokenInputs:
        return self.axes.token_inputs


def analyze(gm: fx.GraphModule, example_inputs, current_layout: Optional[ActiveLayout] = None) -> Analysis:
    """Analyse ``gm`` (see the module docstring)."""
    matches = find_attention(gm.graph)
    token_inputs, batch_shape = complete_token_inputs(gm, example_inputs, find_token_inputs(gm.graph), matches, current_layout)
    axes = analyze_token_axes(gm, token_inputs, batch_shape, matches)
    # A recurrent layer couples tokens as attention does: a state-space model without attention packs too.
    couples = axes.attention or any(recurrent_kind(n) and axes.info[n].kind is Kind.TOKEN for n in gm.graph.nodes)
    if not couples and not floating_carried(axes):
        if batch_shape is not None:
            why = (
                f"no attention, no input_ids and no floating-point input laid out [B, S, ...] = {list(batch_shape)} "
                "(the batch of the layout current when it was compiled): nothing to pack"
            )
        else:
            why = "no attention and no recurrent layer in this graph (nothing couples tokens, so packing saves only per-token work once the layout is known; a graph break may split the model)"
        return Analysis(axes, (), why)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    resolved, checks, scalar_refusals = resolve_scalar_inputs(axes.attention, placeholders, example_inputs)
    axes = dataclasses.replace(axes, attention=resolved, refusals=axes.refusals + tuple(scalar_refusals))
    recurrent = tuple(r for r in padding_neutrality(gm, axes) if axes.info[r[0]].kind is Kind.TOKEN)
    return Analysis(axes, tuple(checks), "; ".join(axes.refusals) or None, recurrent)


def floating_carried(axes: TokenAxes) -> list[fx.Node]:
    """Carried ``[B, S, ...]`` floating-point inputs: the values packing saves work on in a graph without attention."""
    return [
        n for n in axes.token_inputs.of(Role.CARRIED)
        if axes.info[n].kind is Kind.TOKEN and _ev(n).dtype.is_floating_point
    ]
