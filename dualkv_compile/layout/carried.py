"""The layout carried from one compiled graph to the next, when a model is split into several graphs.

When a model runs as several Dynamo graphs (FSDP2 ``fully_shard`` per decoder layer, a separately compiled layer,
any graph break), only some see the token ids; the others take hidden states ``[B, S, H]``, position embeddings
and a ``[B, 1, S, S]`` mask. This module holds, per thread, the layout a graph last established (from its token
ids, or from its hidden states and mask) so that later graphs of the same forward can run packed on it.

Assumes: a graph's token-major inputs have the batch and sequence axes leading (``[B, S, ...]``); the graphs of
one forward run in one thread, in program order.
Guarantees (each checked per call by the backend; a failed check runs the graph unpacked, with the reason):
    * At most one layout is current per thread; every successful detection replaces it, a failed one from token
      ids clears it. It is used only for a call whose ``(B, S)`` and device match.
    * ``share_mismatch``: for every token-major input, the copies packing drops (rows 1.. of a group, over the
      shared prefix) are bitwise equal to the copy it keeps, the condition under which the packed program
      computes what each row would (O(B * P * H) reads).
    * A graph whose masks are inputs, or built from inputs, checks them against the layout (``mask_checked``,
      once per layout, set of tensors and equal sizes); a graph with no mask uses a carried layout only if an
      input shares storage with a tensor a graph produced while running packed on this very layout
      (``produced``; the producer is alive, so its storage was not reused). Otherwise nothing ties the layout's
      padding to this call's data.
    * Nothing here keeps tensors alive: produced tensors and checked masks are held by weak references.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Iterable, Optional, Sequence

import torch

from .detect import detect, expand_runs
from .shared_prompt import SharedPromptLayout

__all__ = ["ActiveLayout", "as_bits", "current", "publish", "clear", "detect_from_values", "leaves"]


@dataclasses.dataclass(eq=False)
class ActiveLayout:
    """A layout established by graph ``graph_id`` (``how``: "input_ids" or "inputs"), with its checks' caches."""

    layout: SharedPromptLayout
    graph_id: int
    how: str
    _share: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    _storages: dict = dataclasses.field(default_factory=dict)
    _masks: dict = dataclasses.field(default_factory=dict)
    # Tensors whose shared copies are known bitwise equal: unpacked outputs of
    # a packed graph (equal by construction) and inputs that passed the check.
    _equal: dict = dataclasses.field(default_factory=dict)
    share_reads: int = 0  # calls of share_mismatch that had to read tensors (one host sync each)
    sp_agreed: bool = False  # the sequence-parallel group checked that every rank holds this layout
    # Published by a caller that built the batch (``shared_batch``): every [B, S] value of the calls made while
    # it is current is laid out on it, so a graph need not trace its inputs to a packed graph (FSDP2's hooks
    # between graphs hand tensors on through autograd functions); the share check still runs.
    trusted: bool = False

    def matches(self, batch_size: int, seq_len: int, device: torch.device) -> bool:
        L = self.layout
        return (L.batch_size, L.seq_len) == (batch_size, seq_len) and L.device == device

    # --------------------------------------------------------------- provenance
    def record_outputs(self, outputs, unpacked: Sequence[int] = ()) -> None:
        """Remember the storages of the ``[B, S, ...]`` tensors a graph returned while running packed on this layout.

        ``unpacked``: positions (in ``_tensors(outputs)`` order) of outputs made
        by unpacking the packed stream, whose shared copies are equal by
        construction (``known_equal``).
        """
        B, S = self.layout.batch_size, self.layout.seq_len
        for i, t in enumerate(_tensors(outputs)):
            if t.dim() >= 2 and tuple(t.shape[:2]) == (B, S) and t.numel():
                s = t.untyped_storage()
                self._storages[id(s)] = weakref.ref(s)
                if i in unpacked:
                    self._mark_equal(t)
        for k in [k for k, r in self._storages.items() if r() is None]:
            del self._storages[k]

    def _mark_equal(self, t: torch.Tensor) -> None:
        self._equal[_alias_key(t)] = (weakref.ref(t.untyped_storage()), t._version)

    def known_equal(self, t: torch.Tensor) -> bool:
        """True if ``t``'s shared copies are known bitwise equal without reading it.

        ``t`` must alias exactly (storage, offset, shape, strides) a tensor
        recorded as an unpacked output or a checked input, and not have been
        modified in place since (its version counter, shared by all its views,
        is unchanged).
        """
        entry = self._equal.get(_alias_key(t))
        return entry is not None and entry[0]() is t.untyped_storage() and entry[1] == t._version

    def produced(self, t: torch.Tensor) -> bool:
        """True if ``t`` shares storage with a live tensor recorded by ``record_outputs``."""
        if not isinstance(t, torch.Tensor) or not t.numel():
            return False
        s = t.untyped_storage()
        ref = self._storages.get(id(s))
        return ref is not None and ref() is s

    # --------------------------------------------------------------- masks
    def mask_checked(self, key_inputs: Sequence[object]) -> bool:
        """Whether the masks computed from exactly these inputs were checked: the same tensors (objects,
        unmodified) and equal scalars (a graph Dynamo compiled with symbolic sizes takes them as ints)."""
        entry = self._masks.get(_mask_key(key_inputs))
        return entry is not None and all(_same_input(e, x) for e, x in zip(entry, key_inputs))

    def mark_mask_checked(self, key_inputs: Sequence[object]) -> None:
        self._masks[_mask_key(key_inputs)] = [
            (weakref.ref(x), x._version) if isinstance(x, torch.Tensor) else (None, x) for x in key_inputs
        ]

    # --------------------------------------------------------------- sharing
    def share_mismatch(self, tensors: Sequence[torch.Tensor]) -> Optional[int]:
        """Index of the first ``[B, S, ...]`` tensor whose dropped copies differ (bitwise) from the kept ones, else None.

        Tensors ``known_equal`` are not read; the others are, with one
        device-to-host synchronisation for all of them together, and are
        remembered as equal if they pass. So in a chain of per-layer graphs
        only the first call reads its inputs (the hidden states that later
        layers receive are unpacked outputs, the position embeddings the same
        tensors each layer).
        """
        dst, src = self._share_index()
        if dst.numel() == 0 or not tensors:
            return None
        todo = [(i, t) for i, t in enumerate(tensors) if not self.known_equal(t)]
        if not todo:
            return None
        B, S = self.layout.batch_size, self.layout.seq_len
        self.share_reads += 1
        with torch.no_grad():
            bad = []
            for _, t in todo:
                flat = as_bits(t.detach()).reshape(B * S, -1)
                bad.append((flat.index_select(0, dst) != flat.index_select(0, src)).any())
            flags = torch.stack(bad).tolist()
        for (i, t), f in zip(todo, flags):
            if f:
                return i
        for _, t in todo:
            self._mark_equal(t)
        return None

    def _share_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat ``[B*S]`` positions of the dropped copies of shared tokens, and of the copies packing keeps."""
        if self._share is None:
            L = self.layout
            runs = L.copy_runs()
            if runs:
                self._share = expand_runs(runs, sum(r[-1] for r in runs), L.device)
            else:
                empty = torch.zeros(0, dtype=torch.long, device=L.device)
                self._share = (empty, empty)
        return self._share

    def describe(self) -> str:
        if self.trusted:
            return self.how  # a caller's layout ("dualkv_compile.shared_batch")
        what = "its token ids" if self.how == "input_ids" else "its hidden states and mask"
        return f"graph {self.graph_id} (detected from {what})"


def _mask_key(inputs: Sequence[object]) -> tuple:
    """A tensor by identity (its weak reference and version check the rest), a scalar (a size) by value."""
    return tuple(("tensor", id(x)) if isinstance(x, torch.Tensor) else ("value", type(x).__name__, x) for x in inputs)


def _same_input(entry: tuple, x: object) -> bool:
    ref, recorded = entry
    if ref is None:
        return not isinstance(x, torch.Tensor) and type(x) is type(recorded) and x == recorded
    return ref() is x and x._version == recorded


def _alias_key(t: torch.Tensor) -> tuple:
    """What makes two tensors the same view of the same memory: storage, offset, shape, strides."""
    return id(t.untyped_storage()), t.storage_offset(), tuple(t.shape), t.stride()


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as integers of its width, so equality is bitwise (NaN == NaN, -0.0 != 0.0)."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        if t.dtype.is_complex:
            t = torch.view_as_real(t)
            width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        return t.contiguous().view(width)
    return t


def leaves(x) -> Iterable:
    """The leaves of nested tuples, lists and dicts, in order (a graph's outputs, or their values)."""
    if isinstance(x, (tuple, list)):
        for y in x:
            yield from leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from leaves(y)
    else:
        yield x


def _tensors(x) -> Iterable[torch.Tensor]:
    return (t for t in leaves(x) if isinstance(t, torch.Tensor))


class _State(threading.local):
    current: Optional[ActiveLayout] = None


_state = _State()


def current() -> Optional[ActiveLayout]:
    """The layout current in this thread, or None."""
    return _state.current


def publish(layout: SharedPromptLayout, graph_id: int, how: str, trusted: bool = False) -> ActiveLayout:
    """Make ``layout`` the current one (replacing any other); returns its record (``trusted``: see ActiveLayout)."""
    active = ActiveLayout(layout, graph_id, how, trusted=trusted)
    _state.current = active
    return active


def restore(active: Optional[ActiveLayout]) -> None:
    """Make ``active`` (a record ``current()`` returned earlier, or None) the current layout again."""
    _state.current = active


def clear() -> None:
    """No layout is current in this thread (later graphs detect their own or run unpacked)."""
    _state.current = None


def detect_from_values(
    values: Sequence[torch.Tensor], valid: torch.Tensor, *, group_size: Optional[int] = None, min_shared: int = 1
) -> SharedPromptLayout:
    """The layout of a batch seen only through its ``[B, S, ...]`` values (hidden states, positions) and validity.

    Two positions may share a packed copy when both are valid, in the same
    column, and every value is bitwise equal there: exactly the condition
    under which packing them is exact. The values are hashed to surrogate
    token ids (two 63-bit hashes per position), so a collision could claim a
    share that does not hold: the caller must verify the layout against the
    values (``ActiveLayout.share_mismatch``) before using it.
    """
    B, S = valid.shape
    with torch.no_grad():
        h = torch.zeros(2, B * S, dtype=torch.long, device=valid.device)
        for v in values:
            flat = as_bits(v.detach()).reshape(B * S, -1)
            gen = torch.Generator().manual_seed(flat.shape[1])
            w = torch.randint(1, 2**62, (2, flat.shape[1]), generator=gen).to(valid.device)
            h = h * 1000003
            for c in range(0, flat.shape[1], 256):  # in chunks: int64 temporaries of [B*S, 256]
                part = flat[:, c : c + 256].long()
                for j in range(2):
                    # Integer products and sums wrap: a deterministic mix of every bit of the row.
                    h[j] += (part * w[j, c : c + 256]).sum(-1)
        ids = (h[0] ^ (h[1] << 1)).reshape(B, S)
    return detect(ids, valid.long(), group_size=group_size, min_shared=min_shared, same_columns=True)
