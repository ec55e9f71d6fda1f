"""The FlexAttention backend's math: the prefix-forest mask and the FlexAttention calls, with no op or dispatch.

    block_tables.py          segment_table, block_tables (eager torch), depth_limit, BLOCK, SENTINEL
    triton_block_tables.py   triton_kernels, triton_block_tables (the CUDA builder)
    mask_mod.py              tree_mask_mod, windowed_mask_mod (the mask of the partial blocks)
    attention.py             supports, the BlockMask of the tables, the compiled flex call, forward, backward

Assumes ``layout.segments.Segments`` as the layout type and nothing from
``dualkv_compile.ops``: the custom op ``dualkv::flex_block_tables``, the
``BlockMask`` built through it and the backend protocol over ``Segments`` live
in ``ops/flex.py``, which builds on this package. Guarantees: both builders
return the same tables (see their modules) with no device sync, with or
without sliding and chunked windows, and the mask_mods agree with the
FULL/partial classification they make. Importing the package imports no
FlexAttention (``attention.py`` does).
"""

from .block_tables import BLOCK, SENTINEL, block_tables, depth_limit, segment_table
from .mask_mod import tree_mask_mod, windowed_mask_mod
from .triton_block_tables import triton_block_tables, triton_kernels

__all__ = ["BLOCK", "SENTINEL", "block_tables", "depth_limit", "segment_table", "tree_mask_mod", "windowed_mask_mod",
           "triton_block_tables", "triton_kernels"]
