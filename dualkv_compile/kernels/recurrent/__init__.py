"""Recurrent layers of hybrid models on the packed prefix forest: exact torch references (docs/design.md,
semantics 16), CPU or any device.

``gated_delta``  ``forest_gated_delta_rule``: GDN linear attention (transformers' Qwen3-Next torch fallback; KDA)
``causal_conv``  ``forest_causal_conv1d``: the short depthwise causal convolution before GDN and Mamba mixers
``mamba2``       ``forest_mamba2_scan``: the Mamba-2 SSD scan (transformers' ``mamba2_chunk_scan``)
``mamba1``       ``forest_selective_scan``: the Mamba (v1) selective scan (transformers' ``mamba_selective_scan``)
``levels``       the forest's depth levels: a forest of depth d is d batched scans, each segment from its
                 parent's final state

Each takes the packed stream as one sequence (batch 1) and ``layout.segments.Segments``; a token's value is the
one it has in every root-to-leaf sequence through it, the backward is autograd's. The packed graph calls the
convolution and the scans through ``ops.forest_recurrent`` (semantics 16).
"""

from .causal_conv import forest_causal_conv1d
from .gated_delta import forest_gated_delta_rule
from .levels import forest_levels, forest_scan
from .mamba1 import forest_selective_scan
from .mamba2 import forest_mamba2_scan

__all__ = ["forest_gated_delta_rule", "forest_causal_conv1d", "forest_mamba2_scan", "forest_selective_scan", "forest_levels", "forest_scan"]
