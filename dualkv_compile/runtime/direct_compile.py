"""Compiling the packed graph with symbolic sizes straight through the inner compiler, without a second Dynamo trace.

``nested_compile`` hands the packed graph to a nested ``torch.compile``: Dynamo traces it again, op by op, to
make symbolic sizes and guards for it. On a warm start (every graph a cache hit) that second trace was a third
of dualkv's compile time (docs/benchmarks.md, "Behind the code"). Here the packed graph goes to the
inner compiler (AOTAutograd + Inductor) directly, with fake inputs made from the call's real ones, and the
guards the compile put on their sizes are checked on every later call.

Assumes: the caller calls the result only from inside the outer compiled frame, whose Dynamo guards fix every
outer input's type, dtype, device, requires_grad, static sizes and the global grad and autocast state; so only
the symbolic sizes, and the values of scalars read with ``placeholder.item()``, can change from call to call.
``eligible`` and ``plain`` say where that holds (plain tensors and ints; an inner compiler that compiles symbolic
sizes; a mode without CUDA graphs, which take the static inputs from Dynamo's marks).

Guarantees: a size is symbolic exactly where the caller says (``dims``: the outer graph's own symbolic sizes,
the packed layout's per-token and per-segment lengths); 0 and 1 specialise as in Dynamo (checked per call) and sizes never share a
symbol by being equal (no duck shaping, as ``nested_compile``). Every call evaluates the compile's guards on
those sizes (``ShapeEnv.produce_guards_expression``) and compares the scalars it baked in (``_bake_scalars``:
a loss's clip range, read as ``placeholder.item()`` from a CPU scalar); sizes that fail the guards get a new
compile, kept beside the first, as a Dynamo recompile would, up to ``MAX_ENTRIES``, past which the caller is told
(``TooManyCompiles``). A changed scalar, or a compile that fails, hands the graph to ``otherwise`` (the nested
route) for good, if the caller gave one.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import marshal
import sys
import types
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx

from ..config import DualKVConfig
from ..graph import item_of_placeholder
from ..graph import copy_graph_module
from ..graph.meta import drop_fake_values, example_value_from_val, mark_cacheable
from ..plan.compile_route import eligible  # decided at compile time (plan.GraphPlan.why_not_direct)
from . import nested_compile  # its inner_compile, read per call: the one inner compiler of both routes

log = logging.getLogger("dualkv_compile")

__all__ = ["DirectCompile", "MAX_ENTRIES", "TooManyCompiles", "eligible", "plain"]

# Dynamo's default recompile limit per frame (torch._dynamo.config.recompile_limit) is 8.
MAX_ENTRIES = 8


class TooManyCompiles(RuntimeError):
    """The packed graph was compiled ``MAX_ENTRIES`` times and this call's sizes fit none of them."""


def plain(value) -> bool:
    """True for the values ``DirectCompile`` takes: tensors (not subclasses) and ints."""
    return type(value) in (torch.Tensor, torch.nn.Parameter) or (isinstance(value, int) and not isinstance(value, bool))


