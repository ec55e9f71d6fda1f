"""The packed layout: how a micro-batch maps onto the packed stream (docs/design.md, "Module layout": the bottom layer).

``segments``       the kernels' ABI (``Segments``: a prefix forest in pre-order) and its dense index maps
``sequences``      the sequences of a batch (valid runs, packed rows) read to the host in one transfer
``forest``         the prefix forest of those sequences, built on the host
``shared_prompt``  ``SharedPromptLayout``: sequences, nodes, index tensors, stats
``detect``         sequences -> forest -> layout
``pack``           ``pack``/``unpack`` between ``[B, S, ...]`` and ``[T, ...]``
``packed_ops``     the same moves as the packed graph calls them (index tensors as inputs), and the meta keys that mark them
``carried``        the layout current in a thread, carried across graph breaks
"""

from .detect import detect
from .pack import gather_valid, pack, unpack
from .segments import Segments, dense_mask, previous_token_index, segment_ids, token_depth, token_reach, tree_segments
from .shared_prompt import LayoutStats, Node, SequenceSpan, SharedPromptLayout

__all__ = [
    "SharedPromptLayout", "Segments", "Node", "SequenceSpan", "LayoutStats", "detect", "pack", "unpack",
    "dense_mask", "previous_token_index", "segment_ids", "token_depth", "token_reach", "tree_segments", "gather_valid",
]
