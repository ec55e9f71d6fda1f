"""Normalize: the passes that put a Dynamo graph into the form the analysis expects.

Each is a function over a graph with a contract docstring, and each changes a
copy (``graph.copy_graph_module``), never the graph it is given: the backend's fallback
keeps running the original. They run in this order, before ``analysis``:

``inline_checkpoint``  activation-checkpoint regions inlined, their nodes tagged for recomputation
``positional_args``    operands passed by keyword made positional, as the per-op rules read them
``causal_conv``        hybrid layers' ``conv1d(..., padding=K-1)[..., :T]`` as one causal convolution
``functionalize``      in-place ops on private values made out-of-place (docs/design.md, semantics 9)

What every pass shares (``Refusal``, node meta, copying, matchers) is the
floor below, ``graph``.
"""
