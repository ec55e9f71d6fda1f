"""Node meta keys that ``pack_graph`` and ``weighted_reductions`` set for ``rewrite.sequence_parallel`` to read.

``TOKEN_SUM_META`` marks a node whose value is a sum over the packed tokens ("sum": the sum itself;
"accumulate": a ``scatter_add``/``index_add`` of the tokens into ``args[0]``). ``HEADS_META`` holds
``(Hq, Hkv)`` of a ``dualkv::attention_fwd`` call (the kernel's key/value heads, before any repeat).
"""

TOKEN_SUM_META = "dualkv_token_sum"
HEADS_META = "dualkv_heads"
