"""Kernels: the math only, tested against ``reference`` on random inputs.

``reference`` (dense masked attention, the oracle), ``cpu_flash`` (blockwise on CPU), ``flex/`` (the
FlexAttention block tables, mask_mod and calls), ``triton/`` (the hand-written kernels), ``gluon/`` (Hopper's
warp-specialised ones), ``common/`` (what those two share), ``linear_log_prob`` (the chunked lm_head ->
log-softmax -> gather) and ``linear_log_prob_entropy`` (the same with each row's entropy), ``head_dims``
(zero-padding for MLA's unequal q/k and v head dims, for kernels that take one). They take
``layout.segments.Segments`` and import nothing of the package but ``layout``; ``ops`` registers them as
``dualkv::`` ops.
"""
