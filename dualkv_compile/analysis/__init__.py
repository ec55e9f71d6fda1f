"""Analysis: what a Dynamo graph computes per token, read without changing it.

``analyze`` (analyze.py) is the entry: ``token_inputs`` finds the token
inputs with their ``Role``; ``attention_match`` finds each attention once;
``token_axes`` (the driver) tags every value with its token axes by the
per-op rules of ``token_rules``; ``node_info`` holds the per-node facts.

Read by the runner once, when it is built: ``padding_reads`` (where the packed
graph reads a position packing does not compute) and ``side_graphs`` (the
masks and factors cut from a graph, as small graphs the runner evaluates per
call). Neither changes the graph it reads.
"""
