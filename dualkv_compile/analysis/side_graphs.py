"""Small graphs cut from a graph the runners evaluate per call: its attention masks, the factors of padding reads.

Contract (``graph_returning``)
    Input: a graph, the nodes to return, and how many of its trailing
    placeholders (the packed graph's layout inputs) the copy must not read.
    Output: a ``GraphModule`` taking the same arguments (those trailing
    placeholders removed) that returns the nodes, holding only what they
    need: the nodes they read, and every in-place op that may write memory
    one of those values shares (a view of it, its base, a view of its base:
    ``m = mask.clone(); m[:, :2] = 0; ... m[:, 1:]``), with what that op reads,
    to a fixpoint. In-place ops on other values (veRL's ``pad_input``:
    ``output[indices] = hidden``) are left out, and with them the model.
    Where the copy cannot be evaluated on its own, its ``unusable`` says why
    (it would read a layout input, write a graph input, draw random numbers,
    or return a value written after the program read it); the caller must
    then treat its values as unknown. (The attention masks' copy, evaluated
    once, writes copies of the inputs instead.) ``source`` is not modified.

Aliasing is conservative: a value shares memory with every tensor it was made
from unless its op is known to allocate a new tensor (``_FRESH_*``, an aten op
whose schema declares no aliasing return); all graph inputs, parameters and
buffers count as one memory (a caller's tensors may overlap); values whose
example tensors share a storage share memory.
"""

from __future__ import annotations

import inspect
import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from ..graph.meta import ev
from ..normalize.functionalize import INPLACE_OPERATORS, inplace_param
from .token_axes import TokenAxes

__all__ = ["factor_graph", "graph_returning", "mask_graph"]

_OPERATORS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.matmul, operator.neg, operator.pos, operator.abs, operator.invert, operator.and_, operator.or_,
    operator.xor, operator.lshift, operator.rshift, operator.eq, operator.ne, operator.lt, operator.le,
    operator.gt, operator.ge, operator.not_, operator.truth,
}
# Ops whose result never shares memory with their inputs. Not here (they may return an input or a view of
# it): to, float, type_as, contiguous, reshape, detach, dropout (in eval mode), einsum, getitem ...
_FRESH_NAMES = (
    "abs add addmm all amax amin any arange argmax argmin baddbmm bernoulli bitwise_and bitwise_not bitwise_or "
    "bitwise_xor bmm cat ceil clamp clip clone concat concatenate cos cosh cumprod cumsum div divide empty "
    "empty_like eq erf exp exp2 expm1 eye flip floor floor_divide fmod full full_like gather ge gt index_select "
    "isfinite isinf isnan le log log10 log1p log2 log_softmax logical_and logical_not logical_or logical_xor "
    "logsumexp lt masked_fill masked_select matmul max maximum mean min minimum mm mul multinomial multiply ne neg "
    "nan_to_num nonzero norm normal ones ones_like outer pow prod rand rand_like randint randint_like randn "
    "randn_like randperm reciprocal remainder repeat_interleave roll round rsqrt sigmoid sign sin sinh softmax "
    "sqrt square stack std sub subtract sum take_along_dim tanh tensor tril triu true_divide trunc var where "
    "zeros zeros_like"
).split()
_FRESH_FUNCS = {getattr(torch, name) for name in _FRESH_NAMES if hasattr(torch, name)} | {
    F.linear, torch._C._nn.linear, F.embedding, F.pad, torch._C._nn.pad, F.softmax, F.log_softmax, F.cross_entropy,
    F.nll_loss, F.silu, F.gelu, torch._C._nn.gelu, F.relu, F.leaky_relu, F.elu, F.softplus, F.mish, F.hardtanh,
    F.tanh, F.sigmoid, F.normalize, F.layer_norm, F.rms_norm, F.group_norm, F.one_hot,
    F.scaled_dot_product_attention,
}
_FRESH_METHODS = set(_FRESH_NAMES) - {"arange", "cat", "concat", "concatenate", "empty", "eye", "full", "ones", "rand",
                                      "randint", "randn", "randperm", "stack", "tensor", "zeros"} | {
    "new_empty", "new_full", "new_ones", "new_tensor", "new_zeros", "repeat", "relu", "silu", "float_power",
    "__and__", "__or__", "__xor__", "__invert__", "__neg__", "__abs__", "__add__", "__radd__", "__sub__", "__rsub__",
    "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__floordiv__", "__mod__", "__pow__", "__rpow__",
    "__matmul__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
}
# Methods returning Python values (never a tensor).
_SCALAR_METHODS = {"size", "dim", "ndimension", "numel", "nelement", "item", "tolist", "stride", "is_contiguous",
                   "element_size", "get_device", "data_ptr", "__len__", "storage_offset", "is_floating_point"}
