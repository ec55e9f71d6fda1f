"""The runtime wrapper of a rewritten graph: per call, find the layout, decide, pack, run, unpack.

``Runner`` takes what it reads about the graph from its ``plan.GraphPlan``, finished
at compile time, and its layout from a strategy (``layout_source``): detected from
the call's token ids, or carried from an earlier graph of the forward. It runs
the original compiled graph when no layout holds, nothing is shared, rho is
below ``min_rho``, a module scalar changed, or the program would read a
position packing does not compute; otherwise the packed graph, compiled on its
first use, and returns outputs in the caller's layout. A first packed call
that fails its layout source's check (the graph's masks) or fails to compile
disables the rewrite for that graph.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from typing import Callable, Optional

import torch

from ..analysis.padding_reads import nonzero_masks, tainted_where
from ..config import DualKVConfig
from ..layout import SharedPromptLayout
from ..plan import GraphPlan
from ..report import GraphReport
from ..rewrite.pack_graph import PACKED_INPUTS
from ..rewrite.packed_inputs import PER_TOKEN_OR_SEGMENT, PackedInputs
from .recurrence_check import recurrence_mismatch
from .layout_source import FromCarried, FromTokenIds
from .nested_compile import nested_compile
from . import direct_compile
from . import exactness_check
from .sequence_parallel import agree, local_token_count, shard_packed_inputs

log = logging.getLogger("dualkv_compile")

__all__ = ["Runner", "own_views"]


class Runner:
    """Runtime wrapper: layout, decide, pack, run, unpack (see the module docstring)."""

    def __init__(self, plan: GraphPlan, fallback, cfg: DualKVConfig, mode, report: GraphReport):
        # ``plan.run_gm`` is compiled and run: the packed graph, or under sequence parallelism its split over the
        # group (rewrite.sequence_parallel).
        self.plan, self.fallback, self.cfg, self.mode, self.report = plan, fallback, cfg, mode, report
        self.packed_gm, self.run_gm = plan.packed_gm, plan.run_gm
        self.sp = cfg.sequence_parallel
        source = FromTokenIds if plan.inputs.input_ids is not None else FromCarried
        self.layout_source = source(plan.inputs, cfg, report)
        # Where the program reads a position packing zeroes, and the input-only factors that may mask it; factors
        # no side graph evaluates before the call are unknown: they zero nothing (plan.padding_checks).
        self.padding_reads = plan.padding.reads
        self.compiled: Optional[Callable] = None
        self.checked = False
        self.disabled: Optional[str] = None

    def _compile_packed(self, args: tuple):
        def count():
            self.report.packed_compiles += 1

        def nested():
            # A dynamic outer graph (Dynamo's recompile after a shape changed) passes symbolic sizes, ints
            # included, that a dynamic=None compile would specialise to their first values: all dynamic
            # then (parameters stay static: force_parameter_static_shapes). A static one: only the
            # packed layout's per-token and per-segment sizes, marked per call.
            dynamic = True if self.plan.outer_dynamic else None
            return nested_compile(self.run_gm, self.cfg, self.mode, dynamic=dynamic, on_compile=count)

        why_not = self.plan.why_not_direct  # the graph's, the options' and the mode's part, decided at compile time
        if why_not is None and not all(direct_compile.plain(a) for a in args):
            why_not = "an input is not a plain tensor or int"
        if why_not is None:
            # Straight to the inner compiler, the sizes symbolic where the outer graph's are and along the packed
            # tokens and segments: no second Dynamo trace of the packed graph (runtime.direct_compile).
            return direct_compile.DirectCompile(self.run_gm, self.cfg, self.mode, self._symbolic_dims, on_compile=count,
                                                otherwise=nested)
        log.info("dualkv: graph %d: packed graph compiled through a nested torch.compile: %s", self.report.graph_id, why_not)
        return nested()

    def _symbolic_dims(self, args) -> list:
        """Per argument of the packed graph, which sizes are symbolic (``DirectCompile``'s ``dims``): the outer
        graph's inputs where Dynamo made them symbolic; the packed inputs along the tokens and segments (they change
        every step), and along B * S as the outer graph is (dynamic or not); the two maxima as ints that vary."""
        n_outer = len(self.plan.outer_values)
        dims = [_symbolic_where(value, arg) for value, arg in zip(self.plan.outer_values, args[:n_outer])]
        for name, arg in zip(PACKED_INPUTS, args[n_outer:]):
            varies = name in PER_TOKEN_OR_SEGMENT or self.plan.outer_dynamic
            dims.append(tuple(varies for _ in arg.shape) if isinstance(arg, torch.Tensor) else True)
        return dims

    def __call__(self, *args):
        self.report.calls += 1
        if self.disabled:
            return self.fallback(*args)
        for index, value, what in self.plan.scalar_checks:
            if float(args[index]) != value:
                return self._unpacked(args, f"{what} is {float(args[index])}, the packed graph was built for {value}")
        # The padding reads' masks, computed from the inputs alone, ride in the layout's one host transfer when
        # the layout is detected from this call's token ids: then the check needs no second sync.
        masks = self._factor_masks(args) if self.padding_reads and isinstance(self.layout_source, FromTokenIds) else None
        riders = _riders(masks, args[self.plan.inputs.input_ids].device) if masks is not None else ()
        layout = self.layout_source(args, also_read=riders)
        if self.sp is not None:  # the group takes one path, on one layout (runtime.sequence_parallel)
            self._agree(args, layout)
        if isinstance(layout, str):
            return self._unpacked(args, layout)
        stats = layout.stats()
        self.report.last_layout, self.report.last_stats = repr(layout), stats
        if stats.rho < self.cfg.min_rho:
            return self._unpacked(args, f"rho {stats.rho:.2f} below min_rho {self.cfg.min_rho}")
        if not self.checked:
            why = self.layout_source.first_call_check(args, layout)
            if why is not None:
                return self._disable(args, f"disabled on its first call: {why}")
            self.checked = True
        host = self.layout_source.read_back
        if riders and host is not None:  # else (a layout taken from an earlier graph) the masks stay on the device
            masks = (_on_host(masks[0], host), masks[1])
        why = self._padding_read(args, layout, masks)
        if why is not None:
            return self._unpacked(args, why)
        if self.plan.recurrent:
            mask_at = self.plan.inputs.attention_mask
            why = recurrence_mismatch(self.plan.recurrent, layout, None if mask_at is None else args[mask_at])
            if why is not None:
                return self._unpacked(args, why)
        extra = PackedInputs.of(layout)
        if self.sp is not None:
            extra = shard_packed_inputs(extra, layout.num_tokens, self.sp)
            self.report.local_tokens = local_token_count(layout.num_tokens, self.sp.world)
        if self.compiled is None:
            self.compiled = self._compile_packed((*args, *extra))
        # T and the segment count change every step; B * S (unpack_index,
        # valid) follows the outer graph, static or symbolic as Dynamo made it.
        for name in PER_TOKEN_OR_SEGMENT:
            torch._dynamo.maybe_mark_dynamic(getattr(extra, name), 0)
        if self.report.packed_calls == 0:
            # The first packed call traces and compiles the packed graph. If
            # that fails (an op the analysis let through but the packed shapes
            # break), run this graph unchanged from now on rather than fail
            # the step. Not on running out of memory: the unpacked program needs
            # more, and the caller must see the error (running the unpacked
            # program after the packed graph's OOM would hide why).
            try:
                out = self.compiled(*args, *extra)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - reported, then the original program runs
                first_line = (str(e).splitlines() or [""])[0][:300]
                return self._disable(args, f"the packed graph failed on its first call: {type(e).__name__}: {first_line}")
        else:
            try:
                out = self.compiled(*args, *extra)
            except direct_compile.TooManyCompiles as e:
                return self._unpacked(args, str(e))
        out = own_views(out, args)
        if exactness_check.due(self.cfg.check_exact, self.report.packed_calls):
            rerun = functools.partial(self.compiled, *args, *extra)
            summary = exactness_check.check(self.fallback, args, layout, out, rerun, list(self.plan.input_names), self.sp)
            self.report.exactness_checks.append(f"call {self.report.calls}: {summary}")
        self.report.packed_calls += 1
        self.report.layout_source = self.layout_source.source
        # Later graphs of this forward may carry the layout to the tensors made here (layout.carried: ActiveLayout.produced).
        self.layout_source.active.record_outputs(out, self.plan.unpacked_outputs)
        return out

    def _factor_masks(self, args, batch_size: Optional[int] = None, seq_len: Optional[int] = None):
        """Per padding read, where its factors (evaluated on this call's inputs) are nonzero
        (``padding_reads.nonzero_masks``), and the factors that are unknown, with why."""
        if batch_size is None:
            ids = args[self.plan.inputs.input_ids]
            batch_size, seq_len = int(ids.shape[0]), int(ids.shape[1])
        factors = dict.fromkeys(self.plan.padding.unknown)  # None: unknown, zeroes nothing
        unknown = dict(self.plan.padding.unknown)
        with torch.no_grad():
            for f in self.plan.padding.factor_gms:
                try:
                    factors.update(zip(f.factor_nodes, f(*args)))
                except Exception as e:  # noqa: BLE001 - the factors are then unknown; the original program runs
                    factors.update(dict.fromkeys(f.factor_nodes))
                    unknown.update(dict.fromkeys(f.factor_nodes, f"evaluating them failed: {type(e).__name__}: {e}"[:300]))
            masks = [nonzero_masks(read, factors, batch_size, seq_len) for read in self.padding_reads]
        return masks, unknown

    def _padding_read(self, args, layout: SharedPromptLayout, masks=None) -> Optional[str]:
        """None, or why this call reads a position packing does not compute (docs/design.md, semantics 8).

        Packing zeroes padding positions, and next-token values whose previous
        column is not the previous token of the same sequence (a sequence's
        first token: left padding, an empty prompt, another sequence packed
        into the row). Reading them is exact only where a factor zeroes them.
        ``masks``: ``_factor_masks``' result, on the host when it was read with
        the layout (then no sync here), else None (evaluated here, one sync).
        """
        if not self.padding_reads:
            return None
        B, S = layout.batch_size, layout.seq_len
        if masks is None:
            masks = self._factor_masks(args, B, S)
        per_read, unknown = masks
        on_host = all(m.device.type == "cpu" for read in per_read for m, _ in read)
        seq = (layout.sequence_ids_on_host() if on_host else layout.sequence_ids()).view(B, S)
        valid = seq >= 0
        linked = (seq[:, 1:] == seq[:, :-1]) & (seq[:, 1:] >= 0)
        with torch.no_grad():
            flags = torch.stack([tainted_where(read, valid, m, linked) for read, m in zip(self.padding_reads, per_read)])
        if not bool(flags.any()):  # on the device: one host sync for all reads
            return None
        read = self.padding_reads[int(flags.nonzero()[0, 0])]
        why = next((f"{node.name}: {unknown[node]}" for node, _, _ in read.factors if node in unknown), None)
        return (
            f"{read.reader.name} reads a position packing does not compute (padding, or the column before a "
            "row's first token, e.g. an empty prompt) where no mask zeroes it; the original program runs"
            + (f" (its mask could not be evaluated before the call: {why})" if why else "")
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
        try:
            return self.fallback(*args)
        except Exception as e:
            # The original program's own error (an IndexError deep in the model) may not name the input; the
            # reason it ran unpacked often does (a mask of the wrong shape).
            e.add_note(f"dualkv ran graph {self.report.graph_id}'s original program because: {why}")
            raise

    def _agree(self, args, layout) -> None:
        """Check that the group holds this layout (or this reason for none): once per layout, not per graph.

        Graphs that carry an earlier graph's layout (FSDP2 per layer) reuse its check: one collective and one
        host sync per step for the layout, not one per layer."""
        active = self.layout_source.active
        same = not isinstance(layout, str) and active is not None and active.layout is layout
        if same and active.sp_agreed:
            return
        agree(layout, self.sp, _device_of(args))
        if same:
            active.sp_agreed = True


def _riders(masks, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The padding reads' factor masks to read with the layout: all of them, or none if any is elsewhere than
    the token ids' device (one transfer reads one device)."""
    flat = [m for read in masks[0] for m, _ in read]
    return tuple(flat) if flat and all(m.device == device for m in flat) else ()


def _on_host(per_read, host: tuple[torch.Tensor, ...]):
    """``per_read`` with each mask replaced by its host copy (``host``, in ``_riders``' order)."""
    it = iter(host)
    return [[(next(it) != 0, slices) for _, slices in read] for read in per_read]


def _device_of(args) -> torch.device:
    return next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))


