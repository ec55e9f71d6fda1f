"""Every ``dualkv::`` torch.library op, each beside its fake implementation and autograd formula.

``attention`` (``dualkv::attention_fwd``/``attention_bwd`` and the backend
dispatch), ``linear_log_prob`` (``dualkv::linear_log_prob``/``_bwd``, ``_entropy``/``_entropy_bwd``), ``flex``
(``dualkv::flex_block_tables`` and the FlexAttention backend's dispatch). The math they
run lives in ``kernels``; nothing here imports from above (analysis, rewrite,
runtime). One pair lives lower, in ``layout.pack``: ``dualkv::gather_rows``/``_bwd``, the CPU gather under
``unpack`` (the layout layer may not import ``ops``).
"""