# Checks: they compute nothing a returned value needs, so they are left out unless needed.
_CHECKS = {torch._assert, torch._check, torch._check_is_size, getattr(torch, "_assert_async", None),
           torch.ops.aten._assert_async.default, torch.ops.aten._assert_async.msg, torch.ops.aten._assert_scalar.default,
           torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten.sym_constrain_range.default,
           torch.ops.aten.sym_constrain_range_for_size.default}
_RANDOM_FUNCS = set(getattr(torch._library.utils, "_RANDOM_FUNCTIONS", ())) | {
    torch.rand, torch.rand_like, torch.randn, torch.randn_like, torch.randint, torch.randint_like, torch.randperm,
    torch.bernoulli, torch.multinomial, torch.normal, torch.poisson, torch.dropout, F.dropout, F.dropout1d,
    F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, F.rrelu, F.gumbel_softmax,
}
_RANDOM_METHODS = {"bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_", "geometric_",
                   "cauchy_", "log_normal_", "multinomial"}


def _inplace_arg(n: fx.Node):
    """The value of ``n``'s ``inplace`` argument (``F.relu(x, inplace=True)``), False if it has none."""
    if "inplace" in n.kwargs:
        return n.kwargs["inplace"]
    if not inspect.isfunction(n.target):
        return False
    i = inplace_param(n.target)
    return n.args[i] if i is not None and len(n.args) > i else False


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def writes(n: fx.Node) -> list[fx.Node]:
    """The values ``n`` may change in place ([] if none). Unknown modules and higher-order ops: all they read."""
    first = [n.args[0]] if n.args and isinstance(n.args[0], fx.Node) else []
    if n.op == "call_module":
        return list(n.all_input_nodes)
    if n.op == "call_method":
        name = n.target
        inplace_dunder = name == "__setitem__" or (_dunder(name) and name.startswith("__i") and name[3:-2] in {
            "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift", "rshift"})
        return first if inplace_dunder or (name.endswith("_") and not _dunder(name)) else []
    if n.op != "call_function":
        return []
    target = n.target
    out = [a for a in tree_leaves(n.kwargs.get("out")) if isinstance(a, fx.Node)]
    if target is operator.setitem or target in INPLACE_OPERATORS:
        return out + first
    if target in _OPERATORS:  # operator.and_, or_, not_: out of place despite the name
        return out
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = getattr(target, "default", None)
        if target is None:
            return list(n.all_input_nodes)
    if isinstance(target, torch._ops.OpOverload):
        for i, arg in enumerate(target._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
                out += [a for a in tree_leaves(value) if isinstance(a, fx.Node)]
        return out
    if isinstance(target, torch._ops.HigherOrderOperator):
        return [] if "auto_functionalized" in str(target) else list(n.all_input_nodes)
    name = getattr(target, "__name__", "")
    if (name.endswith("_") and not _dunder(name)) or name in ("__setitem__", "__iadd__", "__imul__", "__isub__"):
        return out + list(n.all_input_nodes)
    if _inplace_arg(n) is not False:
        return out + first
    return out


def _random(n: fx.Node) -> bool:
    if n.op == "call_method":
        return n.target in _RANDOM_METHODS
    return n.op == "call_function" and (n.target in _RANDOM_FUNCS or getattr(n.target, "_nondeterministic_seeded", False))


def _other_effect(n: fx.Node, written: list) -> bool:
    """A side effect other than writing a value (grad mode, autocast, profiler ...): kept, with what it reads."""
    if n.op != "call_function" or written or n.target in _CHECKS or n.target is operator.setitem or _random(n):
        return False
    try:
        return n.is_impure()
    except Exception:  # noqa: BLE001 - cannot tell: kept
        return True


def _scalar(n: fx.Node) -> bool:
    """Whether ``n`` is known to be no tensor and to hold none (a size, a bool, None)."""
    if n.op == "call_function" and n.target is operator.setitem:
        return True  # returns None
    value = ev(n)
    if value is not None:  # no example value, or None: the op decides
        return not any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(value))
    if n.op == "call_method":
        return n.target in _SCALAR_METHODS
    return n.op == "call_function" and n.target in _OPERATORS and all(_scalar(a) for a in n.all_input_nodes)