def own_views(out, args):
    """The packed graph's outputs ``out``, each that is a view and needs no gradient replaced by a tensor of its own
    (same storage, sizes and strides; no copy), where no other output and no input ``args`` shares its storage.

    AOTAutograd hands back such an output from inside its ``autograd.Function`` as it is: a view made in the
    Function's ``no_grad`` forward, which autograd forbids modifying in place with grad mode on ("A view was created
    in no_grad mode and is being modified inplace"). The packed graph makes them where the original program made
    tensors of their own: ``unpack``'s reshape of the gathered tokens, of a ``torch.zeros_like`` of the hidden states
    (DBRX's experts' accumulator, which the program after a graph break fills with ``index_add_``). Replaced by
    ``aten._unsafe_view``, as AOTAutograd hides an output's alias of an intermediate itself. A storage that another
    output or an input shares is left as it is: those aliases are the original program's (``rewrite.output_aliases``
    keeps them), and hiding one would cut what autograd knows of the others. Under ``no_grad``: nothing to do.
    """
    if not torch.is_grad_enabled() or not isinstance(out, (tuple, list)):
        return out
    views = [i for i, o in enumerate(out) if isinstance(o, torch.Tensor) and o._base is not None and not o.requires_grad]
    if not views:
        return out

    def storage(t: torch.Tensor):
        return t.device, t.untyped_storage().data_ptr()

    seen = Counter(storage(t) for t in (*out, *args) if isinstance(t, torch.Tensor))
    new = list(out)
    for i in views:
        if seen[storage(out[i])] == 1 and out[i].untyped_storage().data_ptr() != 0:
            new[i] = torch.ops.aten._unsafe_view(out[i], out[i].shape)
    return type(out)(new)


def _symbolic_where(outer_value, arg):
    """Which sizes of ``arg`` the outer graph (Dynamo) made symbolic, from its placeholder's fake value: per dim
    for a tensor, one bool for an int. No fake value (or another rank): all static, as Dynamo specialised them."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    if isinstance(arg, torch.Tensor):
        shape = getattr(outer_value, "shape", None)
        if shape is None or len(shape) != arg.dim():
            return tuple(False for _ in arg.shape)
        return tuple(not is_concrete_int(d) for d in shape)
    return isinstance(outer_value, torch.SymInt) and not is_concrete_int(outer_value)
