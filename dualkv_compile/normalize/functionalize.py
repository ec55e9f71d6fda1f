"""Normalize: in-place ops on private intermediate values become out-of-place (docs/design.md, semantics 9).

Contract
    Input: a Dynamo torch-level ``GraphModule`` whose tensor nodes carry ``meta["example_value"]`` (fake tensors;
    views share their base's fake storage, as the real tensors would).
    Output: ``(graph, leftover)``. ``graph`` is ``gm`` itself when nothing is mutated, else a copy (``gm`` is left as
    it is: the caller's fallback runs it) in which every in-place op on a *private* value is replaced by its
    out-of-place twin, cast back to the mutated value's dtype where type promotion would change it
    (``bf16.mul_(fp32)`` stays bf16), and every later read of the mutated value, or of an identity alias of it,
    reads the new value. ``leftover`` lists the in-place ops it did not rewrite, each with the nodes that share the
    mutated storage; ``mutation_refusal`` says whether any of them touches a value the packed graph computes twice
    (its packed and its original form), which would drop the mutation: then the graph is refused and runs unchanged.

A mutated value is private when its storage is shared only by the op that made it (not a placeholder or attribute:
a caller's tensor, a parameter or a buffer must really be mutated), by the in-place ops (which return it) and by
full aliases (no-op conversions such as ``.float()`` of a float32 value, ``detach()``). A view made before its last
mutation makes it not private (the mutation would have to be carried through the view); views made after it read
only the final value. A mutated view ``base[i, ...]`` whose base is read otherwise only through views ``base[j,
...]``, ``j != i``, is copied first (no reader could see its writes), and ``x[..., a:b] = v`` becomes a
``slice_scatter``. Why functional: the rewrite gives a token value two translations, the packed one and
``unpack`` of it; an in-place op copied into one is not seen by readers of the other, and out of place the data
flow carries it wherever the value goes.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from ..graph import copy_graph_module
from ..graph.meta import copy_meta, ev as _ev, example_storage as _storage, set_example_value

log = logging.getLogger("dualkv_compile")

__all__ = [
    "INPLACE_OPERATORS", "Mutation", "eliminate_dead_code", "functionalize_mutations", "inplace_param", "mutated_input",
    "mutation_refusal",
]

# ``x op= y`` on tensors: the out-of-place operator.
INPLACE_OPERATORS = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv, operator.ipow: operator.pow,
    operator.imod: operator.mod, operator.iand: operator.and_, operator.ior: operator.or_,
    operator.ixor: operator.xor, operator.ilshift: operator.lshift, operator.irshift: operator.rshift,
    operator.imatmul: operator.matmul,
}
# Methods ending in "_" that change no tensor data.
_METADATA_METHODS = {"requires_grad_", "retain_grad", "share_memory_"}
# Ops that return their input itself when the conversion is a no-op, and ``detach`` (the same data, no
# gradient): full aliases. A read of one after a mutation reads the new value (detached, for ``detach``).
_FULL_ALIAS_METHODS = {"to", "float", "double", "half", "bfloat16", "type", "type_as", "contiguous", "requires_grad_", "detach"}


@dataclasses.dataclass
class Mutation:
    """An in-place op left as it is: ``node`` mutates ``target``; ``aliases`` share its storage."""

    node: fx.Node
    target: fx.Node
    aliases: list[fx.Node]
    why: str


def _op_name(n: fx.Node) -> str:
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))


def inplace_param(target) -> Optional[int]:
    """Position of an ``inplace`` parameter of ``target`` (``F.silu``, ``F.relu`` ...), else None."""
    try:
        params = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("inplace") if "inplace" in params else None


def mutated_input(n: fx.Node) -> Optional[fx.Node]:
    """The node whose data ``n`` changes in place, or None if ``n`` mutates nothing."""
    if n.op == "call_method":
        name = n.target
        if name.endswith("_") and not name.endswith("__") and name not in _METADATA_METHODS:
            return n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if n.op != "call_function":
        return None
    out = n.kwargs.get("out")
    if isinstance(out, fx.Node):
        return out
    target = n.target
    first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if target in INPLACE_OPERATORS or target is operator.setitem:
        return first if isinstance(_ev(first), torch.Tensor) else None
    if isinstance(target, torch._ops.OpOverload):
        for i, arg in enumerate(target._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
                return value if isinstance(value, fx.Node) else None
        return None
    name = getattr(target, "__name__", "")
    if name.endswith("_") and not name.endswith("__") and (getattr(torch, name, None) is target or getattr(F, name, None) is target):
        return first
    i = inplace_param(target) if callable(target) and getattr(target, "__module__", "") == F.__name__ else None
    if i is not None and (n.kwargs.get("inplace") is True or (len(n.args) > i and n.args[i] is True)):
        return first
    return None


def eliminate_dead_code(graph: fx.Graph) -> bool:
    """``graph.eliminate_dead_code()`` that keeps every in-place op (``mutated_input``), its result read or not.

    FX counts a ``call_method`` node pure (``Node.is_impure`` looks at functions and modules only): a statement
    ``out.index_add_(0, idx, x)`` on a graph's input (left in place: ``functionalize_mutations`` rewrites private
    values only), whose result nothing reads, was dropped from the packed graph, and the program after it read
    the unmodified tensor."""
    return graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or mutated_input(n) is not None)


def _functional_form(n: fx.Node) -> Optional[tuple[str, Any, tuple, dict]]:
    """``(op, target, args, kwargs)`` of the out-of-place twin of in-place node ``n``, or None if there is none."""
    args, kwargs = n.args, dict(n.kwargs)
    if n.op == "call_method":
        name = n.target[:-1]
        if n.target == "copy_":
            dst, src = _ev(args[0]), _ev(args[1]) if len(args) > 1 else None
            if isinstance(src, torch.Tensor) and src.shape == dst.shape and src.device == dst.device:
                # A copy, so that a later in-place op left on the source cannot reach this value.
                return "call_method", "to", (args[1],), {"dtype": dst.dtype, "copy": True}
            return None  # broadcasting or cross-device copies: left as they are
        if n.target == "zero_":
            return "call_function", torch.zeros_like, (args[0],), {}
        if n.target == "fill_" and len(args) == 2 and not isinstance(args[1], fx.Node):
            return "call_function", torch.full_like, (args[0], args[1]), {}
        if not name.startswith("_") and callable(getattr(torch.Tensor, name, None)):
            return "call_method", name, args, kwargs
        return None
    if "out" in kwargs or n.target is operator.setitem or isinstance(n.target, torch._ops.OpOverload):
        return None
    if n.target in INPLACE_OPERATORS:
        return "call_function", INPLACE_OPERATORS[n.target], args, kwargs
    name = getattr(n.target, "__name__", "")
    for module in (torch, F):
        if name.endswith("_") and getattr(module, name, None) is n.target and callable(getattr(module, name[:-1], None)):
            return "call_function", getattr(module, name[:-1]), args, kwargs
    i = inplace_param(n.target)
    if i is not None:
        if len(args) > i:
            args = (*args[:i], False, *args[i + 1:])
        else:
            kwargs["inplace"] = False
        return "call_function", n.target, args, kwargs
    return None


def _setitem_form(n: fx.Node, graph: fx.Graph, fake_mode) -> Optional[tuple[str, Any, tuple, dict]]:
    """``x[..., a:b:c] = v`` as ``slice_scatter(x, v, dim, a, b, c)`` (one sliced dim, ``v`` of the slice's shape,
    cast to x's dtype as the assignment does); None for any other index or value."""
    x, idx, value = n.args
    dst, src = _ev(x), _ev(value) if isinstance(value, fx.Node) else None
    cut = _single_slice(idx)
    if cut is None or not isinstance(src, torch.Tensor) or src.device != dst.device:
        return None
    dim, start, stop, step = cut
    with fake_mode:
        if tuple(dst[idx].shape) != tuple(src.shape):
            return None
    with graph.inserting_before(n):
        cast = graph.call_method("to", (value, dst.dtype))
    set_example_value(cast, _fake_run("call_method", "to", cast.args, {}, fake_mode))
    return "call_function", torch.slice_scatter, (x, cast, dim, start, stop, step), {}


def _single_slice(idx) -> Optional[tuple[int, Any, Any, Any]]:
    """``(dim, start, stop, step)`` of a basic index that slices one dim (Ellipsis and full slices elsewhere)."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(not (isinstance(i, slice) or i is Ellipsis) for i in idx) or sum(i is Ellipsis for i in idx) > 1:
        return None
    if any(isinstance(x, fx.Node) for i in idx if isinstance(i, slice) for x in (i.start, i.stop, i.step)):
        return None
    cut = [k for k, i in enumerate(idx) if isinstance(i, slice) and i != slice(None)]
    if len(cut) != 1:
        return None
    k = cut[0]
    e = idx.index(Ellipsis) if Ellipsis in idx else len(idx)
    sl = idx[k]
    return (k if k < e else k - len(idx)), sl.start if sl.start is not None else 0, sl.stop, sl.step if sl.step is not None else 1


def _copy_disjoint_views(graph: fx.Graph, fake_mode) -> None:
    """A mutated view ``v = base[i, ...]`` of a private ``base`` read otherwise only through views ``base[j, ...]``
    with ``j != i`` becomes ``base[i, ...].clone()``: no reader can see the writes through ``base`` (Qwen3.5's
    interleaved rotary writes sections 1 and 2 into a view of section 0 of its ``[3, B, S, D]`` table), and the
    copy is a private value the rest of this pass makes out of place."""
    # A caller's tensor, a parameter or a buffer must really be mutated, through any view of it.
    outside = {_storage(n) for n in graph.nodes if n.op in ("placeholder", "get_attr")} - {None}
    for view in list(graph.nodes):
        base = view.args[0] if view.op == "call_function" and view.target is operator.getitem else None
        if not isinstance(base, fx.Node) or not isinstance(_ev(base), torch.Tensor) or _storage(base) in outside:
            continue
        i = _leading_int(view.args[1], _ev(base))
        writes = [u for u in view.users if mutated_input(u) is view]
        if i is None or not writes:
            continue
        others = [u for u in base.users if u is not view]
        if not all(u.op == "call_function" and u.target is operator.getitem and mutated_input(u) is None
                   and not any(mutated_input(w) is u for w in u.users)
                   and _leading_int(u.args[1], _ev(base)) not in (None, i) for u in others):
            continue
        with graph.inserting_after(view):
            copy = graph.call_method("clone", (view,))
        view.replace_all_uses_with(copy, delete_user_cb=lambda u: u is not copy)
        set_example_value(copy, _fake_run("call_method", "clone", (view,), {}, fake_mode))


def _leading_int(idx, base: torch.Tensor) -> Optional[int]:
    """The int an index starts with (normalised by ``base``'s first size), else None."""
    first = idx[0] if isinstance(idx, tuple) and idx else idx
    if not isinstance(first, int) or isinstance(first, bool) or base.dim() == 0:
        return None
    return first % base.shape[0]


def _fake_run(op: str, target, args, kwargs, fake_mode):
    """The example value of a new node, computed on its inputs' example values."""
    args, kwargs = fx.map_arg((args, kwargs), _ev)
    with fake_mode:
        if op == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        return target(*args, **kwargs)


def _full_alias(n: fx.Node, base: fx.Node) -> bool:
    a, b = _ev(n), _ev(base)
    return (
        n.op == "call_method" and n.target in _FULL_ALIAS_METHODS
        and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
    )


def _slice_of(m: fx.Node, base: fx.Node, *also: fx.Node) -> Optional[tuple[int, Any, Any, Any]]:
    """``(dim, start, end, step)`` if ``m`` is ``base[..., a:b]``-style basic slicing along one dim, else None.
    ``also``: nodes standing for ``base`` (its value after an earlier write, once reads are remapped to it)."""
    if not (m.op == "call_function" and m.target is operator.getitem and (m.args[0] is base or m.args[0] in also)):
        return None
    return _single_slice(m.args[1])


def _written_slice(m: fx.Node, base: fx.Node, mutations: dict, *also: fx.Node) -> bool:
    """``m`` is a slice of ``base`` read only by ``copy_`` into it of a value of its shape: ``buf[..., :d].copy_(x)``,
    as DeepSeek-V3 assembles its key states in a ``new_empty`` buffer (made out of place as ``slice_scatter``)."""
    if _slice_of(m, base, *also) is None or not m.users:
        return False
    for u in m.users:
        src = u.args[1] if len(u.args) > 1 else None
        if not (mutations.get(u) is m and u.op == "call_method" and u.target == "copy_" and u.args[0] is m):
            return False
        if not isinstance(_ev(src), torch.Tensor) or _ev(src).shape != _ev(m).shape or _ev(src).device != _ev(m).device:
            return False
    return True


def functionalize_mutations(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[Mutation]]:
    """See the module docstring."""
    if not any(mutated_input(n) is not None for n in gm.graph.nodes):
        return gm, []
    out = copy_graph_module(gm)
    graph = out.graph
    # The mode the example values were made in (the tracing context's may be another one by now).
    fake_mode = next((ev.fake_mode for ev in map(_ev, graph.nodes) if hasattr(ev, "fake_mode")), None)
    if fake_mode is not None:
        _copy_disjoint_views(graph, fake_mode)
    nodes = list(graph.nodes)

    # Each node's storage, once (nodes made below have storages of their own, and no key here).
    keys = {n: _storage(n) for n in nodes}
    members: dict[StorageWeakRef, list[fx.Node]] = {}
    for n in nodes:
        if keys[n] is not None:
            members.setdefault(keys[n], []).append(n)
    mutations = {n: mutated_input(n) for n in nodes}
    mutations = {n: t for n, t in mutations.items() if t is not None}
    order = {n: i for i, n in enumerate(nodes)}
    last_mutation: dict[StorageWeakRef, int] = {}
    for n, target in mutations.items():
        key = keys.get(target)
        if key is not None:
            last_mutation[key] = max(last_mutation.get(key, -1), order[n])
    private: dict[StorageWeakRef, bool] = {}
    for key, last in last_mutation.items():
        group = members[key]
        base = group[0]
        # A view made after the last mutation reads only the final value: remapped, it views the new node.
        private[key] = base.op not in ("placeholder", "get_attr") and all(
            m is base or m in mutations or _full_alias(m, base) or order[m] > last or _written_slice(m, base, mutations)
            for m in group
        )

    latest: dict[StorageWeakRef, fx.Node] = {}
    latest_at: dict[StorageWeakRef, int] = {}  # position of the mutation that made latest[key]
    leftover: list[Mutation] = []
    rewritten: list[fx.Node] = []
    detached: dict[fx.Node, fx.Node] = {}  # latest value -> its detach(), for reads of a detach() alias
    for n in nodes:
        for a in n.all_input_nodes:
            key = keys.get(a)
            # Only values made before the latest mutation hold stale data; later ones were computed from it.
            if key not in latest or order.get(a, -1) > latest_at[key]:
                continue
            new = latest[key]
            if a.op == "call_method" and a.target == "detach" and a is not new:
                if new not in detached:
                    with graph.inserting_before(n):
                        detached[new] = graph.call_method("detach", (new,))
                    set_example_value(detached[new], _fake_run("call_method", "detach", (new,), {}, fake_mode))
                new = detached[new]
            n.replace_input_with(a, new)
        if n not in mutations:
            continue
        target = mutations[n]
        key = keys.get(target)
        form = _functional_form(n) if key is not None and private.get(key) and fake_mode is not None else None
        base = members[key][0] if key is not None else None
        if form is not None and target is not base and _written_slice(target, base, mutations, *latest.values()):
            # A write into a slice of the buffer (``_written_slice``): the buffer with that slice replaced.
            dim, start, end, step = _slice_of(target, base, *latest.values())
            src = graph.call_method("to", (n.args[1], _ev(base).dtype))
            set_example_value(src, _fake_run("call_method", "to", src.args, {}, fake_mode))
            n.prepend(src)
            form = "call_function", torch.slice_scatter, (latest.get(key, base), src, dim, start, end, step), {}
            target = base
        if form is None and n.target is operator.setitem and key is not None and private.get(key) and fake_mode is not None:
            form = _setitem_form(n, graph, fake_mode)
        if form is None:
            group = members.get(key, [target])
            if key is not None and private.get(key):
                why = f"{_op_name(n)} has no out-of-place form here"
            elif group[0].op in ("placeholder", "get_attr"):
                why = f"{group[0].name} is an input, parameter or buffer of the graph"
            else:
                why = "a view aliases it"
            leftover.append(Mutation(n, target, list(group), why))
            continue
        op, fn, args, kwargs = form
        want = _ev(target)
        with graph.inserting_after(n):
            new = graph.create_node(op, fn, args, kwargs, name=f"{n.name}_functional")
            copy_meta(n, new, example_value=False)
            set_example_value(new, _fake_run(op, fn, args, kwargs, fake_mode))
            if _ev(new).dtype != want.dtype:
                with graph.inserting_after(new):
                    cast = graph.call_method("to", (new, want.dtype))
                copy_meta(new, cast)
                set_example_value(cast, _fake_run("call_method", "to", (new, want.dtype), {}, fake_mode))
                new = cast
        latest[key], latest_at[key] = new, order[n]
        rewritten.append(n)
    for n in reversed(rewritten):
        if not n.users:
            graph.erase_node(n)
    graph.lint()
    out.recompile()
    if rewritten:
        log.info("dualkv: %d in-place op(s) made out-of-place: %s", len(rewritten), ", ".join(_op_name(n) for n in rewritten))
    return out, leftover


def mutation_refusal(leftover: list[Mutation], is_packed) -> Optional[str]:
    """Why the graph cannot be rewritten with these in-place ops left in it, or None.

    ``is_packed(node)``: whether the rewrite gives ``node`` a packed form
    (a value with token axes). An in-place op whose storage is shared with
    such a value, or that reads one, would change only one of its two forms.
    """
    for m in leftover:
        touched = [a for a in (*m.aliases, *m.node.all_input_nodes) if is_packed(a)]
        if touched:
            return (
                f"{m.node.name}: in-place {_op_name(m.node)} on {m.target.name} ({m.why}) touches "
                f"{touched[0].name}, a value of the packed region; the rewrite cannot carry the mutation"
            )
    return None
