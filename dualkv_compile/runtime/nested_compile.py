"""Compiling a graph with the inner compiler: directly, lazily (the fallback), or nested in a fresh ``torch.compile``.

The backend hands the original graph (its fallback) and the packed graph to the inner compiler
(``"inductor"``, ``"aot_eager"`` or ``"eager"``). A graph with symbolic sizes, or one that reads lifted
module floats (``placeholder.item()``), is compiled through a nested ``torch.compile(dynamic=True)`` of a
function calling it: compiled directly outside Dynamo's tracing context it would be specialised to its
first inputs (or fail on the data-dependent ``.item()``). A graph with data-dependent sizes (``nonzero`` under
``capture_dynamic_output_shape_ops``: unbacked symbols) needs Dynamo's own fake inputs and shape environment:
its fallback is compiled at once, inside the backend call, as the inner compiler alone would have compiled it
(``LazyCompile.compile_now``).
"""

from __future__ import annotations

import itertools
import operator
import types
from typing import Callable, Optional

import torch
import torch.fx as fx

from ..config import DualKVConfig
from ..graph import copy_graph_module, item_of_placeholder
from ..graph.meta import ev, unbacked_bindings
from ..plan.compile_route import is_dynamic, symbolic
from .autocast_regions import autocast_regions_as_with_blocks

__all__ = [
    "LazyCompile", "dynamic_shape_patches", "has_unbacked_sizes", "indexes_by_a_boolean_mask", "inner_compile", "is_dynamic", "mode_patches", "nested_compile",
    "reads_lifted_scalars",
]

_nested_ids = itertools.count()


def inner_compile(gm: fx.GraphModule, example_inputs, cfg: DualKVConfig, mode: Optional[str]):
    if cfg.inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        config_patches = dict(mode_patches(mode), **dynamic_shape_patches(example_inputs))
        return compile_fx(gm, example_inputs, config_patches=config_patches)
    if cfg.inner == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    return gm.forward


def has_unbacked_sizes(gm: fx.GraphModule) -> bool:
    """True if a value of the graph has a data-dependent (unbacked) size or value (``nonzero``, ``.item()``).

    ``is_dynamic`` looks at the inputs only; these symbols appear inside the graph.
    """
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for n in gm.graph.nodes:
        if unbacked_bindings(n):
            return True
        try:
            if free_unbacked_symbols(ev(n)):
                return True
        except Exception:  # noqa: BLE001 - a value free_unbacked_symbols cannot walk: assume it has one
            return True
    return False


def indexes_by_a_boolean_mask(gm: fx.GraphModule) -> bool:
    """True if the graph indexes or assigns through a boolean tensor (``x[mask, :] = y``, Qwen3-VL's deepstack
    merge): no value of it has an unbacked size, but AOTAutograd's trace of it calls ``nonzero``."""
    def boolean(a) -> bool:
        v = ev(a) if isinstance(a, fx.Node) else None
        return isinstance(v, torch.Tensor) and v.dtype is torch.bool

    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (operator.getitem, operator.setitem) and len(n.args) > 1:
            index = n.args[1] if isinstance(n.args[1], (tuple, list)) else (n.args[1],)
            if any(boolean(a) for a in index):
                return True
    return False


def reads_lifted_scalars(gm: fx.GraphModule) -> bool:
    """True if the graph reads an input as a Python scalar (``placeholder.item()``: Dynamo's lifted module floats)."""
    return any(item_of_placeholder(n) is not None for n in gm.graph.find_nodes(op="call_method", target="item"))


