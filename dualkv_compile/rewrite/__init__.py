"""Rewrite: the passes that change a graph after the analysis, each a function over a graph with a contract docstring.

(The passes before the analysis are in ``normalize``.) ``pack_graph`` builds the packed graph from the analysis,
its layout inputs defined once in ``packed_inputs`` and its layout moves in
``layout.packed_ops``; ``fuse_linear_log_prob`` fuses a loss's lm_head ->
log_softmax -> next-token gather (and an entropy of the same log-probs) in the packed graph, the nodes
recognised by ``lm_head_pattern`` and ``entropy_pattern``.
"""
