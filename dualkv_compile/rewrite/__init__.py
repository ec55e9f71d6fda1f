"""Rewrite: the passes that change a graph, each a function over a graph with a contract docstring.

``inline_checkpoint`` (checkpoint regions inlined, tagged for recomputation),
``positional_args`` (operands passed by keyword made positional) and
``functionalize`` (in-place ops on private values made out-of-place) run
before the analysis, each on a copy (``graph_copy``); ``pack_graph`` builds the packed graph from the analysis,
its layout inputs defined once in ``packed_inputs`` and its layout moves in
``packed_ops``; ``fuse_linear_log_prob`` fuses a loss's lm_head ->
log_softmax -> next-token gather (and an entropy of the same log-probs) in the packed graph, the nodes
recognised by ``lm_head_pattern`` and ``entropy_pattern``.
"""
