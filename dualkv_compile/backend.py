"""The "dualkv" torch.compile backend and its runtime wrapper.

``torch.compile(model, backend="dualkv")`` hands each Dynamo graph to
``dualkv_backend``, which

1. compiles the graph unchanged with the inner compiler (the fallback);
2. analyses its token axes and attention (``passes.token_axes``); a graph
   that cannot be rewritten is refused, with the reason logged on the
   "dualkv_compile" logger and kept for ``explain()``;
3. builds the packed graph (``passes.pack_graph``), compiled lazily on the
   first rewritten call with the inner compiler and dynamic token counts, so
   new layouts (P, N, R_i, group count) do not recompile it; a loss's
   lm_head -> log_softmax -> next-token gather in it becomes one chunked op
   (``passes.fuse_linear_log_prob``, option ``chunked_log_probs``).

Per call the wrapper detects the layout from the token inputs (one host
sync), runs the fallback when nothing is shared or rho is below
``min_rho``, and otherwise runs the packed graph and returns outputs in the
caller's layout, equal at every non-padding position and zero at padding.
On the first rewritten call (``verify=True``) it evaluates the attention
masks the original graph builds and compares them with the causal,
padding-aware pattern the layout implies; a mismatch (sliding window,
bidirectional, bias) disables the rewrite for that graph.

A graph without token ids (a model split by graph breaks: FSDP2 per-layer
hooks, a separately compiled layer) is rewritten with its ``[B, S, ...]``
inputs (hidden states, positions) as the token-major values and its 4-D
mask input checked, then dropped (``CarriedRunner``). Per call it uses the
layout current in the thread (``active_layout``: published by the graph
that last detected one) if it holds for the call's inputs, else detects one
from them (attention graphs), else runs unpacked; ``GraphReport.layout_source``
says which. A graph with no attention but such inputs (final norm, lm_head,
loss) packs on a carried layout the same way.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import numbers
import types
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from . import active_layout
from .layout import SharedPromptLayout, detect, previous_token_index
from .passes.inline_checkpoint import inline_checkpoint_regions
from .passes.pack_graph import PACKED_INPUTS, pack_graph
from .passes.attention_match import find_attention, item_of_placeholder
from .passes.fuse_linear_log_prob import fuse_linear_log_prob
from .passes.functionalize import functionalize_mutations, mutation_refusal
from .passes.padding_reads import find_padding_reads, tainted
from .passes.token_axes import Kind, Refusal, TokenAxes, analyze_token_axes, find_token_inputs
from .passes.token_axes import hint as _size

log = logging.getLogger("dualkv_compile")

# Kinds of value the packed graph computes on the packed stream (an in-place op on one would change one form only).
_PACKED_KINDS = (Kind.TOKEN, Kind.COLUMN, Kind.BCAST)

__all__ = ["DualKVConfig", "dualkv_backend", "GraphReport", "reports"]


@dataclasses.dataclass
class DualKVConfig:
    """Options, given as ``torch.compile(..., backend="dualkv", options={...})``.

    min_rho           rewrite a call only if its token reduction is at least this
    group_size        rows per group, if the caller knows it (verified, not searched)
    min_shared        shortest shared prefix (tokens) that makes rows a group
    inner             "inductor" or "aot_eager": compiles both the fallback and the packed graph
    verify            check the graph's attention masks against the layout on the first rewritten call
    attention_backend "auto", "reference", "cpu_flash", "flex" or "triton" (see kernels.op); one that
                      cannot run a graph's attention (device, dtype, head dim) refuses the graph
    verify_max_elements  skip the mask check when a mask would hold more elements than this
    chunked_log_probs    fuse a loss's lm_head -> log_softmax -> next-token gather into
                         ``dualkv::linear_log_prob`` (passes.fuse_linear_log_prob): logits and
                         log-probs exist a chunk of tokens at a time and none are kept for the
                         backward, which recomputes them (one extra lm_head matmul); False keeps
                         the unfused graph
    log_prob_chunk_bytes that op's chunk: as many tokens as one [C, V] float32 buffer (float64 for a
                         float64 model) holds in this many bytes, at least one; its working set is a
                         few such buffers
    """

    min_rho: float = 1.1
    group_size: Optional[int] = None
    min_shared: int = 1
    inner: str = "inductor"
    verify: bool = True
    attention_backend: str = "auto"
    verify_max_elements: int = 1 << 26
    chunked_log_probs: bool = True
    log_prob_chunk_bytes: int = 1 << 30

    @classmethod
    def from_options(cls, options: Optional[dict]) -> "DualKVConfig":
        options = dict(options or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"options: unknown dualkv option(s) {unknown}; expected some of {sorted(names)}")
        cfg = cls(**options)

        def bad(name: str, expected: str):
            return ValueError(f"options[{name!r}] must be {expected}, got {getattr(cfg, name)!r}")

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        # rho is valid tokens per packed token, never below 1: a min_rho below 1 means nothing.
        rho = cfg.min_rho
        if not isinstance(rho, numbers.Real) or isinstance(rho, bool) or not rho >= 1.0:
            raise bad("min_rho", "a number >= 1.0 (rho, the token reduction, is always >= 1)")
        if cfg.group_size is not None and not (is_int(cfg.group_size) and cfg.group_size >= 1):
            raise bad("group_size", "None or a positive int")
        if not (is_int(cfg.min_shared) and cfg.min_shared >= 1):
            raise bad("min_shared", "an int >= 1")
        if not isinstance(cfg.inner, str) or cfg.inner not in ("inductor", "aot_eager", "eager"):
            raise bad("inner", "'inductor', 'aot_eager' or 'eager'")
        for name in ("verify", "chunked_log_probs"):
            if not isinstance(getattr(cfg, name), bool):
                raise bad(name, "a bool")
        from .kernels.op import BACKENDS

        if not isinstance(cfg.attention_backend, str) or cfg.attention_backend not in BACKENDS:
            raise bad("attention_backend", f"one of {', '.join(map(repr, BACKENDS))}")
        if not (is_int(cfg.verify_max_elements) and cfg.verify_max_elements >= 0):
            raise bad("verify_max_elements", "a non-negative int")
        if not (is_int(cfg.log_prob_chunk_bytes) and cfg.log_prob_chunk_bytes > 0):
            raise bad("log_prob_chunk_bytes", "a positive int")
        return cfg


@dataclasses.dataclass
class GraphReport:
    """What happened to one Dynamo graph; ``explain()`` prints these."""

    graph_id: int
    num_nodes: int
    num_attention: int
    rewritten: bool
    reason: Optional[str] = None
    calls: int = 0
    packed_calls: int = 0
    packed_compiles: int = 0
    last_layout: Optional[str] = None
    last_stats: Any = None
    fallback_reasons: list[str] = dataclasses.field(default_factory=list)
    layout_source: Optional[str] = None  # the last packed call's: "detected from ..." or "carried from graph k ..."
    not_carried: list[str] = dataclasses.field(default_factory=list)  # why a current layout was not used
    fused_log_probs: int = 0  # next-token log-prob gathers fused with the lm_head (chunked_log_probs)

    def __str__(self) -> str:
        head = f"graph {self.graph_id}: {self.num_nodes} nodes, {self.num_attention} attention"
        if not self.rewritten:
            if self.reason is None:  # an error other than a refusal escaped the backend on this graph
                return f"{head} - not rewritten: the dualkv backend raised an error on it (torch.compile reported it)"
            return f"{head} - REFUSED: {self.reason}"
        lines = [f"{head} - rewritten; {self.calls} calls, {self.packed_calls} packed, packed graph compiled {self.packed_compiles}x"]
        if self.fused_log_probs:
            lines.append(f"  next-token log-probs computed from the lm_head in chunks ({self.fused_log_probs} fused)")
        if self.last_stats is not None:
            source = f", {self.layout_source}" if self.layout_source else ""
            lines.append(f"  last layout: {self.last_layout}{source}")
            lines.append(f"  {self.last_stats}")
        for r in self.fallback_reasons[-3:]:
            lines.append(f"  ran unpacked: {r}")
        for r in self.not_carried[-3:]:
            lines.append(f"  layout not carried: {r}")
        return "\n".join(lines)


_reports: list[GraphReport] = []
_graph_ids = itertools.count()
_nested_ids = itertools.count()


def reports() -> list[GraphReport]:
    """Reports of every graph the backend has seen in this process (most recent last)."""
    return list(_reports)


def _inner_compile(gm: fx.GraphModule, example_inputs, cfg: DualKVConfig, mode: Optional[str]):
    if cfg.inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        config_patches = _mode_patches(mode)
        return compile_fx(gm, example_inputs, config_patches=config_patches)
    if cfg.inner == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    return gm.forward


def _is_dynamic(gm: fx.GraphModule) -> bool:
    for n in gm.graph.find_nodes(op="placeholder"):
        ev = n.meta.get("example_value")
        if isinstance(ev, torch.SymInt) or (isinstance(ev, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in ev.shape)):
            return True
    return False


def _reads_lifted_scalars(gm: fx.GraphModule) -> bool:
    """True if the graph reads an input as a Python scalar (``placeholder.item()``: Dynamo's lifted module floats)."""
    return any(item_of_placeholder(n) is not None for n in gm.graph.find_nodes(op="call_method", target="item"))


class _LazyCompile:
    """The original graph, compiled by the inner compiler on its first call.

    A rewritten graph may never need its fallback; compiling it up front
    doubled the first step's compile time. A static-shape graph compiles for
    its example inputs; a dynamic-shape one goes through a nested
    ``torch.compile(dynamic=True)`` (compiled directly outside Dynamo's
    tracing context it would be specialised to its first inputs), the same
    route the packed graph takes.
    """

    def __init__(self, gm, example_inputs, cfg: DualKVConfig, mode: Optional[str]):
        self.args = (gm, example_inputs, cfg, mode)
        self.compiled: Optional[Callable] = None

    def __call__(self, *args):
        if self.compiled is None:
            gm, example_inputs, cfg, mode = self.args
            # A graph Dynamo traced with dynamic=True but specialised on sizes 0/1 everywhere (a [1, 1]
            # batch) has static shapes yet still reads module floats as `placeholder.item()`: compiled
            # from its example inputs outside Dynamo's tracing context, that .item() is data-dependent
            # (DataDependentOutputException). The nested route captures it like the outer trace did.
            if _is_dynamic(gm) or _reads_lifted_scalars(gm):
                self.compiled = _nested_compile(gm, cfg, mode, dynamic=True)
            else:
                self.compiled = _inner_compile(gm, example_inputs, cfg, mode)
            self.args = None
        return self.compiled(*args)


_SYM_BUILTINS = {torch.sym_sum: sum, torch.sym_max: max, torch.sym_min: min, torch.sym_int: int, torch.sym_float: float}


def _nested_compile(gm: fx.GraphModule, cfg: DualKVConfig, mode: Optional[str], dynamic, on_compile=None):
    """``torch.compile`` of a plain function calling ``gm``, with the inner compiler as its backend.

    A plain function, not the GraphModule itself: nested inside the outer
    compiled frame, compiling the GraphModule object only caught the helper
    functions it calls, while a function around it is traced as one graph.
    """

    def inner_backend(g, example_inputs):
        if on_compile is not None:
            on_compile()
        return _inner_compile(g, example_inputs, cfg, mode)

    # Dynamo's own graphs are _LazyGraphModules, whose lazy forward Dynamo
    # will not trace; a plain GraphModule over the same graph it will.
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    module = fx.GraphModule(gm, graph)
    # Size arithmetic in dynamic-shape graphs (torch.sym_sum([1, s0]) ...)
    # cannot be re-traced by Dynamo; the Python builtins can, on SymInts too.
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target in _SYM_BUILTINS:
            node.target = _SYM_BUILTINS[node.target]
    module.recompile()

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


def _mode_patches(mode: Optional[str]) -> dict:
    if mode in (None, "default"):
        return {}
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def dualkv_backend(gm: fx.GraphModule, example_inputs, *, mode: Optional[str] = None, options: Optional[dict] = None):
    """The torch.compile backend (registered as "dualkv")."""
    cfg = DualKVConfig.from_options(options)
    fallback = _LazyCompile(gm, example_inputs, cfg, mode)
    report = GraphReport(next(_graph_ids), len(gm.graph.nodes), 0, rewritten=False)
    _reports.append(report)
    token_inputs: dict = {}
    try:
        # Checkpoint regions inlined, tagged for recomputation, on a copy (the fallback runs the original).
        gm = inline_checkpoint_regions(gm)
        # In-place ops on private values made out-of-place (on a copy); the others are checked after the analysis.
        gm, mutations = functionalize_mutations(gm)
        token_inputs = find_token_inputs(gm.graph)
        batch_shape = None
        if "input_ids" in token_inputs:
            ids_shape = token_inputs["input_ids"].meta["example_value"].shape
            if tuple(ids_shape[:2]) == (1, 1) and not any(isinstance(d, torch.SymInt) for d in ids_shape[:2]):
                # Dynamo specialises sizes of 1, so this graph only ever sees a single token: nothing
                # to share or to pack (and the analysis cannot tell its size-1 token axes from broadcasts).
                raise Refusal("a [1, 1] batch (one row of one token): nothing to share, so nothing to pack")
            B, S = (_size(d) for d in ids_shape[:2])
            token_inputs.update(_token_major_inputs(gm, example_inputs, token_inputs, B, S, floating_3d_only=True))
        else:
            # A part of a model after a graph break: its layout is carried from an earlier graph or detected from its inputs.
            batch_shape = _carried_batch_shape(gm)
            token_inputs = _token_major_inputs(gm, example_inputs, {}, *batch_shape)
        axes = analyze_token_axes(gm, token_inputs, batch_shape)
        report.num_attention = len(axes.attention)
        why = mutation_refusal(mutations, lambda n: n in axes.info and axes.info[n].kind in _PACKED_KINDS)
        if why is not None:
            raise Refusal(why)
        if not axes.attention and not _floating_carried(axes):
            if batch_shape is not None:
                raise Refusal(
                    f"no attention, no input_ids and no floating-point input laid out [B, S, ...] = {list(batch_shape)} "
                    "(the batch of the layout current when it was compiled): nothing to pack"
                )
            raise Refusal("no attention in this graph (nothing couples tokens, so packing saves only per-token work once the layout is known; a graph break may split the model)")
        scalar_checks = _resolve_scalar_inputs(gm, axes, example_inputs)
        if axes.refusals:
            raise Refusal("; ".join(axes.refusals))
        backend = _resolve_attention_backend(cfg.attention_backend, axes)
        packed = pack_graph(gm, axes, backend)
        if cfg.chunked_log_probs:
            fused = fuse_linear_log_prob(packed, cfg.log_prob_chunk_bytes, example_inputs)
            report.fused_log_probs = fused.count
            scalar_checks += fused.scalar_checks
    except Refusal as e:
        report.reason = str(e)
        if "input_ids" not in token_inputs:
            # Under DDP/FSDP2 the usual cause is their graph splitting: say which, and the fix.
            from .distributed import graph_split_hint

            hint = graph_split_hint(gm)
            if hint:
                report.reason = f"{report.reason}; {hint}"
        log.warning("dualkv: graph %d refused, running it unchanged: %s", report.graph_id, report.reason)
        return fallback
    report.rewritten = True
    log.info(
        "dualkv: graph %d rewritten (%d attention, %d next-token log-probs fused with the lm_head)",
        report.graph_id, len(axes.attention), report.fused_log_probs,
    )
    runner = PackedRunner if "input_ids" in axes.token_inputs else CarriedRunner
    return runner(gm, axes, packed, fallback, cfg, mode, report, scalar_checks)


def _is_parameter(node: fx.Node, example) -> bool:
    name = node.name.lower()
    return isinstance(example, torch.nn.Parameter) or "_parameters_" in name or "_buffers_" in name


def _token_major_inputs(gm, example_inputs, known: dict, B: int, S: int, floating_3d_only: bool = False) -> dict[str, fx.Node]:
    """Placeholders laid out ``[B, S, ...]`` (role ``"carried:<name>"``) or ``[1, S, ...]`` (``"column:<name>"``).

    Hidden states, position embeddings and position ids a graph receives
    from the graph before it. Parameters and buffers are not token-major; a
    4-D mask ``[B, 1, S, S]`` is not either (it is checked, then dropped).
    With token ids in the graph only floating-point inputs of rank 3 or more
    are added (hidden states, logits): ``[B, S]`` loss inputs stay as they were.
    """
    found: dict[str, fx.Node] = {}
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    taken = set(known.values())
    for i, node in enumerate(placeholders):
        ev = node.meta.get("example_value")
        example = example_inputs[i] if i < len(example_inputs) else None
        if node in taken or not isinstance(ev, torch.Tensor) or ev.dim() < 2 or _is_parameter(node, example):
            continue
        if floating_3d_only and not (ev.dtype.is_floating_point and ev.dim() >= 3):
            continue
        lead = (_size(ev.shape[0]), _size(ev.shape[1]))
        if lead == (B, S):
            found[f"carried:{node.name}"] = node
        elif lead == (1, S) and B > 1 and not floating_3d_only:
            found[f"column:{node.name}"] = node
    return found


def _carried_batch_shape(gm) -> tuple[int, int]:
    """``(B, S)`` of a graph without token ids: its attention's query, else the layout current while it is compiled."""
    for m in find_attention(gm.graph):
        q = m.q.meta.get("example_value")
        if isinstance(q, torch.Tensor) and q.dim() == 4:
            return _size(q.shape[0]), _size(q.shape[2])
    active = active_layout.current()
    if active is None:
        raise Refusal(
            "no input_ids among this graph's inputs and no attention to find its batch by, and no layout was current "
            "when it was compiled (a graph break may have split the model, leaving this part without them)"
        )
    return active.layout.batch_size, active.layout.seq_len


def _floating_carried(axes: TokenAxes) -> list[fx.Node]:
    """Carried ``[B, S, ...]`` floating-point inputs: the values packing saves work on in a graph without attention."""
    return [
        n for role, n in axes.token_inputs.items()
        if role.startswith("carried:") and axes.info[n].kind is Kind.TOKEN and n.meta["example_value"].dtype.is_floating_point
    ]


def _resolve_scalar_inputs(gm, axes: TokenAxes, example_inputs) -> list[tuple[int, float, str]]:
    """Attention ``dropout_p``/``scale`` read from graph inputs: resolve them from the example inputs.

    The packed graph bakes them in; the runner checks them on every call
    (they are module attributes, so they change only if the user changes
    them, and then that call runs unpacked). A dropout that is not zero is a
    refusal, like a constant one.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    checks = []
    for m in axes.attention:
        for what, src in m.scalar_inputs.items():
            index = placeholders.index(src)
            value = float(example_inputs[index])
            checks.append((index, value, f"{m.output.name}.{what}"))
            # Eager attention's scale may also carry constant factors (m.scale); SDPA's is None here.
            if what == "scale":
                m.scale = value * (m.scale if m.scale is not None else 1.0)
            elif what == "scale_divisor":
                if value == 0 or not math.isfinite(value):
                    if not m.refusal:
                        m.refusal = f"{m.output.name}: attention scores divided by {value}"
                        axes.refusals.append(m.refusal)
                else:
                    m.scale = (m.scale if m.scale is not None else 1.0) / value
            elif value != 0 and not m.refusal:
                m.refusal = f"{m.output.name}: attention dropout_p={value} couples the copies of a shared prompt (dropout in training mode)"
                axes.refusals.append(m.refusal)
    return checks


def _resolve_attention_backend(backend: str, axes: TokenAxes) -> str:
    from .kernels.op import resolve_backend, unsupported_reason

    if not axes.attention:
        return backend  # unused: a graph without attention (the lm_head after a graph break)
    q = axes.attention[0].q.meta["example_value"]
    probe = torch.empty((1, q.shape[1], 1, q.shape[3]), dtype=q.dtype, device=q.device)
    why = unsupported_reason(backend, probe)
    if why is not None:
        # A Refusal, not a ValueError: the graph runs unchanged and its report (explain()) says why.
        # (An exception of another kind escaped the backend and left the report reading "REFUSED: None".)
        raise Refusal(f"attention_backend={backend!r} cannot run this graph's attention: {why}")
    return resolve_backend(backend, probe)


class PackedRunner:
    """Runtime wrapper: detect, decide, pack, run, unpack (see the module docstring)."""

    def __init__(self, gm, axes: TokenAxes, packed: fx.GraphModule, fallback, cfg: DualKVConfig, mode, report: GraphReport, scalar_checks=()):
        self.axes, self.packed_gm, self.fallback, self.cfg, self.mode, self.report = axes, packed, fallback, cfg, mode, report
        self.scalar_checks = list(scalar_checks)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.input_index = {role: placeholders.index(node) for role, node in axes.token_inputs.items()}
        self.outer_dynamic = _is_dynamic(gm)
        # Token-major inputs carried from an earlier graph (hidden states, logits): checked for sharing per call.
        self.carried = [(role.split(":", 1)[1], i) for role, i in self.input_index.items() if role.startswith("carried:")]
        self.active: Optional[active_layout.ActiveLayout] = None
        self.source: Optional[str] = None
        self.compiled: Optional[Callable] = None
        self.verified = not cfg.verify
        self.disabled: Optional[str] = None
        self.mask_gm = _mask_graph(gm, axes) if cfg.verify else None
        self.unpacked_outputs = _unpacked_output_positions(packed)
        # Where the program reads a position packing zeroes, and the input-only factors that may mask it.
        self.padding_reads = find_padding_reads(packed, len(PACKED_INPUTS), gm)
        factors = list(dict.fromkeys(node for r in self.padding_reads for node, _, _ in r.factors))
        self.factor_gms = [
            f for f in (
                _factor_graph(packed, [n for n in factors if n.graph is packed.graph], len(PACKED_INPUTS)),
                _factor_graph(gm, [n for n in factors if n.graph is gm.graph], 0),
            ) if f is not None
        ]

    def _compile_packed(self):
        def count():
            self.report.packed_compiles += 1

        # A dynamic outer graph (Dynamo's recompile after a shape changed) passes symbolic sizes, ints
        # included, that a dynamic=None compile would specialise to their first values: all dynamic
        # then (parameters stay static: force_parameter_static_shapes). A static one: only the
        # packed layout's per-token and per-segment sizes, marked per call.
        dynamic = True if self.outer_dynamic else None
        return _nested_compile(self.packed_gm, self.cfg, self.mode, dynamic=dynamic, on_compile=count)

    def __call__(self, *args):
        self.report.calls += 1
        if self.disabled:
            return self.fallback(*args)
        for index, value, what in self.scalar_checks:
            if float(args[index]) != value:
                return self._unpacked(args, f"{what} is {float(args[index])}, the packed graph was built for {value}")
        layout = self._layout(args)
        if isinstance(layout, str):
            return self._unpacked(args, layout)
        stats = layout.stats()
        self.report.last_layout, self.report.last_stats = repr(layout), stats
        if stats.rho < self.cfg.min_rho:
            return self._unpacked(args, f"rho {stats.rho:.2f} below min_rho {self.cfg.min_rho}")
        if not self.verified:
            why = self._verify(args, layout)
            if why is not None:
                return self._disable(args, f"disabled on its first call: {why}")
            self.verified = True
        why = self._padding_read(args, layout)
        if why is not None:
            return self._unpacked(args, why)
        if self.compiled is None:
            self.compiled = self._compile_packed()
        extra = _packed_inputs(layout)
        # T and the segment count change every step; B * S (unpack_index,
        # valid) follows the outer graph, static or symbolic as Dynamo made it.
        for name, t in zip(PACKED_INPUTS, extra):
            if name in _PER_TOKEN_OR_SEGMENT:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        if self.report.packed_calls == 0:
            # The first packed call traces and compiles the packed graph. If
            # that fails (an op the analysis let through but the packed shapes
            # break), run this graph unchanged from now on rather than fail
            # the step.
            try:
                out = self.compiled(*args, *extra)
            except Exception as e:  # noqa: BLE001 - reported, then the original program runs
                first_line = (str(e).splitlines() or [""])[0][:300]
                return self._disable(args, f"the packed graph failed on its first call: {type(e).__name__}: {first_line}")
        else:
            out = self.compiled(*args, *extra)
        self.report.packed_calls += 1
        self.report.layout_source = self.source
        # Later graphs of this forward may carry the layout to the tensors made here (active_layout.produced).
        self.active.record_outputs(out, self.unpacked_outputs)
        return out

    def _padding_read(self, args, layout: SharedPromptLayout) -> Optional[str]:
        """None, or why this call reads a position packing does not compute (DESIGN.md semantics 8).

        Packing zeroes padding positions, and next-token values whose previous
        column is padding (a row's first token: left padding, an empty
        prompt). Reading them is exact only where a factor zeroes them.
        """
        if not self.padding_reads:
            return None
        valid = layout.valid.view(layout.batch_size, layout.seq_len)
        factors = {}
        with torch.no_grad():
            for f in self.factor_gms:
                factors.update(zip(f.factor_nodes, f(*args)))
        flags = torch.stack([tainted(read, valid, factors) for read in self.padding_reads])
        if not bool(flags.any()):  # one host sync for all reads
            return None
        read = self.padding_reads[int(flags.nonzero()[0, 0])]
        return (
            f"{read.reader.name} reads a position packing does not compute (padding, or the column before a "
            "row's first token, e.g. an empty prompt) where no mask zeroes it; the original program runs"
        )

    def _layout(self, args):
        """This call's layout, detected from its token ids and made current; or why it runs unpacked."""
        ids = args[self.input_index["input_ids"]]
        mask = args[self.input_index["attention_mask"]] if "attention_mask" in self.input_index else None
        pos = args[self.input_index["position_ids"]] if "position_ids" in self.input_index else None
        try:
            layout = detect(ids, mask, pos, group_size=self.cfg.group_size, min_shared=self.cfg.min_shared)
        except ValueError as e:
            active_layout.clear()
            return f"layout: {e}"
        self.active = active_layout.publish(layout, self.report.graph_id, "input_ids")
        self.source = "detected from input_ids"
        return self._share_check(args, self.active) or layout

    def _share_check(self, args, active: active_layout.ActiveLayout) -> Optional[str]:
        """None if every carried input's dropped copies equal the kept ones bitwise, else why not."""
        if not self.carried:
            return None
        bad = active.share_mismatch([args[i] for _, i in self.carried])
        if bad is None:
            return None
        return (
            f"input {self.carried[bad][0]}: the copies of a shared token differ across the rows of a group (bitwise), "
            "so packing would not be exact"
        )

    def _disable(self, args, why: str):
        """Run this graph unchanged from now on (and this call too); the report says why."""
        self.disabled = why
        self.report.rewritten = False
        self.report.reason = why
        log.warning("dualkv: graph %d runs unchanged from now on: %s", self.report.graph_id, why)
        return self.fallback(*args)

    def _unpacked(self, args, why: str):
        self.report.fallback_reasons.append(why)
        log.info("dualkv: graph %d runs unpacked: %s", self.report.graph_id, why)
        return self.fallback(*args)

    def _verify(self, args, layout: SharedPromptLayout) -> Optional[str]:
        """None if every attention mask of the graph is the causal, padding-aware mask of the layout."""
        B, S = layout.batch_size, layout.seq_len
        valid = layout.valid.view(B, S)
        starts_nonzero = any(s > 0 for g in layout.groups for s in g.starts)
        for m in self.axes.attention:
            if m.mask is None and m.is_causal and starts_nonzero:
                return f"{m.output.name}: causal attention without a mask attends to left padding, which packing removes"
        if self.mask_gm is None:
            return None
        if B * S * S > self.cfg.verify_max_elements:
            log.info("dualkv: mask check skipped for graph %d (B*S*S = %d elements)", self.report.graph_id, B * S * S)
            return None
        with torch.no_grad():
            masks = self.mask_gm(*args)
        q = torch.arange(S, device=valid.device)
        expect = valid[:, None, :] & (q[None, None, :] <= q[None, :, None])  # [B, Sq, Skv]
        for name, m in zip(self.mask_names, masks):
            allowed = _allowed(m)
            if allowed is None:
                return f"{name}: the attention mask carries values other than 0 and -inf/min (a bias); not a pure mask"
            rows = valid[:, None, :, None]  # only valid queries' rows are specified
            if bool(((allowed ^ expect[:, None]) & rows).any()):
                return f"{name}: the attention mask is not causal with key padding (sliding window, bidirectional or custom mask)"
        return None

    @property
    def mask_names(self):
        return [m.output.name for m in self.axes.attention if m.mask is not None]


class CarriedRunner(PackedRunner):
    """Runtime wrapper of a graph without token ids (a part of a model after a graph break).

    Per call: the current layout (``active_layout``) if it is for this
    ``(B, S)`` and passes the checks (masks among the inputs match it, else
    an input was produced under it; the shared copies of every token-major
    input are bitwise equal), else, for a graph with attention, a layout
    detected from this call's own inputs (rows agree where their hidden
    states and positions agree bitwise; padding from the mask's diagonal),
    which becomes the current one. Otherwise the call runs unpacked.
    """

    def __init__(self, gm, axes: TokenAxes, *rest, **kw):
        super().__init__(gm, axes, *rest, **kw)
        # Masks are checked per call against the layout used, not once: one
        # graph may serve every decoder layer, each with its own mask.
        self.verified = True
        self.mask_gm = _mask_graph(gm, axes)
        self.mask_key: list[int] = []
        if self.mask_gm is not None:
            self.mask_key = [i for i, p in enumerate(self.mask_gm.graph.find_nodes(op="placeholder")) if p.users]
        self.size_index = self.carried[0][1]
        floating = set(_floating_carried(axes))
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        self.floating_index = [placeholders.index(n) for n in floating]
        self.causal_unmasked = any(m.mask is None and m.is_causal for m in axes.attention)

    def _layout(self, args):
        ref = args[self.size_index]
        B, S = int(ref.shape[0]), int(ref.shape[1])
        cur = active_layout.current()
        if cur is None:
            why = "no layout is current (no earlier graph of this forward established one)"
        elif not cur.matches(B, S, ref.device):
            L = cur.layout
            why = f"the current layout, from {cur.describe()}, is for [{L.batch_size}, {L.seq_len}] on {L.device}, this call is [{B}, {S}] on {ref.device}"
        else:
            why = self._check_carried(cur, args)
            if why is None:
                self.active, self.source = cur, f"carried from {cur.describe()}"
                return cur.layout
            why = f"the layout of {cur.describe()} does not hold here: {why}"
            self.report.not_carried.append(why)
            log.info("dualkv: graph %d: %s", self.report.graph_id, why)
        if not self.axes.attention:
            return why
        detected = self._detect(args, B, S, ref.device)
        if isinstance(detected, str):
            return f"{why}; no layout detected from this graph's inputs either: {detected}"
        return detected

    def _check_carried(self, cur: active_layout.ActiveLayout, args) -> Optional[str]:
        if self.mask_gm is not None:
            keys = [args[i] for i in self.mask_key]
            if not cur.mask_checked(keys):
                with torch.no_grad():
                    masks = self.mask_gm(*args)
                why = _mask_mismatch(masks, self.mask_names, cur.layout)
                if why is not None:
                    return why
                cur.mark_mask_checked(keys)
        else:
            if not any(cur.produced(args[i]) for i in self.floating_index):
                return (
                    "no input of this call was produced by a graph that ran packed on it, and no mask among the "
                    "inputs ties its padding to this call"
                )
            if self.causal_unmasked and any(s > 0 for g in cur.layout.groups for s in g.starts):
                return "causal attention without a mask attends to left padding, which packing removes"
        return self._share_check(args, cur)

    def _detect(self, args, B: int, S: int, device) -> "SharedPromptLayout | str":
        masks = None
        if self.mask_gm is not None:
            with torch.no_grad():
                masks = self.mask_gm(*args)
            allowed = _pure_mask(self.mask_names[0], masks[0], B, S)
            if isinstance(allowed, str):
                return allowed
            # Padding positions are those that do not attend to themselves.
            valid = allowed[:, 0].diagonal(dim1=-2, dim2=-1).expand(B, S)
        else:
            valid = torch.ones(B, S, dtype=torch.bool, device=device)
        values = [args[i] for _, i in self.carried]
        try:
            layout = active_layout.detect_from_values(values, valid, group_size=self.cfg.group_size, min_shared=self.cfg.min_shared)
        except ValueError as e:
            return f"layout: {e}"
        if masks is not None:
            why = _mask_mismatch(masks, self.mask_names, layout)
            if why is not None:
                return why
        self.active = active_layout.publish(layout, self.report.graph_id, "inputs")
        if masks is not None:
            self.active.mark_mask_checked([args[i] for i in self.mask_key])
        self.source = "detected from its hidden states" + (" and mask" if masks is not None else "")
        return layout


def _unpacked_output_positions(packed: fx.GraphModule) -> tuple[int, ...]:
    """Positions, among the packed graph's tensor outputs in ``active_layout.leaves`` order, made by ``unpack``.

    Their shared copies are equal by construction. Empty when an output's
    kind (tensor or not) cannot be told, so nothing is taken for granted.
    """
    from .passes.packed_ops import unpack_merged, unpack_tokens

    out = next(iter(packed.graph.find_nodes(op="output")))
    positions, i = [], 0
    for leaf in active_layout.leaves(out.args[0]):
        if not isinstance(leaf, fx.Node):
            continue
        if leaf.op == "call_function" and leaf.target in (unpack_tokens, unpack_merged):
            positions.append(i)
        elif not isinstance(leaf.meta.get("example_value"), torch.Tensor):
            if "example_value" not in leaf.meta:
                return ()
            continue  # a SymInt or other non-tensor output: not counted by _tensors
        i += 1
    return tuple(positions)


def _mask_mismatch(masks, names, layout: SharedPromptLayout) -> Optional[str]:
    """None if every mask is the causal mask with ``layout``'s key padding, else why not.

    Rows of valid queries must match exactly, and no padding position may
    attend to itself: that pins the mask's padding to the layout's (a batch
    whose last token the layout calls padding fails). One sync per mask;
    temporaries of ``S * S`` elements per row of the batch.
    """
    B, S = layout.batch_size, layout.seq_len
    valid = layout.valid.view(B, S)
    q = torch.arange(S, device=valid.device)
    causal = q[None, :] <= q[:, None]  # [Sq, Skv]
    for name, m in zip(names, masks):
        allowed = _pure_mask(name, m, B, S)
        if isinstance(allowed, str):
            return allowed
        bad = torch.zeros((), dtype=torch.bool, device=valid.device)
        for b in range(B):
            a, v = allowed[min(b, allowed.shape[0] - 1)], valid[b]
            wrong = (a ^ (causal & v[None, :])) & v[:, None]
            bad |= wrong.any() | (a.diagonal(dim1=-2, dim2=-1) & ~v).any()
        if bool(bad):
            return (
                f"{name}: the attention mask is not the causal mask with this layout's key padding "
                "(sliding window, bidirectional or custom mask, or another batch's padding)"
            )
    return None


def _pure_mask(name: str, m: torch.Tensor, B: int, S: int) -> "torch.Tensor | str":
    """Attention mask ``m`` as booleans (True: may attend) of shape ``[1 or B, heads, S, S]``, else why it is not one."""
    allowed = _allowed(m)
    if allowed is None:
        return f"{name}: the attention mask carries values other than 0 and -inf/min (a bias); not a pure mask"
    if allowed.dim() != 4 or tuple(allowed.shape[-2:]) != (S, S) or allowed.shape[0] not in (1, B):
        return f"{name}: attention mask of shape {list(allowed.shape)}, expected [B, heads, S, S]"
    return allowed


def _allowed(m: torch.Tensor) -> Optional[torch.Tensor]:
    if m.dtype == torch.bool:
        return m
    neg = (m <= torch.finfo(m.dtype).min / 2) | torch.isneginf(m)
    if not bool(((m == 0) | neg).all()):
        return None
    return m == 0


def _graph_returning(source: fx.GraphModule, nodes: list, class_name: str, drop_trailing: int = 0) -> Optional[fx.GraphModule]:
    """A copy of ``source`` that returns ``nodes`` (a tuple), with what they do not need removed; None if no nodes.

    ``drop_trailing``: trailing placeholders (the packed graph's layout inputs) removed when unused, so the
    copy takes the call's own arguments.
    """
    if not nodes:
        return None
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    g.graph_copy(source.graph, env)
    g.output(tuple(env[n] for n in nodes))
    g.eliminate_dead_code()
    placeholders = list(g.find_nodes(op="placeholder"))
    for ph in placeholders[len(placeholders) - drop_trailing:]:
        if not ph.users:
            g.erase_node(ph)
    return fx.GraphModule(source, g, class_name=class_name)


def _mask_graph(gm: fx.GraphModule, axes: TokenAxes) -> Optional[fx.GraphModule]:
    """A copy of ``gm`` that returns the attention masks (as the original graph builds them)."""
    return _graph_returning(gm, [m.mask for m in axes.attention if m.mask is not None], "AttentionMasks")


def _factor_graph(source: fx.GraphModule, nodes: list, layout_inputs: int) -> Optional[fx.GraphModule]:
    """A copy of ``source`` returning ``nodes`` (the factors of padding reads) from the call's own inputs.

    ``layout_inputs``: trailing placeholders of ``source`` (the packed graph's layout inputs), which the
    factors do not read (``find_padding_reads`` checked).
    """
    gm = _graph_returning(source, nodes, "PaddingReadFactors", drop_trailing=layout_inputs)
    if gm is not None:
        gm.factor_nodes = nodes
    return gm


_PER_TOKEN_OR_SEGMENT = {"pack_index", "col_index", "prev_index", "seg_start", "seg_len", "prefix_start", "prefix_len"}


def _packed_inputs(layout: SharedPromptLayout) -> list:
    """The values of ``PACKED_INPUTS`` for ``layout``, in that order."""
    segs = layout.attention_segments
    return [
        layout.pack_index,
        layout.pack_index % layout.seq_len,
        layout.unpack_index,
        layout.valid,
        previous_token_index(segs, layout.num_tokens),
        segs.seg_start,
        segs.seg_len,
        segs.prefix_start,
        segs.prefix_len,
        segs.max_seg_len,
        segs.max_prefix_len,
    ]


def register() -> None:
    """Register "dualkv" with Dynamo (the entry point does this for installed packages)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "dualkv" not in _BACKENDS:
        register_backend(name="dualkv")(dualkv_backend)