class LazyCompile:
    """The original graph, compiled by the inner compiler on its first call.

    A rewritten graph may never need its fallback; compiling it up front
    doubled the first step's compile time. A static-shape graph compiles for
    the inputs of its first call (Dynamo's guards give it the sizes and
    strides of the backend call's example inputs); a dynamic-shape one goes
    through a nested ``torch.compile(dynamic=True)`` (compiled directly
    outside Dynamo's tracing context it would be specialised to its first
    inputs), the same route the packed graph takes. A graph with unbacked
    sizes compiles at once (``compile_now``): only Dynamo's tracing context,
    current while the backend runs, has the shape environment that defines
    them (compiled later from its example inputs, ``nonzero`` raised
    DynamicOutputShapeException); so does one that indexes by a boolean mask.

    Keeps no reference to the example inputs: they are the real tensors of
    the backend call (the model's weights, the batch), and a fallback that is
    never called lives as long as the compiled frame does.
    """

    def __init__(self, gm, example_inputs, cfg: DualKVConfig, mode: Optional[str]):
        self.args = (gm, cfg, mode)
        self.compiled: Optional[Callable] = None
        if has_unbacked_sizes(gm) or indexes_by_a_boolean_mask(gm):
            self.compile_now(example_inputs)

    def compile_now(self, example_inputs) -> "LazyCompile":
        """Compile now, as the inner compiler would have been called in this backend call: Dynamo's graph, its
        example inputs, and (while the backend runs) its tracing context, fake mode and shape environment."""
        if self.compiled is None:
            gm, cfg, mode = self.args
            self.compiled = inner_compile(gm, example_inputs, cfg, mode)
            self.args = None
        return self

    def __call__(self, *args):
        if self.compiled is None:
            gm, cfg, mode = self.args
            # A graph Dynamo traced with dynamic=True but specialised on sizes 0/1 everywhere (a [1, 1]
            # batch) has static shapes yet still reads module floats as `placeholder.item()`: compiled
            # from its example inputs outside Dynamo's tracing context, that .item() is data-dependent
            # (DataDependentOutputException). The nested route captures it like the outer trace did.
            if is_dynamic(gm) or reads_lifted_scalars(gm):
                self.compiled = nested_compile(gm, cfg, mode, dynamic=True)
            else:
                self.compiled = inner_compile(gm, list(args), cfg, mode)
            self.args = None
        return self.compiled(*args)


_SYM_BUILTINS = {torch.sym_sum: sum, torch.sym_max: max, torch.sym_min: min, torch.sym_int: int, torch.sym_float: float}


def nested_compile(gm: fx.GraphModule, cfg: DualKVConfig, mode: Optional[str], dynamic, on_compile=None):
    """``torch.compile`` of a plain function calling ``gm``, with the inner compiler as its backend.

    A plain function, not the GraphModule itself: nested inside the outer
    compiled frame, compiling the GraphModule object only caught the helper
    functions it calls, while a function around it is traced as one graph.
    """

    def inner_backend(g, example_inputs):
        if on_compile is not None:
            on_compile()
        return inner_compile(g, example_inputs, cfg, mode)

    # Dynamo's own graphs are _LazyGraphModules, whose lazy forward Dynamo
    # will not trace; a plain GraphModule over the same graph it will.
    module = copy_graph_module(gm)
    # Size arithmetic in dynamic-shape graphs (torch.sym_sum([1, s0]) ...)
    # cannot be re-traced by Dynamo; the Python builtins can, on SymInts too.
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target in _SYM_BUILTINS:
            node.target = _SYM_BUILTINS[node.target]
    module.recompile()
    # Dynamo before torch 2.12 cannot trace its own _enter_autocast/_exit_autocast calls again.
    module = autocast_regions_as_with_blocks(module)

    def forward(*args):
        return module(*args)

    # Dynamo keeps one cache per code object: give each graph its own, so
    # graphs never evict each other or add up to Dynamo's recompile limit.
    code = forward.__code__.replace(co_name=f"dualkv_graph_{next(_nested_ids)}")
    forward = types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)
    compiled = torch.compile(forward, backend=inner_backend, fullgraph=True, dynamic=dynamic)

    def run(*args):
        # Dynamic-shape graphs read module floats as `tensor.item()` (Dynamo
        # lifts them as inputs); the outer trace captured those, so must this one.
        # No duck shaping: a batch dim that happens to equal a fixed size (a rotary buffer's length)
        # would share its symbol and be specialised with it, recompiling for every new batch.
        with torch._dynamo.config.patch(capture_scalar_outputs=True), torch.fx.experimental._config.patch(use_duck_shape=False):
            return compiled(*args)

    return run


# Before torch 2.12, Inductor's coalescing analysis of Triton tilings compared symbolic sizes by their structure
# and could fail an assertion on equal sizes written two ways ("get_pw_red_splits", pytorch/pytorch#181563, fixed
# in #181793): a dynamic-shape GRPO step on torch 2.11 raised InductorError on a GPU. The analysis
# does not apply to dynamic shapes anyway (its own config comment says so), so it is turned off for them there.
_COALESCE_ANALYSIS_BREAKS_DYNAMIC = torch.__version__ < "2.12"  # a TorchVersion: compared as a version, local part aside


def dynamic_shape_patches(example_inputs) -> dict:
    """Inductor config patches for a graph compiled with symbolic sizes (see ``_COALESCE_ANALYSIS_BREAKS_DYNAMIC``)."""
    if _COALESCE_ANALYSIS_BREAKS_DYNAMIC and any(symbolic(x) for x in example_inputs):
        return {"triton.coalesce_tiling_analysis": False}
    return {}


def mode_patches(mode: Optional[str]) -> dict:
    if mode in (None, "default"):
        return {}
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))
