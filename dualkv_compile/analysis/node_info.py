"""The per-node facts of the token-axes analysis: a value's kind and the token axis of each of its dimensions.

Shared by the analysis driver (``token_axes``), its per-op rules and every
pass that reads the analysis (``rewrite.pack_graph``, the runtime's checks).
Imports only ``graph.meta`` (``ev``: a node's example value) of the package.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

import torch
import torch.fx as fx

from ..graph.meta import ev

__all__ = [
    "Kind", "Tags", "NodeInfo", "Route", "Weighted", "RuleFailed", "Coupling",
    "hint", "shape_of", "arg", "reduced_dims", "op_name", "kind_of", "untagged",
]


class Kind(enum.Enum):
    TOKEN = "token"
    COLUMN = "column"
    BCAST = "bcast"
    NONE = "none"
    ORIG = "orig"
    # MoE dispatch (analysis.moe_rules): a value of the packed program only, with no form in the original
    # layout (entries in expert-sorted order, indices into the token axis, per-expert counts). Never unpacked.
    ROUTED = "routed"


Tags = tuple[Optional[str], ...]


@dataclasses.dataclass(frozen=True)
class Route:
    """What a ROUTED value is, relative to ``order``: the sort along a merged token axis that laid it out.

    ``what``: "sort" (the sort's (values, indices) pair); "keys" (the sorted keys, one per entry);
    "values" (data of each entry, in sorted order: tag "r"); "perm" (the entries' indices into the merged
    token axis of ``factor`` entries per token); "empty" (an uninitialised buffer shaped like the sort);
    "inverse" (each token-axis entry's position in the sorted order: tag "bs", ``factor`` per token);
    "counts" (entries per expert); "offsets" (their cumulative sums: the expert groups); "mutation" (the
    in-place op that writes "inverse"); "copies" (``factor`` expert-major copies of each token, entry
    ``e * N + t``: Llama 4's ``hidden.repeat(E, 1)`` dispatch, ``analysis.moe_copies``).
    """

    order: fx.Node
    what: str
    factor: int = 1


@dataclasses.dataclass
class NodeInfo:
    kind: Kind
    tags: Tags = ()
    cause: Optional[str] = None  # for ORIG: the first reason in its ancestry
    # TOKEN values only. shift 1: column c holds the value of the token at
    # column c + 1 (``x[:, 1:]``, the next-token targets). slen: the length of
    # the sequence axis in the original layout (S, or S - 1 after ``x[:, :-1]``
    # or ``x[:, 1:]``). The packed value is the same either way: one per token.
    shift: int = 0
    slen: Optional[int] = None
    route: Optional[Route] = None  # ROUTED values only
    # NONE values only: a reduction over every token axis of ``weighted.operand``, computed on the packed
    # stream with each token weighted by its multiplicity (analysis.token_reductions).
    weighted: Optional["Weighted"] = None
    # Computed from the token ids, mask and positions (and constants) alone: no model value, no other
    # input. The rewrite computes such a value in the original layout from the inputs (exact, even at
    # padding) wherever the original layout needs it, rather than unpacking its packed form.
    from_inputs: bool = False


@dataclasses.dataclass(frozen=True)
class Weighted:
    """A reduction of ``op`` over every token axis of the TOKEN value ``operand`` (docs/design.md, semantics 12).

    On the packed stream each entry is weighted by the number of positions of the original layout the
    token stands for (``layout.packed_ops.token_weights``: the positions ``unpack`` fills from it), so the
    result equals the reduction of the unpacked value, zeros at padding; the runner checks, per call, that
    a factor zeroes every position packing does not compute (``analysis.padding_reads``).
    """

    op: str  # "sum", "mean", "scatter_add", "index_add", "histc"
    operand: fx.Node


class RuleFailed(Exception):
    """No per-token rule applies: the value is computed in the original layout."""


class Coupling(Exception):
    """An op that couples tokens of a packed value: the whole graph is refused."""


def hint(x) -> int:
    """A size as an int: symbolic sizes (dynamic-shape graphs) by the example's value."""
    if isinstance(x, torch.SymInt):
        return int(x.node.hint)
    return int(x)


def shape_of(x) -> list[int]:
    """The example shape of node ``x`` (hints for symbolic sizes)."""
    return [hint(d) for d in ev(x).shape]


def _is_tensor(x) -> bool:
    return isinstance(ev(x), torch.Tensor)


def arg(node: fx.Node, index: int, name: str, default=None):
    """Argument ``index`` of ``node``, or its keyword ``name``, or ``default``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def reduced_dims(dim, rank: int) -> set[int]:
    """The dims a reduction's ``dim`` argument names, non-negative (all of them for None)."""
    if dim is None:
        return set(range(rank))
    return {d % rank for d in (dim if isinstance(dim, (tuple, list)) else (dim,))}


def op_name(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def kind_of(tags: Tags) -> Kind:
    """The kind of a value with token axes ``tags`` (not ORIG: that depends on the ancestry).

    Tag "r" marks an axis in expert-sorted order (``Route``): such a value exists on the packed stream only.
    """
    if "r" in tags:
        return Kind.ROUTED
    if any(t in ("s", "bs") for t in tags):
        return Kind.TOKEN if any(t in ("b", "bs") for t in tags) else Kind.COLUMN
    if "b" in tags:
        # Only expands of constants make batch-only tags (see shape_rules.move),
        # so the value is the same in every row.
        return Kind.BCAST
    return Kind.NONE


def untagged(ev) -> Tags:
    """No token axes, one entry per dimension of the example value (none for non-tensors)."""
    return (None,) * ev.dim() if isinstance(ev, torch.Tensor) else ()
