"""What happened to each Dynamo graph the backend saw: ``GraphReport`` records, kept for ``explain()``.

The backend makes one report per graph (``new_report``) and the runners update its counters per call;
``reports()`` returns every report of the process, most recent last.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Optional

__all__ = ["GraphReport", "new_report", "reports"]


@dataclasses.dataclass
class GraphReport:
    """What happened to one Dynamo graph; ``explain()`` prints these."""

    graph_id: int
    num_nodes: int
    num_attention: int
    rewritten: bool
    reason: Optional[str] = None
    calls: int = 0
    packed_calls: int = 0
    packed_compiles: int = 0
    last_layout: Optional[str] = None
    last_stats: Any = None
    fallback_reasons: list[str] = dataclasses.field(default_factory=list)
    layout_source: Optional[str] = None  # the last packed call's: "detected from ..." or "carried from graph k ..."
    not_carried: list[str] = dataclasses.field(default_factory=list)  # why a current layout was not used
    fused_log_probs: int = 0  # next-token log-prob gathers fused with the lm_head (chunked_log_probs)
    fused_entropy: int = 0  # of those (or alone), entropies computed in the same chunks
    hints: list[str] = dataclasses.field(default_factory=list)  # what the caller may change to save memory or time
    exactness_checks: list[str] = dataclasses.field(default_factory=list)  # option check_exact: each check's summary
    attention_backends: list[str] = dataclasses.field(default_factory=list)  # the backend of each attention, in order
    # Each recurrent layer on the packed forest: its kind, and why a left-padded call must run unpacked (or None).
    recurrent_layers: list[tuple[str, Optional[str]]] = dataclasses.field(default_factory=list)
    local_tokens: Optional[int] = None  # under sequence parallelism: packed tokens this rank held on its last packed call

    def __str__(self) -> str:
        head = f"graph {self.graph_id}: {self.num_nodes} nodes, {self.num_attention} attention"
        if not self.rewritten:
            if self.reason is None:  # an error other than a refusal escaped the backend on this graph
                return f"{head} - not rewritten: the dualkv backend raised an error on it (torch.compile reported it)"
            return f"{head} - REFUSED: {self.reason}"
        lines = [f"{head} - rewritten; {self.calls} calls, {self.packed_calls} packed, packed graph compiled {self.packed_compiles}x"]
        if self.attention_backends:
            counts = {b: self.attention_backends.count(b) for b in dict.fromkeys(self.attention_backends)}
            lines.append("  attention backends: " + ", ".join(f"{b} x{n}" for b, n in counts.items()))
        if self.recurrent_layers:
            kinds = [k for k, _ in self.recurrent_layers]
            counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
            lines.append("  recurrent layers on the forest: " + ", ".join(f"{k} x{n}" for k, n in counts.items()))
            for why in dict.fromkeys(w for _, w in self.recurrent_layers if w):
                lines.append(f"  left-padded calls run unpacked: {why}")
        if self.fused_log_probs:
            lines.append(f"  next-token log-probs computed from the lm_head in chunks ({self.fused_log_probs} fused)")
        if self.fused_entropy:
            lines.append(f"  entropy fused into the chunked log-probs ({self.fused_entropy})")
        if self.local_tokens is not None:
            lines.append(f"  sequence parallel: {self.local_tokens} packed tokens per rank on the last packed call")
        if self.last_stats is not None:
            source = f", {self.layout_source}" if self.layout_source else ""
            lines.append(f"  last layout: {self.last_layout}{source}")
            lines.append(f"  {self.last_stats}")
        for c in self.exactness_checks[-3:]:
            lines.append(f"  checked exact on {c}")
        for h in self.hints:
            lines.append(f"  hint: {h}")
        for r in self.fallback_reasons[-3:]:
            lines.append(f"  ran unpacked: {r}")
        for r in self.not_carried[-3:]:
            lines.append(f"  layout not carried: {r}")
        return "\n".join(lines)


_reports: list[GraphReport] = []


_graph_ids = itertools.count()


def reports() -> list[GraphReport]:
    """Reports of every graph the backend has seen in this process (most recent last)."""
    return list(_reports)


def new_report(num_nodes: int) -> GraphReport:
    """A report for a new graph (its id counts up over the process), kept for ``reports()``."""
    report = GraphReport(next(_graph_ids), num_nodes, 0, rewritten=False)
    _reports.append(report)
    return report
