"""Where a rewritten graph's layout source finds what it reads: the inputs by role, the masks, the embedding.

Assumes: the normalized graph ``gm`` the analysis read, its ``Analysis`` (no refusal), the packed graph.
Guarantees: placeholder positions of the named token inputs and of the carried ``[B, S, ...]`` ones; the masks'
side graph (``analysis.side_graphs.mask_graph``, where the layout source checks masks: always after a graph
break, else with option ``verify``), their names and windows; the first causal attention without a mask; the
embedding's row count; whether the packed program reads values of the column (then copies of a token in
different columns do not share). Read by ``runtime.layout_source`` per call; nothing here depends on a call.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.fx as fx

from ..analysis.analyze import Analysis, floating_carried
from ..analysis.side_graphs import mask_graph
from ..analysis.token_inputs import Role
from ..config import DualKVConfig
from ..graph.meta import ev
from ..layout.packed_ops import gather_columns

__all__ = ["LayoutInputs", "plan_layout_inputs"]


@dataclasses.dataclass(frozen=True, eq=False)
class LayoutInputs:
    input_ids: Optional[int]  # placeholder positions of the named token inputs (None: not an input)
    attention_mask: Optional[int]
    position_ids: Optional[int]
    carried: tuple[tuple[str, int, tuple[int, int]], ...]  # (name, position, b and s axes) of inputs from an earlier graph
    floating_index: tuple[int, ...]  # positions of the floating-point ones (analysis.analyze.floating_carried)
    has_attention: bool
    causal_unmasked: Optional[str]  # the first causal attention without a mask (it would attend to left padding)
    mask_gm: Optional[fx.GraphModule]  # the attention masks as the graph builds them, from the call's inputs
    mask_key: tuple[int, ...]  # the inputs the masks read (positions among mask_gm's placeholders)
    mask_names: tuple[str, ...]
    mask_windows: tuple[tuple, ...]  # (window, chunk) per masked attention
    vocab_size: Optional[int]  # rows of the one embedding that reads input_ids directly
    same_columns: bool  # the packed program reads values of the column (rotary tables from arange(S))


def plan_layout_inputs(gm: fx.GraphModule, analysis: Analysis, packed: fx.GraphModule, cfg: DualKVConfig) -> LayoutInputs:
    """The layout source's inputs of ``gm`` (see the module docstring)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    position = {n: i for i, n in enumerate(placeholders)}
    named = {t.role: t.node for t in analysis.token_inputs if t.role in (Role.INPUT_IDS, Role.ATTENTION_MASK, Role.POSITION_IDS)}
    attention = analysis.attention
    ids = named.get(Role.INPUT_IDS)
    # With token ids the masks are checked once, on the first call, under option verify; without (a graph after a
    # graph break), per call against the layout carried or detected.
    mask_gm = mask_graph(gm, analysis.axes) if (cfg.verify or ids is None) else None
    mask_key = () if mask_gm is None else tuple(i for i, p in enumerate(mask_gm.graph.find_nodes(op="placeholder")) if p.users)
    return LayoutInputs(
        input_ids=None if ids is None else position[ids],
        attention_mask=position[named[Role.ATTENTION_MASK]] if Role.ATTENTION_MASK in named else None,
        position_ids=position[named[Role.POSITION_IDS]] if Role.POSITION_IDS in named else None,
        carried=tuple((t.node.name, position[t.node], t.dims) for t in analysis.token_inputs if t.role is Role.CARRIED),
        floating_index=tuple(position[n] for n in floating_carried(analysis.axes)),
        has_attention=bool(attention),
        causal_unmasked=next((m.output.name for m in attention if m.mask is None and m.is_causal), None),
        mask_gm=mask_gm,
        mask_key=mask_key,
        mask_names=tuple(m.output.name for m in attention if m.mask is not None),
        mask_windows=tuple((m.window, m.chunk) for m in attention if m.mask is not None),
        vocab_size=None if ids is None else _embedding_rows(ids),
        same_columns=any(n.target is gather_columns for n in packed.graph.nodes),
    )


def _embedding_rows(ids: fx.Node) -> Optional[int]:
    """The row count of the one embedding that reads ``ids`` directly, or None (none, several, or no shape)."""
    rows = set()
    for user in ids.users:
        if user.op == "call_function" and user.target in (torch.nn.functional.embedding, torch.embedding):
            weight = ev(user.args[1] if user.target is torch.nn.functional.embedding else user.args[0])
            if isinstance(weight, torch.Tensor) and weight.dim() == 2:
                rows.add(int(weight.shape[0]))
    return rows.pop() if len(rows) == 1 else None
