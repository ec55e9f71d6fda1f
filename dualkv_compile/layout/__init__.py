"""The packed layout: how a micro-batch maps onto the packed stream (DESIGN.md, "Module layout": the bottom layer).

``segments``       the kernels' ABI (``Segments``) and its dense index maps
``shared_prompt``  ``SharedPromptLayout``: groups, index tensors, stats
``detect``         finding the groups of a padded batch (one host sync)
``pack``           ``pack``/``unpack`` between ``[B, S, ...]`` and ``[T, ...]``
``carried``        the layout current in a thread, carried across graph breaks
"""

from .detect import detect
from .pack import gather_valid, pack, unpack
from .segments import Segments, dense_mask, previous_token_index, segment_ids
from .shared_prompt import Group, LayoutStats, SharedPromptLayout

__all__ = [
    "SharedPromptLayout", "Segments", "Group", "LayoutStats", "detect", "pack", "unpack",
    "dense_mask", "previous_token_index", "segment_ids", "gather_valid",
]
