"""The graph vocabulary every stage shares: refusing a graph, reading a node's values and meta, copying a graph,
and the small matchers the passes use. Imports nothing of the package above ``layout``."""

from .copy import copy_graph_module
from .match import is_call, item_of_placeholder
from .refusal import Refusal
from .meta import ev

__all__ = ["Refusal", "copy_graph_module", "ev", "is_call", "item_of_placeholder"]
