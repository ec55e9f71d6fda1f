"""Plan: the compile-time work that finishes a rewritten graph before its runner, so runtime does per-call work only.

``plan_graph`` (``graph_plan``) builds a ``GraphPlan`` from the graph, its analysis and its packed and run graphs:
the layout source's inputs (``layout_inputs``), the padding reads and their factors' side graphs
(``padding_checks``), the outputs made by ``unpack`` (``outputs``) and the compile route (``compile_route``).
``attention_backend`` resolves the attention backend before the rewrite.
"""

from .attention_backend import resolve_attention_backend
from .graph_plan import GraphPlan, plan_graph

__all__ = ["GraphPlan", "plan_graph", "resolve_attention_backend"]