def _fresh(n: fx.Node) -> bool:
    """Whether ``n``'s result is known to share memory with none of its inputs."""
    if _scalar(n):
        return True
    if n.op == "call_method":
        return n.target in _FRESH_METHODS and "out" not in n.kwargs
    if n.op != "call_function" or "out" in n.kwargs or writes(n):
        return False
    target = n.target
    if isinstance(target, torch._ops.OpOverload):
        return all(r.alias_info is None for r in target._schema.returns)
    if target in _OPERATORS:
        # ``[a] + [b]`` holds its inputs: only arithmetic on tensors and numbers allocates.
        args = (*n.args, *n.kwargs.values())
        return not any(isinstance(a, (list, tuple)) or isinstance(ev(a), (list, tuple)) for a in args)
    return target in _FRESH_FUNCS and _inplace_arg(n) is False


class _Memory:
    """Union-find over nodes: which values may share memory (see the module docstring)."""

    def __init__(self, graph: fx.Graph):
        self.parent: dict[fx.Node, fx.Node] = {}
        self.inputs: Optional[fx.Node] = None  # one node of the graph's inputs, parameters and buffers
        storages: dict = {}
        for n in graph.nodes:
            self.parent[n] = n
            if _scalar(n):
                continue
            if n.op in ("placeholder", "get_attr"):
                self.inputs = self.inputs or n
                self.union(n, self.inputs)
            elif not _fresh(n):
                for a in n.all_input_nodes:
                    if not _scalar(a):
                        self.union(n, a)
            for t in tree_leaves(ev(n)):
                if isinstance(t, torch.Tensor):
                    try:
                        key = StorageWeakRef(t.untyped_storage())
                    except (RuntimeError, NotImplementedError, AttributeError):
                        continue
                    self.union(n, storages.setdefault(key, n))

    def find(self, n: fx.Node) -> fx.Node:
        while self.parent[n] is not n:
            self.parent[n] = self.parent[self.parent[n]]
            n = self.parent[n]
        return n

    def union(self, a: fx.Node, b: fx.Node) -> None:
        self.parent[self.find(a)] = self.find(b)


_VIEW_NAMES = {
    "view", "transpose", "permute", "unsqueeze", "squeeze", "expand", "select", "narrow", "t", "as_strided",
    "unflatten", "view_as", "expand_as", "detach", "unfold", "diagonal", "movedim", "moveaxis", "swapaxes",
    "swapdims", "split", "chunk", "unbind", "alias",
}
_VIEW_FUNCS = {getattr(torch, name) for name in _VIEW_NAMES if hasattr(torch, name)}


def _view(n: fx.Node, of: fx.Node) -> bool:
    """Whether ``n`` is a view of ``of`` that reads no data (a basic slice, ``view``, ``transpose`` ...). Not
    ``reshape``, ``flatten``, ``to``, ``contiguous``: they may copy."""
    if not n.args or n.args[0] is not of:
        return False
    if n.op == "call_method":
        return n.target in _VIEW_NAMES
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
        return all(isinstance(i, (int, slice, type(None), type(Ellipsis))) or (isinstance(i, fx.Node) and _scalar(i))
                   for i in index) and all(not isinstance(a, fx.Node) or _scalar(a) for i in index
                                           if isinstance(i, slice) for a in (i.start, i.stop, i.step))
    return n.target in _VIEW_FUNCS


def _reads(r: fx.Node, written: dict) -> list[fx.Node]:
    """The nodes where the program reads the data of ``r`` (through views of it), in-place writes left out."""
    reads, stack = [], [r]
    while stack:
        v = stack.pop()
        for u in v.users:
            if written.get(u):
                continue
            if _view(u, v):
                stack.append(u)
            else:
                reads.append(u)
    return reads


def _closure(roots, needed: set) -> None:
    stack = [r for r in roots if r not in needed]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        stack.extend(a for a in n.all_input_nodes if a not in needed)


