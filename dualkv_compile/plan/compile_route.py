"""Which route the packed graph is compiled by, as far as the graph, the options and the mode decide it.

Assumes: a graph whose placeholders carry Dynamo's example values (``graph.meta.ev``).
Guarantees: ``eligible`` is None where ``runtime.direct_compile`` may compile the graph (an inner compiler that
compiles symbolic sizes, a mode without CUDA graphs, ``packed_compile="direct"``), else why not; the part that
depends on a call (every input a plain tensor or int: ``direct_compile.plain``) is left to the call.
``is_dynamic`` says whether Dynamo made any input size symbolic.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from ..config import DualKVConfig
from ..graph.meta import ev

__all__ = ["eligible", "is_dynamic", "symbolic"]


def eligible(gm: fx.GraphModule, cfg: DualKVConfig, mode: Optional[str] = None) -> Optional[str]:
    """None if ``gm`` can be compiled directly, else why not (then ``nested_compile``)."""
    if cfg.packed_compile != "direct":
        return f"options['packed_compile'] is {cfg.packed_compile!r}"
    if cfg.inner not in ("inductor", "aot_eager"):
        return f"inner compiler {cfg.inner!r} compiles no symbolic sizes"
    if mode not in (None, "default"):
        from torch._inductor import list_mode_options

        if list_mode_options(mode).get("triton.cudagraphs"):
            # CUDA graphs ("reduce-overhead", "max-autotune") learn which inputs are static (the weights) from Dynamo.
            return f"mode {mode!r} uses CUDA graphs"
    return None


def symbolic(value) -> bool:
    """True for a SymInt or a tensor with a symbolic size."""
    return isinstance(value, torch.SymInt) or (
        isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in value.shape)
    )


def is_dynamic(gm: fx.GraphModule) -> bool:
    """True if an input of ``gm`` has a symbolic size (or is a SymInt)."""
    return any(symbolic(ev(n)) for n in gm.graph.find_nodes(op="placeholder"))
