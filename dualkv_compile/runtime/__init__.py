"""Runtime: what runs per call of a rewritten graph.

``runner`` (layout, decide, pack, run, unpack) with its ``layout_source``
strategies, ``mask_check`` (the one mask check), ``padding_reads`` (reads of
positions packing does not compute), ``nested_compile`` (the inner compiler),
``side_graphs`` (the masks and factors cut from a graph to evaluate per call).
"""
