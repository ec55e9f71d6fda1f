"""The "dualkv" torch.compile backend: the pipeline from a Dynamo graph to its runner.

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

Per call the runner (``runtime.runners``) detects the layout from the token inputs (one host
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

import logging
import math
from typing import Optional

import torch
import torch.fx as fx

from .config import DualKVConfig
from .passes.functionalize import functionalize_mutations, mutation_refusal
from .passes.fuse_linear_log_prob import fuse_linear_log_prob
from .passes.inline_checkpoint import inline_checkpoint_regions
from .passes.pack_graph import pack_graph
from .passes.token_axes import Kind, Refusal, TokenAxes, analyze_token_axes
from .passes.token_inputs import complete_token_inputs, find_token_inputs, token_major_inputs
from .report import GraphReport, new_report, reports
from .runtime.nested_compile import LazyCompile
from .runtime.runners import CarriedRunner, PackedRunner, floating_carried

log = logging.getLogger("dualkv_compile")

# Kinds of value the packed graph computes on the packed stream (an in-place op on one would change one form only).
_PACKED_KINDS = (Kind.TOKEN, Kind.COLUMN, Kind.BCAST)

# A private name a test still imports from here (issue 17 moves it to a public home).
_token_major_inputs = token_major_inputs

__all__ = ["DualKVConfig", "dualkv_backend", "GraphReport", "reports"]


def dualkv_backend(gm: fx.GraphModule, example_inputs, *, mode: Optional[str] = None, options: Optional[dict] = None):
    """The torch.compile backend (registered as "dualkv")."""
    cfg = DualKVConfig.from_options(options)
    fallback = LazyCompile(gm, example_inputs, cfg, mode)
    report = new_report(len(gm.graph.nodes))
    token_inputs: dict = {}
    try:
        # Checkpoint regions inlined, tagged for recomputation, on a copy (the fallback runs the original).
        gm = inline_checkpoint_regions(gm)
        # In-place ops on private values made out-of-place (on a copy); the others are checked after the analysis.
        gm, mutations = functionalize_mutations(gm)
        token_inputs = find_token_inputs(gm.graph)
        token_inputs, batch_shape = complete_token_inputs(gm, example_inputs, token_inputs)
        axes = analyze_token_axes(gm, token_inputs, batch_shape)
        report.num_attention = len(axes.attention)
        why = mutation_refusal(mutations, lambda n: n in axes.info and axes.info[n].kind in _PACKED_KINDS)
        if why is not None:
            raise Refusal(why)
        if not axes.attention and not floating_carried(axes):
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


def register() -> None:
    """Register "dualkv" with Dynamo (the entry point does this for installed packages)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "dualkv" not in _BACKENDS:
        register_backend(name="dualkv")(dualkv_backend)
