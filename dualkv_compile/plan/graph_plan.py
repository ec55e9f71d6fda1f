"""``plan_graph``: what the runner of one rewritten graph needs, finished once when the graph is compiled.

Assumes: ``gm`` is the normalized graph the analysis read and its fallback's program, ``analysis`` its
``Analysis`` (no refusal), ``packed`` the packed graph after the fusion and module floats (its last
``len(PACKED_INPUTS)`` placeholders the layout's), ``runs`` the graph the runner compiles and runs (``packed``, or
its split over a Ulysses group), ``scalar_checks`` every module scalar baked in, ``cfg`` and ``mode`` the
compile's. Guarantees: a ``GraphPlan`` none of whose fields depends on a call: the layout source's inputs
(``layout_inputs``), the padding reads with their factors' side graphs (``padding_checks``), the outputs
``unpack`` makes (``outputs``), the outer graph's symbolic inputs and whether the packed graph may be compiled
directly (``compile_route``), the recurrent layers on the packed stream (``analysis.padding_neutral``).
``runtime`` does the rest per call.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch.fx as fx

from ..analysis.analyze import Analysis
from ..config import DualKVConfig
from ..graph.meta import ev
from .compile_route import eligible, is_dynamic
from .layout_inputs import LayoutInputs, plan_layout_inputs
from .outputs import unpacked_output_positions
from .padding_checks import PaddingChecks, plan_padding_checks

__all__ = ["GraphPlan", "plan_graph"]


@dataclasses.dataclass(frozen=True, eq=False)
class GraphPlan:
    packed_gm: fx.GraphModule  # the packed graph the plan read (padding reads, outputs)
    run_gm: fx.GraphModule  # compiled on the first packed call and run
    input_names: tuple[str, ...]  # the outer graph's placeholders (check_exact's messages)
    inputs: LayoutInputs
    padding: PaddingChecks
    scalar_checks: tuple[tuple[int, float, str], ...]  # (input index, value, what), compared per call
    unpacked_outputs: tuple[int, ...]  # tensor outputs made by unpack (layout.carried: ActiveLayout.record_outputs)
    outer_dynamic: bool  # Dynamo made a size of the outer graph symbolic
    outer_values: tuple[Any, ...]  # the outer graph's placeholders' example values (which sizes are symbolic)
    why_not_direct: Optional[str]  # None: runtime.direct_compile may compile run_gm, if the call's inputs are plain
    # (layer kind, why a left-padded call must run unpacked or None) per recurrent layer on the packed stream
    recurrent: tuple[tuple[str, Optional[str]], ...] = ()


def plan_graph(
    gm: fx.GraphModule, analysis: Analysis, packed: fx.GraphModule, runs: fx.GraphModule, cfg: DualKVConfig,
    mode: Optional[str], scalar_checks=(), graph_id: int = 0,
) -> GraphPlan:
    """The plan of one rewritten graph (see the module docstring); ``graph_id`` names it in the log."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    return GraphPlan(
        packed_gm=packed,
        run_gm=runs,
        input_names=tuple(n.name for n in placeholders),
        inputs=plan_layout_inputs(gm, analysis, packed, cfg),
        padding=plan_padding_checks(gm, packed, graph_id),
        scalar_checks=tuple(scalar_checks),
        unpacked_outputs=unpacked_output_positions(packed),
        outer_dynamic=is_dynamic(gm),
        outer_values=tuple(ev(n) for n in placeholders),
        why_not_direct=eligible(runs, cfg, mode),
        recurrent=tuple((kind, why) for _, kind, why in analysis.recurrent),
    )
