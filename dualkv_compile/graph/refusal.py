"""``Refusal``: raised by any pass (normalize, analysis, rewrite) when a graph cannot be rewritten exactly.

The backend catches it, runs the graph unchanged and keeps the message for ``explain()``.
"""

from __future__ import annotations

__all__ = ["Refusal"]


class Refusal(Exception):
    """The graph cannot be rewritten; the message says why."""
