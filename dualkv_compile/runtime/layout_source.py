"""Where a rewritten graph's layout comes from on each call: the strategies the runner delegates to.

``FromTokenIds`` serves a graph with token ids: it detects the layout from
``input_ids`` (with the attention mask and position ids; one host sync),
makes it the thread's current layout, and checks the graph's attention masks
against it once, on the first call (``verify``).

``FromCarried`` serves a part of a model after a graph break (no token ids):
the layout current in the thread (``layout.carried``) if it is for this
``(B, S)`` and holds here (masks among the inputs match it, else an input was
produced under it), else, for a graph with attention, one detected from the
call's own inputs (rows agree where their hidden states and positions agree
bitwise; padding from the mask's diagonal), which becomes the current one.
Masks are checked per call against the layout used: one graph may serve every
decoder layer, each with its own mask.

Both return the layout, or a string saying why this call runs unpacked, and
set ``active`` (the ``ActiveLayout`` used) and ``source`` (for the report).
Both check that the dropped copies of every carried input equal the kept ones
bitwise (``share_check``). What they read about the graph (inputs by role, the
masks' side graph) is the compile-time ``plan.layout_inputs.LayoutInputs``.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ..config import DualKVConfig
from ..layout import carried as active_layout
from ..layout import SharedPromptLayout
from ..layout.detect import detect_reading
from ..plan.layout_inputs import LayoutInputs
from ..report import GraphReport
from .mask_check import mask_mismatch, pure_mask

log = logging.getLogger("dualkv_compile")

__all__ = ["FromCarried", "FromTokenIds", "LayoutSource"]


class LayoutSource:
    """The part common to both strategies: the inputs by role, the graph's masks, the share check."""

    def __init__(self, inputs: LayoutInputs, cfg: DualKVConfig, report: GraphReport):
        self.inputs, self.cfg, self.report = inputs, cfg, report
        self.has_attention = inputs.has_attention
        # Token-major inputs carried from an earlier graph (hidden states, logits): checked for sharing per call.
        self.carried = inputs.carried
        # The first causal attention without a mask (it would attend to left padding, which packing removes).
        self.causal_unmasked = inputs.causal_unmasked
        self.mask_gm = inputs.mask_gm  # with token ids: only under option verify (plan.layout_inputs)
        self.mask_names, self.mask_windows = inputs.mask_names, inputs.mask_windows
        self.floating_index = inputs.floating_index
        # Copies of a token in different columns may share a packed copy unless the packed program reads
        # values of the column (rotary tables from arange(S), cache positions).
        self.same_columns = inputs.same_columns
        self.active: Optional[active_layout.ActiveLayout] = None
        self.source: Optional[str] = None
        # The host copies of the call's ``also_read`` tensors when its layout was read from the device with them
        # (one transfer for both), else None.
        self.read_back: Optional[tuple[torch.Tensor, ...]] = None

    def masks(self, args):
        with torch.no_grad():
            return self.mask_gm(*args)

    def vouched_for(self, cur: active_layout.ActiveLayout, args) -> bool:
        """The caller published ``cur`` (``shared_batch``), or a floating-point input of this call was produced by a
        graph that ran packed on it: a graph with no mask to tie its padding to ``cur`` may take it."""
        return cur.trusted or any(cur.produced(args[i]) for i in self.floating_index)

    def carried_values(self, args) -> list[torch.Tensor]:
        """The carried inputs laid out ``[B, S, ...]`` (multimodal positions ``[k, B, S]`` as ``[B, S, k]`` views)."""
        return [args[i] if dims == (0, 1) else args[i].movedim(dims, (0, 1)) for _, i, dims in self.carried]

    def share_check(self, args, active: active_layout.ActiveLayout) -> Optional[str]:
        """None if every carried input's dropped copies equal the kept ones bitwise, else why not."""
        if not self.carried:
            return None
        bad = active.share_mismatch(self.carried_values(args))
        if bad is None:
            return None
        return (
            f"input {self.carried[bad][0]}: the copies of a shared token differ across the rows of a group (bitwise), "
            "so packing would not be exact"
        )

    def first_call_check(self, args, layout: SharedPromptLayout) -> Optional[str]:
        """Checked once, on the first call that would pack: None, or why the rewrite is disabled."""
        return None


