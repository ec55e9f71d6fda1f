"""Runtime: what runs per call of a rewritten graph.

``runner`` (layout, decide, pack, run, unpack) with its ``layout_source``
strategies, ``mask_check`` (the one mask check), ``nested_compile`` (the inner
compiler, with ``autocast_regions`` for it), ``sequence_parallel`` (per call: the group's
layout, this rank's chunk) and ``exactness_check`` (option ``check_exact``).
The graph analyses the runner reads once, when it is built (``padding_reads``,
``side_graphs``), are in ``analysis``.
"""