class DirectCompile:
    """The packed graph compiled for symbolic sizes, each compile with its guards (see the module docstring).

    ``dims(args)`` gives, per argument, which dims are symbolic: a tuple of bools for a tensor, a bool for an
    int (symbolic or a constant). It is asked once per compile. ``otherwise()``, if given, makes the compiled
    function to use from then on when a compile here fails (the nested route, which Dynamo's trace may carry
    where this one cannot); without it the failure is raised.
    """

    def __init__(self, gm: fx.GraphModule, cfg: DualKVConfig, mode: Optional[str],
                 dims: Callable[[Sequence], list], on_compile: Optional[Callable[[], None]] = None,
                 otherwise: Optional[Callable[[], Callable]] = None):
        self.gm, self.cfg, self.mode, self.dims, self.on_compile = gm, cfg, mode, dims, on_compile
        self.otherwise = otherwise
        self.instead: Optional[Callable] = None
        # Per compile: its guard on the symbolic sizes (None: none), the function, and the scalars it baked in.
        self.entries: list[tuple[Optional[Callable[[list], bool]], Callable, dict[int, float]]] = []

    def __call__(self, *args):
        if self.instead is not None:
            return self.instead(*args)
        scalar_changed = False
        for guard, compiled, baked in self.entries:
            if guard is None or guard(args):
                if all(args[i].item() == v for i, v in baked.items()):  # CPU scalars (``_bake_scalars``): no sync
                    return compiled(*args)
                scalar_changed = True
        if scalar_changed and self.otherwise is not None:
            # A scalar that changes between calls (an annealed coefficient) would compile again each time: the
            # nested route keeps it an input where AOTAutograd can (its tensorify pass), as before this route.
            log.info("dualkv: a scalar the packed graph reads with .item() changed; compiling it through a nested torch.compile")
            self.instead = self.otherwise()
            return self.instead(*args)
        if len(self.entries) >= MAX_ENTRIES:
            raise TooManyCompiles(f"the packed graph was compiled {MAX_ENTRIES} times and this call's sizes fit none")
        if not all(plain(a) for a in args):
            kinds = sorted({type(a).__name__ for a in args if not plain(a)})
            raise TypeError(f"DirectCompile takes plain tensors and ints, got {', '.join(kinds)}")
        try:
            guard, compiled, baked = self._compile(list(args))
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - the other route, if the caller gave one
            if self.otherwise is None:
                raise
            log.info("dualkv: the packed graph's direct compile failed (%s: %s); compiling it through a nested "
                     "torch.compile", type(e).__name__, (str(e).splitlines() or [""])[0][:300])
            self.instead = self.otherwise()
            return self.instead(*args)
        self.entries.append((guard, compiled, baked))
        return compiled(*args)

    def _compile(self, args: list):
        from torch._dynamo.source import LocalSource
        from torch._guards import TracingContext, tracing
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext, is_concrete_int

        if self.on_compile is not None:
            self.on_compile()
        shape_env = ShapeEnv(duck_shape=False)
        fake_mode = FakeTensorMode(shape_env=shape_env)
        fakes = []
        dims = self.dims(args)
        for i, (value, dyn) in enumerate(zip(args, dims)):
            source = LocalSource(f"t{i}")
            if isinstance(value, torch.Tensor):
                sizes = [DimDynamic.DYNAMIC if d else DimDynamic.STATIC for d in dyn]
                # No source for a 0-dim tensor (it has no size to guard): with one, a CPU int64 or float64 scalar
                # (Dynamo's lifted module floats) would get a symbol for its value, which AOTAutograd's
                # tensorify pass then asks Dynamo to specialise (TensorifyScalarRestartAnalysis), and no Dynamo runs.
                fakes.append(fake_mode.from_tensor(
                    value, source=source if value.dim() else None,
                    symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes)))
            elif dyn:
                symbol = shape_env.create_symbol(value, source=source, dynamic_dim=DimDynamic.DYNAMIC)
                fakes.append(shape_env.create_symintnode(symbol, hint=value, source=source))
            else:
                fakes.append(value)
        gm = _fresh_copy(self.gm)
        baked = _bake_scalars(gm, args)
        gm.recompile()  # once, after both edits of the copy
        with tracing(TracingContext(fake_mode)):
            _propagate_fake_values(gm, fake_mode, fakes)
            compiled = nested_compile.inner_compile(gm, fakes, self.cfg, self.mode)
        code = shape_env.produce_guards_expression(fakes, ignore_static=True)
        # A size asked to be symbolic that came as 0 or 1 was specialised (as Dynamo does), and the guards above
        # leave static sizes to the caller: the caller's guards do not know it, so it is checked here.
        fixed = [f"L['t{i}'].size()[{d}] == {f.shape[d]}" for i, (f, dyn) in enumerate(zip(fakes, dims))
                 if isinstance(f, torch.Tensor) for d in range(f.dim()) if dyn[d] and is_concrete_int(f.shape[d])]
        code = " and ".join(([code] if code else []) + fixed) or None
        log.debug("dualkv: packed graph compiled directly (%d so far), guards: %s", len(self.entries) + 1, code)
        if not code:
            return None, compiled, baked
        guard_code = compile(code, "<dualkv packed graph guards>", "eval")
        names = [f"t{i}" for i in range(len(fakes))]
        env = _guard_globals()

        def guard(call_args) -> bool:
            return bool(eval(guard_code, env, {"L": dict(zip(names, call_args))}))

        return guard, compiled, baked