class FromTokenIds(LayoutSource):
    def __init__(self, inputs: LayoutInputs, cfg: DualKVConfig, report: GraphReport):
        super().__init__(inputs, cfg, report)
        # The embedding's row count, where it reads the ids directly: an id out of its range (at padding too)
        # makes the layout fail, so the original program runs and raises as the unmodified model does.
        self.vocab_size = inputs.vocab_size

    def __call__(self, args, also_read=()) -> "SharedPromptLayout | str":
        """The call's layout (or why none); ``also_read``: tensors to read to the host in the detection's one
        transfer, left in ``read_back`` when the layout was detected here (not taken from an earlier graph)."""
        self.read_back = None
        ids = args[self.inputs.input_ids]
        mask = args[self.inputs.attention_mask] if self.inputs.attention_mask is not None else None
        pos = args[self.inputs.position_ids] if self.inputs.position_ids is not None else None
        if mask is None and not self.has_attention:
            current = self._current(ids, args)
            if current is not None:
                return self.share_check(args, self.active) or current
        try:
            layout, read = detect_reading(
                ids, mask, pos, group_size=self.cfg.group_size, min_shared=self.cfg.min_shared, same_columns=self.same_columns,
                # Causal attention without a mask spans the whole row: then a row is one sequence.
                split_at_restarts=self.causal_unmasked is None, vocab_size=self.vocab_size, also_read=also_read,
            )
        except ValueError as e:
            active_layout.clear()
            return f"layout: {e}"
        self.read_back = read
        self.active = active_layout.publish(layout, self.report.graph_id, "input_ids")
        self.source = "detected from input_ids"
        return self.share_check(args, self.active) or layout

    def _current(self, ids: torch.Tensor, args) -> "SharedPromptLayout | None":
        """The current layout for a graph with token ids but neither a mask nor attention (the lm_head and
        log-probs after a graph break: FSDP2's root hook): detected from the ids alone, every padding position
        would count as a token. Taken when the caller published it (``shared_batch``) or an input of this call
        was produced by a graph that ran packed on it, it is for this ``[B, S]``, and its shared copies of the ids
        agree; with one row it may share across columns, so only where the graph reads no column value. None:
        not taken."""
        cur = active_layout.current()
        B, S = int(ids.shape[0]), int(ids.shape[1])
        if cur is None or not cur.matches(B, S, ids.device) or (B == 1 and self.same_columns):
            return None
        if not self.vouched_for(cur, args):
            return None
        if cur.share_mismatch([ids]) is not None:
            return None
        self.active, self.source = cur, f"carried from {cur.describe()}"
        return cur.layout

    def first_call_check(self, args, layout: SharedPromptLayout) -> Optional[str]:
        """None if every attention mask of the graph is the causal, padding-aware mask of the layout."""
        if not self.cfg.verify:
            return None
        B, S = layout.batch_size, layout.seq_len
        if self.causal_unmasked is not None and _left_padded(layout):
            return (
                f"{self.causal_unmasked}: causal attention without a mask attends to left padding or to the other "
                "sequences packed into its row, which packing removes"
            )
        if self.mask_gm is None:
            return None
        if B * S * S > self.cfg.verify_max_elements:
            log.info("dualkv: mask check skipped for graph %d (B*S*S = %d elements)", self.report.graph_id, B * S * S)
            return None
        # The mask was made for this batch: rows of valid queries must match, padding rows are unspecified.
        return mask_mismatch(self.masks(args), self.mask_names, layout, pin_padding=False, windows=self.mask_windows)


class FromCarried(LayoutSource):
    def __init__(self, inputs: LayoutInputs, cfg: DualKVConfig, report: GraphReport):
        super().__init__(inputs, cfg, report)
        self.mask_key = inputs.mask_key  # the inputs the masks read: a carried layout's mask check is per key
        self.size_index = next(i for _, i, dims in self.carried if dims == (0, 1))

    def __call__(self, args, also_read=()) -> "SharedPromptLayout | str":
        """The call's layout (or why none); reads nothing extra for the caller (``read_back`` stays None)."""
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
        if not self.has_attention:
            return why
        detected = self._detect(args, B, S, ref.device)
        if isinstance(detected, str):
            return f"{why}; no layout detected from this graph's inputs either: {detected}"
        return detected

    def _check_carried(self, cur: active_layout.ActiveLayout, args) -> Optional[str]:
        if self.mask_gm is not None:
            keys = [args[i] for i in self.mask_key]
            if not cur.mask_checked(keys):
                # The layout came from elsewhere: the mask must also pin its padding (pin_padding).
                why = mask_mismatch(self.masks(args), self.mask_names, cur.layout, pin_padding=True, windows=self.mask_windows)
                if why is not None:
                    return why
                cur.mark_mask_checked(keys)
        else:
            if not self.vouched_for(cur, args):
                return (
                    "no input of this call was produced by a graph that ran packed on it, and no mask among the "
                    "inputs ties its padding to this call"
                )
            if self.causal_unmasked is not None and _left_padded(cur.layout):
                return "causal attention without a mask attends to left padding or to the other sequences of its row, which packing removes"
        return self.share_check(args, cur)

    def _detect(self, args, B: int, S: int, device) -> "SharedPromptLayout | str":
        masks = None
        if self.mask_gm is not None:
            masks = self.masks(args)
            allowed = pure_mask(self.mask_names[0], masks[0], B, S)
            if isinstance(allowed, str):
                return allowed
            # Padding positions are those that do not attend to themselves.
            valid = allowed[:, 0].diagonal(dim1=-2, dim2=-1).expand(B, S)
        else:
            valid = torch.ones(B, S, dtype=torch.bool, device=device)
        values = self.carried_values(args)
        try:
            layout = active_layout.detect_from_values(values, valid, group_size=self.cfg.group_size, min_shared=self.cfg.min_shared)
        except ValueError as e:
            return f"layout: {e}"
        if masks is not None:
            why = mask_mismatch(masks, self.mask_names, layout, pin_padding=True, windows=self.mask_windows)
            if why is not None:
                return why
        self.active = active_layout.publish(layout, self.report.graph_id, "inputs")
        # The values were hashed to find the sharing: check it bitwise before anything uses it.
        why = self.share_check(args, self.active)
        if why is not None:
            active_layout.clear()
            return why
        if masks is not None:
            self.active.mark_mask_checked([args[i] for i in self.mask_key])
        self.source = "detected from its hidden states" + (" and mask" if masks is not None else "")
        return layout


def _left_padded(layout: SharedPromptLayout) -> bool:
    """True unless every row is one sequence from column 0: causal attention without a mask spans the whole row."""
    return not layout.one_sequence_per_row()