def needed_nodes(graph: fx.Graph, returned: list) -> tuple[set, list, list, Optional[str]]:
    """What ``returned`` needs (see the module docstring): the nodes, the in-place ops and other side effects
    among them, those of the ops that may write a graph input, parameter or buffer, and why else the copy
    cannot run on its own, or None."""
    memory = _Memory(graph)
    needed: set = set()
    _closure(returned, needed)
    shared = {memory.find(n) for n in needed}
    written = {n: writes(n) for n in graph.nodes if n.op not in ("placeholder", "output")}
    kept: list[fx.Node] = []
    changed = True
    while changed:  # to a fixpoint: what a kept op reads may share memory another op writes
        changed = False
        for n, w in written.items():
            if n not in needed and (_other_effect(n, w) or any(memory.find(a) in shared for a in w)):
                kept.append(n)
                before = set(needed)
                _closure([n], needed)
                shared |= {memory.find(a) for a in needed - before}
                changed = True
    inputs = memory.find(memory.inputs) if memory.inputs is not None else None
    input_writes = [n for n in kept if any(memory.find(w) == inputs for w in written[n])]
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in kept:
        for w in written[n]:
            # The copy returns the value after every write; the program read it where it used it.
            late = [r for r in returned if memory.find(r) == memory.find(w) and any(
                order[n] > order[u] for u in _reads(r, written))]
            if late:
                return needed, kept, input_writes, f"{late[0].name} may be written in place ({_name(n)}, {n.name}) after it is read"
    random = next((n for n in needed if _random(n)), None)
    if random is not None:
        return needed, kept, input_writes, f"{random.name} draws random numbers"
    return needed, kept, input_writes, None


def _name(n: fx.Node) -> str:
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))


def graph_returning(
    source: fx.GraphModule, nodes: list, class_name: str, drop_trailing: int = 0, copy_written_inputs: bool = False
) -> Optional[fx.GraphModule]:
    """A copy of ``source`` that returns ``nodes`` (a tuple), with what they do not need removed; None if no nodes.

    ``drop_trailing``: trailing placeholders (the packed graph's layout inputs) removed, so the copy takes
    the call's own arguments. The copy's ``unusable`` is None, or why it cannot be evaluated on its own
    (see the module docstring): then its values are unknown. ``copy_written_inputs``: where an in-place op
    it needs may write a graph input, parameter or buffer, the copy reads copies of the inputs it reads
    instead of being unusable (the caller's tensors must not be written twice; inputs that overlap in
    memory are then taken apart).
    """
    if not nodes:
        return None
    needed, kept, input_writes, unusable = needed_nodes(source.graph, nodes)
    if input_writes and not copy_written_inputs and unusable is None:
        n = input_writes[0]
        unusable = f"in-place {_name(n)} ({n.name}) may write a graph input, parameter or buffer"
    placeholders = list(source.graph.find_nodes(op="placeholder"))
    dropped = placeholders[len(placeholders) - drop_trailing:] if drop_trailing else []
    read = [p.name for p in dropped if p in needed]
    if read and unusable is None:
        ops = ", ".join(f"{_name(n)} ({n.name})" for n in kept[:3])
        who = f"an in-place op that may write them, {ops}," if kept else "it"
        unusable = f"{who} would read the packed program's {', '.join(read[:3])}"
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    copied: list[fx.Node] = []
    for n in source.graph.nodes:
        if (n.op == "placeholder" and n not in dropped) or (n in needed and n.op != "output"):
            env[n] = g.node_copy(n, lambda a: env[a])
            if input_writes and copy_written_inputs and n in needed and n.op in ("placeholder", "get_attr") and not _scalar(n):
                copied.append(n)
        if copied and (n.op != "placeholder" or n.next.op != "placeholder"):
            for c in copied:  # after the last placeholder (a get_attr: where it is)
                env[c] = g.call_method("clone", (env[c],))
            copied = []
    g.output(tuple(env[n] for n in nodes))
    gm = fx.GraphModule(source, g, class_name=class_name)
    gm.unusable = unusable
    return gm


def mask_graph(gm: fx.GraphModule, axes: TokenAxes) -> Optional[fx.GraphModule]:
    """A copy of ``gm`` that returns the attention masks (as the original graph builds them)."""
    # Evaluated once, on the first call that would pack (the mask check): it must not write the caller's tensors.
    masks = [m.mask for m in axes.attention if m.mask is not None]
    return graph_returning(gm, masks, "AttentionMasks", copy_written_inputs=True)


def factor_graph(source: fx.GraphModule, nodes: list, layout_inputs: int) -> Optional[fx.GraphModule]:
    """A copy of ``source`` returning ``nodes`` (the factors of padding reads) from the call's own inputs.

    ``layout_inputs``: trailing placeholders of ``source`` (the packed graph's layout inputs). The factors
    read none (``find_padding_reads`` checked), but an in-place op that may write one of them can: then, as
    for any other reason in ``unusable``, the caller treats the factors as unknown.
    """
    gm = graph_returning(source, nodes, "PaddingReadFactors", drop_trailing=layout_inputs)
    if gm is not None:
        gm.factor_nodes = nodes
    return gm
