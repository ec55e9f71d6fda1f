"""Runtime: what runs per call of a rewritten graph.

``runner`` (layout, decide, pack, run, unpack) with its ``layout_source``
strategies, ``mask_check`` (the one mask check), ``direct_compile`` (the packed
graph to the inner compiler with symbolic sizes, no second Dynamo trace),
``nested_compile`` (the inner compiler through a nested ``torch.compile``, with
``autocast_regions`` for it), ``sequence_parallel`` (per call: the group's
layout, this rank's chunk) and ``exactness_check`` (option ``check_exact``).
What the runner reads about its graph (the padding reads and side graphs, the
outputs ``unpack`` makes, the compile route) is finished at compile time by
``plan.plan_graph``; only per-call work is here.
"""
