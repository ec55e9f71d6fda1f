"""Normalize: the passes that put a Dynamo graph into the form the analysis expects.

Each is a function over a graph with a contract docstring, and each changes a
copy (``graph_copy``), never the graph it is given: the backend's fallback
keeps running the original. They run in this order, before ``analysis``:

``inline_checkpoint``  activation-checkpoint regions inlined, their nodes tagged for recomputation
``positional_args``    operands passed by keyword made positional, as the per-op rules read them
``functionalize``      in-place ops on private values made out-of-place (DESIGN.md semantics 9)

``graph_pass`` holds what every graph pass from here on shares: ``Refusal``
(the graph cannot be rewritten) and ``ev`` (a node's example value).
Imports nothing of the package outside ``normalize``.
"""
