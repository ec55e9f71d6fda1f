"""The runtime wrappers of a rewritten graph: per call, detect or carry the layout, decide, pack, run, unpack.

``PackedRunner`` serves a graph with token ids: it detects the layout from them (one host sync), runs the
original compiled graph when nothing is shared, rho is below ``min_rho``, a module scalar changed, or the
program would read a position packing does not compute, and otherwise runs the packed graph, compiled on
its first use. ``CarriedRunner`` serves a part of a model after a graph break: it uses the layout current
in the thread (``active_layout``) where it holds for the call's inputs, else detects one from them.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.fx as fx

from .. import active_layout
from ..config import DualKVConfig
from ..layout import SharedPromptLayout, detect
from ..passes.pack_graph import PACKED_INPUTS
from ..passes.packed_inputs import PER_TOKEN_OR_SEGMENT, PackedInputs
from ..passes.padding_reads import find_padding_reads, tainted
from ..passes.token_axes import Kind, TokenAxes
from ..report import GraphReport
from .mask_check import allowed_from_mask, mask_mismatch, pure_mask
from .nested_compile import is_dynamic, nested_compile
from .side_graphs import factor_graph, mask_graph

log = logging.getLogger("dualkv_compile")

__all__ = ["CarriedRunner", "PackedRunner", "floating_carried"]


def floating_carried(axes: TokenAxes) -> list[fx.Node]:
    """Carried ``[B, S, ...]`` floating-point inputs: the values packing saves work on in a graph without attention."""
    return [
        n for role, n in axes.token_inputs.items()
        if role.startswith("carried:") and axes.info[n].kind is Kind.TOKEN and n.meta["example_value"].dtype.is_floating_point
    ]


class PackedRunner:
    """Runtime wrapper: detect, decide, pack, run, unpack (see the module docstring)."""

    def __init__(self, gm, axes: TokenAxes, packed: fx.GraphModule, fallback, cfg: DualKVConfig, mode, report: GraphReport, scalar_checks=()):
        self.axes, self.packed_gm, self.fallback, self.cfg, self.mode, self.report = axes, packed, fallback, cfg, mode, report
        self.scalar_checks = list(scalar_checks)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.input_index = {role: placeholders.index(node) for role, node in axes.token_inputs.items()}
        self.outer_dynamic = is_dynamic(gm)
        # Token-major inputs carried from an earlier graph (hidden states, logits): checked for sharing per call.
        self.carried = [(role.split(":", 1)[1], i) for role, i in self.input_index.items() if role.startswith("carried:")]
        self.active: Optional[active_layout.ActiveLayout] = None
        self.source: Optional[str] = None
        self.compiled: Optional[Callable] = None
        self.verified = not cfg.verify
        self.disabled: Optional[str] = None
        self.mask_gm = mask_graph(gm, axes) if cfg.verify else None
        self.unpacked_outputs = unpacked_output_positions(packed)
        # Where the program reads a position packing zeroes, and the input-only factors that may mask it.
        self.padding_reads = find_padding_reads(packed, len(PACKED_INPUTS), gm)
        factors = list(dict.fromkeys(node for r in self.padding_reads for node, _, _ in r.factors))
        self.factor_gms = [
            f for f in (
                factor_graph(packed, [n for n in factors if n.graph is packed.graph], len(PACKED_INPUTS)),
                factor_graph(gm, [n for n in factors if n.graph is gm.graph], 0),
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
        return nested_compile(self.packed_gm, self.cfg, self.mode, dynamic=dynamic, on_compile=count)

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
        extra = PackedInputs.of(layout)
        # T and the segment count change every step; B * S (unpack_index,
        # valid) follows the outer graph, static or symbolic as Dynamo made it.
        for name in PER_TOKEN_OR_SEGMENT:
            torch._dynamo.maybe_mark_dynamic(getattr(extra, name), 0)
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
            allowed = allowed_from_mask(m)
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
        self.mask_gm = mask_graph(gm, axes)
        self.mask_key: list[int] = []
        if self.mask_gm is not None:
            self.mask_key = [i for i, p in enumerate(self.mask_gm.graph.find_nodes(op="placeholder")) if p.users]
        self.size_index = self.carried[0][1]
        floating = set(floating_carried(axes))
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
                why = mask_mismatch(masks, self.mask_names, cur.layout)
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
            allowed = pure_mask(self.mask_names[0], masks[0], B, S)
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
            why = mask_mismatch(masks, self.mask_names, layout)
            if why is not None:
                return why
        self.active = active_layout.publish(layout, self.report.graph_id, "inputs")
        if masks is not None:
            self.active.mark_mask_checked([args[i] for i in self.mask_key])
        self.source = "detected from its hidden states" + (" and mask" if masks is not None else "")
        return layout


def unpacked_output_positions(packed: fx.GraphModule) -> tuple[int, ...]:
    """Positions, among the packed graph's tensor outputs in ``active_layout.leaves`` order, made by ``unpack``.

    Their shared copies are equal by construction. Empty when an output's
    kind (tensor or not) cannot be told, so nothing is taken for granted.
    """
    from ..passes.packed_ops import unpack_merged, unpack_tokens

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