def _guard_globals() -> dict:
    """The globals ``ShapeEnv.evaluate_guards_expression`` evaluates guard code with (``SYMPY_INTERP``)."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    return dict(SYMPY_INTERP)


def _bake_scalars(gm: fx.GraphModule, args: list) -> dict[int, float]:
    """Replace each ``placeholder.item()`` (a float Dynamo lifted from the loss's arguments or defaults, a 0-dim
    CPU tensor: a clip range) by its value in this call; returns ``{input index: value}``, which ``__call__``
    checks per call, as Dynamo specialises a float AOTAutograd could not keep as a tensor."""
    placeholders = {p: i for i, p in enumerate(gm.graph.find_nodes(op="placeholder"))}
    baked = {}
    for node in list(gm.graph.find_nodes(op="call_method", target="item")):
        p = item_of_placeholder(node)
        if p is None:
            continue
        value = args[placeholders[p]]
        if value.device.type != "cpu":
            raise ValueError(f"input {p.name} is read with .item() on {value.device}: checking it per call would sync")
        baked[placeholders[p]] = number = value.item()
        for user in list(node.users):
            user.replace_input_with(node, number)
        gm.graph.erase_node(node)
    return baked


def _propagate_fake_values(gm: fx.GraphModule, fake_mode, fakes: list) -> None:
    """Each node's fake value for these inputs, as ``example_value`` (what Dynamo's trace would have left there):
    AOTAutograd's cache takes a method call only on a node that has one, and Inductor's pre-grad passes read them."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    # The caller's saved-tensors hooks (activation offloading, a test's recorder) must not see these fake values,
    # as AOTAutograd keeps them from its own tracing (they run at run time, around the compiled function).
    hooks_off = getattr(torch._dynamo.utils, "_disable_saved_tensors_hooks_during_tracing", None)
    # Under the Python dispatcher, as Dynamo's and AOTAutograd's tracing run: without it, torch 2.11's C++
    # composites (linear and matmul on 3-d inputs) read the concrete sizes of a fake tensor (aten.size.default)
    # and specialise every symbolic size they touch, and the packed graph compiled again for each token count.
    with hooks_off() if hooks_off is not None else torch.no_grad(), enable_python_dispatcher():
        FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*fakes)
    for node in gm.graph.nodes:
        if node.op != "output":
            example_value_from_val(node)


def _fresh_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm``'s graph without the outer trace's fake values (another fake mode's): the inner compiler makes its own.
    The caller recompiles the copy after its last edit."""
    copy = copy_graph_module(gm)
    for node in copy.graph.nodes:
        drop_fake_values(node)
    _mark_own_functions_cacheable(copy.graph)
    return copy


def _mark_own_functions_cacheable(graph: fx.Graph) -> None:
    """Let AOTAutograd's cache take the graph's calls of dualkv's own layout functions (``layout.packed_ops``).

    Its cache takes calls of torch functions and ops only: a call of a Python function bypasses it (and every
    warm start then traces AOTAutograd again), unless the node, marked as ``torch.fx.wrap`` marks one, carries
    a ``user_cache_hash``. Dynamo's trace inlined these functions into torch ops; here they stay calls, so an
    edited function must not hit an entry of the old one. torch 2.13 adds the mark's hash to the cache key;
    torch 2.11 only checks that it is there, and keys the graph by its code, which names the function. So the
    node calls a copy of the function named with the hash of its source: the code, and the key, change with it.
    """
    for node in graph.nodes:
        fn = node.target
        if node.op == "call_function" and isinstance(fn, types.FunctionType) and (fn.__module__ or "").startswith("dualkv_compile."):
            digest = _source_hash(fn)
            node.target = _named_by_hash(fn, digest)
            mark_cacheable(node, digest)


@functools.lru_cache(maxsize=None)
def _source_hash(fn) -> str:
    try:
        source = inspect.getsource(fn).encode()
    except (OSError, TypeError):  # no source file (a frozen install): its bytecode, constants and names
        source = marshal.dumps(fn.__code__)
    return hashlib.sha256(f"{fn.__module__}.{fn.__qualname__}\n".encode() + source).hexdigest()


@functools.lru_cache(maxsize=None)
def _named_by_hash(fn, digest: str):
    """``fn`` under the name ``<name>_<digest[:16]>`` (same code, globals, defaults and closure)."""
    name = f"{fn.__name__}_{digest[:16]}"
    copy = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__qualname__, copy.__module__, copy.__kwdefaults__ = name, fn.__module__, fn.__kwdefaults__
    # The cache key pickles the function by reference (module and name): the copy must be found there.
    setattr(sys.modules[fn.__module__], name, copy)
    return copy
