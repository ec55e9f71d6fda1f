"""The attention backend of one graph, resolved before the rewrite traces it (docs/design.md, "Ops and kernels").

Assumes: the graph's attention matches (``analysis.attention_match``), their ``q`` with an example value
``[B, H, S, D]`` (sizes may be symbolic). Guarantees: the concrete backend ``ops.attention`` picks for the first
attention's head count, head dim, dtype and device ("auto" resolved), so the packed graph holds a choice and not
a rule; or a ``Refusal`` naming why the requested backend cannot run it (the graph then runs unchanged).
``pack_graph`` may still pick another per attention where "auto" must (windows, sinks, a softcap).
"""

from __future__ import annotations

import torch

from ..analysis.node_info import hint as size_hint
from ..graph import Refusal
from ..graph.meta import ev

__all__ = ["resolve_attention_backend"]


def resolve_attention_backend(backend: str, attention) -> str:
    """The concrete attention backend for this graph's attention, or ``Refusal`` naming why it cannot run it."""
    from ..ops.attention import resolve_backend, unsupported_reason

    if not attention:
        return backend  # unused: a graph without attention (the lm_head after a graph break)
    q = ev(attention[0].q)
    # Under dynamic=True Dynamo may make the head count and head dim symbolic too.
    probe = torch.empty((1, size_hint(q.shape[1]), 1, size_hint(q.shape[3])), dtype=q.dtype, device=q.device)
    why = unsupported_reason(backend, probe)
    if why is not None:
        # A Refusal, not a ValueError: the graph runs unchanged and its report (explain()) says why.
        # (An exception of another kind escaped the backend and left the report reading "REFUSED: None".)
        raise Refusal(f"attention_backend={backend!r} cannot run this graph's attention: {why}")
    return resolve_backend(backend, probe)
