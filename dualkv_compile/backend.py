"""The "dualkv" torch.compile backend: the pipeline from a Dynamo graph to its runner.

``torch.compile(model, backend="dualkv")`` hands each Dynamo graph to ``dualkv_backend``, which runs, in order:

1. the fallback: the graph unchanged, compiled by the inner compiler (``runtime.nested_compile``), what every
   refused graph or call runs;
2. ``normalize``: ``inline_checkpoint``, ``positional_args``, ``causal_conv``, then ``functionalize`` (on copies);
3. ``analysis.analyze``: token inputs with their roles, attention, the token axes of every value, module scalars;
   a graph that cannot be rewritten is refused, the reason logged on the "dualkv_compile" logger and kept for
   ``explain()``;
4. ``rewrite.pack_graph``: the packed graph, its attention backend picked first (``plan.resolve_attention_backend``),
   then ``rewrite.fuse_linear_log_prob`` (a loss's lm_head -> log_softmax -> next-token gather as one chunked op,
   with an entropy of the same log-probs if the loss has one, option ``chunked_log_probs``; not the entropy under
   sequence parallelism), then ``rewrite.module_floats`` (the module floats it reads baked in as numbers, checked
   per call), then, with option ``sequence_parallel``, ``rewrite.sequence_parallel`` (the split over the group);
5. ``plan.plan_graph``: what the runner reads about the graph, finished once (padding reads, side graphs,
   outputs made by ``unpack``, the compile route): a ``GraphPlan``;
6. ``runtime.runner.Runner``: per call, the layout from its source (detected from ``input_ids``, or carried from
   an earlier graph of the forward after a graph break: ``runtime.layout_source``), then the packed graph
   (compiled lazily, dynamic token counts: new layouts do not recompile it) or the fallback when nothing is
   shared, rho is below ``min_rho``, or a check fails. Outputs come back in the caller's layout, equal at every
   non-padding position and zero at padding.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.fx as fx

from .analysis.analyze import analyze
from .analysis.node_info import Kind
from .analysis.token_inputs import Role, find_token_inputs
from .config import DualKVConfig
from .layout import carried
from .report import GraphReport, new_report, reports
from .normalize.functionalize import functionalize_mutations, mutation_refusal
from .graph import Refusal
from .graph.meta import ev
from .normalize.inline_checkpoint import inline_checkpoint_regions
from .normalize.positional_args import positional_args
from .normalize.causal_conv import fuse_causal_conv1d
from .plan import plan_graph, resolve_attention_backend
from .rewrite.fuse_linear_log_prob import fuse_linear_log_prob
from .rewrite.module_floats import bake_module_floats
from .rewrite.pack_graph import pack_graph
from .rewrite.sequence_parallel import shard_packed_graph
from .runtime.nested_compile import LazyCompile
from .runtime.runner import Runner

log = logging.getLogger("dualkv_compile")

# Kinds of value the packed graph computes on the packed stream (an in-place op on one would change one form only).
_PACKED_KINDS = (Kind.TOKEN, Kind.COLUMN, Kind.BCAST)

__all__ = ["DualKVConfig", "dualkv_backend", "GraphReport", "reports"]


def dualkv_backend(gm: fx.GraphModule, example_inputs, *, mode: Optional[str] = None, options: Optional[dict] = None):
    """The torch.compile backend (registered as "dualkv")."""
    cfg = DualKVConfig.from_options(options)
    fallback = LazyCompile(gm, example_inputs, cfg, mode)
    report = new_report(len(gm.graph.nodes))
    try:
        # Checkpoint regions inlined, tagged for recomputation, on a copy (the fallback runs the original).
        gm = inline_checkpoint_regions(gm)
        # Operands passed by keyword (F.linear(input=x, weight=w)) made positional, as the rules read them.
        gm = positional_args(gm)
        # Hybrid layers' conv1d(x, w, b, padding=K-1)[..., :T] as one causal convolution (the token axis kept).
        gm = fuse_causal_conv1d(gm)
        # In-place ops on private values made out-of-place (on a copy); the others are checked after the analysis.
        gm, mutations = functionalize_mutations(gm)
        result = analyze(gm, example_inputs, carried.current())
        axes = result.axes
        report.num_attention = len(axes.attention)
        why = mutation_refusal(mutations, lambda n: n in axes.info and axes.info[n].kind in _PACKED_KINDS)
        if why is not None:
            raise Refusal(why)
        if result.refusal is not None:
            raise Refusal(result.refusal)
        recurrent = result.recurrent
        if recurrent and cfg.sequence_parallel is not None:
            raise Refusal(f"{recurrent[0][0].name}: a {recurrent[0][1]} under sequence parallelism (a rank's tokens "
                          "would need the state of the tokens before them on other ranks): not supported yet")
        report.recurrent_layers = [(kind, why) for _, kind, why in recurrent]
        backend = resolve_attention_backend(cfg.attention_backend, axes.attention)
        packed = pack_graph(gm, axes, backend, cfg.attention_backend)
        report.attention_backends = list(packed.attention_backends)
        scalar_checks = result.scalar_checks
        if cfg.chunked_log_probs:
            # The entropy op's output covers every hidden row it reads, which under sequence parallelism is the
            # gathered stream, not this rank's tokens: there the entropy stays unfused (the log-probs still fuse).
            fused = fuse_linear_log_prob(packed, cfg.log_prob_chunk_bytes, example_inputs, entropy=cfg.sequence_parallel is None)
            report.fused_log_probs, report.fused_entropy = fused.count, fused.entropy
            scalar_checks += tuple(fused.scalar_checks)
        # Module floats, baked in: traced again, the packed graph would otherwise restart Dynamo's analysis after
        # AOTAutograd's whole trace, or compute them as C++ code on the CPU whose cached load probes the host's
        # instruction sets, on every cold and warm start (rewrite.module_floats).
        scalar_checks += tuple(bake_module_floats(packed, example_inputs))
        # Under sequence parallelism the runner runs the packed graph split over the group.
        runs = packed if cfg.sequence_parallel is None else shard_packed_graph(packed, cfg.sequence_parallel)
    except Refusal as e:
        report.reason = str(e)
        if Role.INPUT_IDS not in find_token_inputs(gm.graph):
            # Under DDP/FSDP2 the usual cause is their graph splitting: say which, and the fix.
            from .distributed import graph_split_hint

            hint = graph_split_hint(gm)
            if hint:
                report.reason = f"{report.reason}; {hint}"
        log.warning("dualkv: graph %d refused, running it unchanged: %s", report.graph_id, report.reason)
        return fallback
    report.rewritten = True
    for hint in _vocabulary_outputs(gm, axes):
        report.hints.append(hint)
        log.warning("dualkv: graph %d: %s", report.graph_id, hint)
    log.info(
        "dualkv: graph %d rewritten (%d attention, %d next-token log-probs fused with the lm_head, %d with the entropy)",
        report.graph_id, len(axes.attention), report.fused_log_probs, report.fused_entropy,
    )
    plan = plan_graph(gm, result, packed, runs, cfg, mode, scalar_checks, report.graph_id)
    return Runner(plan, fallback, cfg, mode, report)


# A last dim above this on a [B, S, X] output is a vocabulary (hidden sizes reach 16,384; vocabularies start near 32K).
_VOCABULARY_DIM = 16384


def _vocabulary_outputs(gm: fx.GraphModule, axes) -> list[str]:
    """A hint for each ``[B, S, V]`` token value the graph returns: packing must unpack it whole for the caller."""
    out = next(iter(gm.graph.find_nodes(op="output")))
    hints = []
    for leaf in carried.leaves(out.args[0]):
        value = ev(leaf)
        info = axes.info.get(leaf) if isinstance(leaf, fx.Node) else None
        if not (isinstance(value, torch.Tensor) and value.dim() == 3 and info is not None and info.kind is Kind.TOKEN):
            continue
        if info.tags[:2] == ("b", "s") and value.shape[-1] > _VOCABULARY_DIM and value.dtype.is_floating_point:
            hints.append(
                f"returns {leaf.name} of shape {list(value.shape)}, built whole in the caller's layout (every row's copy "
                "of a shared prompt); if a loss in another graph reads it (a graph break: FSDP2's hooks at the module "
                "it wraps), compute the next-token log-probs inside that module's forward, calling the backbone and the "
                "lm_head from that same function, so only they cross (docs/multi_gpu.md)"
            )
    return hints


def register() -> None:
    """Register "dualkv" with Dynamo (the entry point does this for installed packages)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "dualkv" not in _BACKENDS:
        register_backend(name="dualkv")(dualkv_backend)
