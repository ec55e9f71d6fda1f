"""Fusion: the packed graph's next-token log-probs from the lm_head in chunks (``dualkv::linear_log_prob``).

Contract
    Input: a packed ``GraphModule`` (``pack_graph``'s output), a chunk
    budget in bytes and, optionally, the example inputs of its original
    placeholders (which come first among its own).
    Output: the same module, rewritten in place, and a ``FusedLogProbs``:
    the number of fusions and the scalar inputs baked into them. Each fused
    site computes the same values as before (up to the rounding of the
    log-softmax's reduction, see ``kernels.linear_log_prob``) and feeds the
    same consumers; every other node is left as it was.

Matched
    ``gather_previous(logp, prev_index, index)`` where

    - ``logp`` is ``torch.log_softmax(x, dim=-1)`` (or ``dim=2``; also the
      ``Tensor.log_softmax`` method and ``torch.nn.functional.log_softmax``,
      no ``dtype``);
    - ``x`` comes from ``torch._C._nn.linear(h, w)`` (``F.linear``; no bias)
      through nothing but full-slice ``getitem`` (identities), at most one
      multiply or divide by a number, and at most one cast to float32
      (``.float()``, ``.to(torch.float32)``), in either order;
    - the linear's output, every node of that chain and ``logp`` each have
      exactly one user.

    It becomes ``linear_log_prob(h[0], w, prev_index, index[0], ...)[0]
    .unsqueeze(0)``: ``h[0]`` and ``index[0]`` drop the packed batch axis of
    size 1 exactly as ``gather_previous`` reads ``x[0]`` and ``index[0]``.
    The ``[1, T, V]`` logits and log-probs, and their gradients, are never
    built; the op's backward recomputes the logits chunk by chunk.

    Also ``gather_unpacked(logp, unpack_index, valid, index)`` (labels from
    outside the graph, veRL's rolled ids), the chain there may include one
    ``squeeze(0)`` of the packed batch axis (veRL's ``logits.squeeze(0)``):
    it becomes ``linear_log_prob(h, w, unpack_index, index.reshape(-1, K))``,
    zeros at padding (``torch.where(valid)``), viewed as ``index``; the
    result carries ``PICKED_META`` so ``runtime.padding_reads`` still sees
    a value that is zero where the original had one.

    The number is a Python constant, or a graph input: with
    ``dynamic=True`` Dynamo lifts a float it can read from somewhere (a
    temperature given as a function default or an attribute) as a 0-dim
    tensor input read by ``.item()``. Such a value is taken from the
    example inputs and baked in, like ``pack_graph``'s attention scale; the
    result lists it in ``scalar_checks`` (placeholder index, value, what)
    for the caller to compare on every call, since a packed graph built for
    one temperature is wrong for another.

Not matched (left unchanged, the reason logged at DEBUG on the
"dualkv_compile" logger): a second user of the logits or log-probs (an
entropy or KL-over-vocabulary term reads them whole), a bias, two scalar
ops or two casts, any other op in the chain (a softcap), a temperature
tensor (not a lifted float), a scale read from an input with no example
input to resolve it, a ``dtype`` argument to the log-softmax, nodes tagged
for activation-checkpoint recomputation, and autocast (in the graph, or
enabled while the pass runs: Dynamo compiles a graph for the caller's
autocast state, and the op runs in its inputs' dtypes, not autocast's).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from typing import Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..kernels.linear_log_prob import DEFAULT_CHUNK_BYTES
from ..ops import linear_log_prob as _op  # noqa: F401  (registers torch.ops.dualkv.linear_log_prob)
from ..analysis.attention_match import item_of_placeholder
from ..analysis.node_info import ev
from .inline_checkpoint import RECOMPUTE_META
from .packed_ops import PICKED_META, gather_previous, gather_unpacked

log = logging.getLogger("dualkv_compile")

__all__ = ["fuse_linear_log_prob", "FusedLogProbs"]

_LINEAR = (torch._C._nn.linear, F.linear)
_LOG_SOFTMAX = (torch.log_softmax, F.log_softmax, torch.special.log_softmax)
_DIVIDE_FUNCTIONS = (operator.truediv, torch.div, torch.true_divide)
_MULTIPLY_FUNCTIONS = (operator.mul, torch.mul)
_DIVIDE_METHODS = ("div", "true_divide", "__truediv__")
_MULTIPLY_METHODS = ("mul", "multiply", "__mul__", "__rmul__")
_AUTOCAST = ("_enter_autocast", "_exit_autocast")


@dataclasses.dataclass
class FusedLogProbs:
    """What ``fuse_linear_log_prob`` did: sites fused, and the graph inputs baked in as ``(index, value, what)``."""

    count: int = 0
    scalar_checks: list[tuple[int, float, str]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Site:
    """One matched next-token gather: the nodes it replaces (consumer first) and the op's arguments."""

    gather: fx.Node
    replaced: list[fx.Node]
    hidden: fx.Node
    weight: fx.Node
    scale: float = 1.0
    divide: bool = False
    scale_first: bool = True
    upcast: bool = False
    scale_node: Optional[fx.Node] = None  # the ``.item()`` or placeholder the scale was read from
    scale_check: Optional[tuple[int, float, str]] = None
    squeezed: bool = False  # a batch squeeze(0) between the lm_head and the log-softmax (gather_unpacked only)


def _is_call(n, functions=(), methods=()) -> bool:
    if not isinstance(n, fx.Node):
        return False
    if n.op == "call_function":
        return any(n.target is f for f in functions)
    return n.op == "call_method" and n.target in methods


def _is_identity_getitem(n: fx.Node) -> bool:
    if not (n.op == "call_function" and n.target is operator.getitem and len(n.args) == 2):
        return False
    idx = n.args[1]
    idx = idx if isinstance(idx, tuple) else (idx,)
    return all(i is Ellipsis or i == slice(None, None, None) for i in idx)


def _is_batch_squeeze(n: fx.Node) -> bool:
    """``x.squeeze(0)`` (or ``torch.squeeze(x, 0)``) of the packed ``[1, T, V]`` logits: veRL's ``logits.squeeze(0)``.

    Only ``gather_unpacked`` reads through it (its rows index the packed stream either way)."""
    if not (n.op == "call_method" and n.target == "squeeze" or n.op == "call_function" and n.target is torch.squeeze):
        return False
    return len(n.args) == 2 and n.args[1] == 0 and not n.kwargs


def _python_scale(s) -> Optional[float]:
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s == 0:
        return None
    return float(s)


def _input_scalar(n) -> Optional[fx.Node]:
    """The placeholder a Python number is read from: ``placeholder.item()`` of a 0-dim float tensor (a float lifted
    by Dynamo), or a SymFloat placeholder; else None."""
    if not isinstance(n, fx.Node):
        return None
    src = item_of_placeholder(n)
    if src is not None:
        ev = src.meta.get("example_value")
        return src if isinstance(ev, torch.Tensor) and ev.dim() == 0 and ev.dtype.is_floating_point else None
    if n.op == "placeholder" and isinstance(n.meta.get("example_value"), (float, torch.SymFloat)):
        return n
    return None


def _scalar_op(n: fx.Node) -> "Optional[tuple[fx.Node, float | fx.Node, bool]] | str":
    """(tensor operand, scale, divide) if ``n`` multiplies or divides by a number, the scale a Python number or the
    node reading it from an input; why not if it is a multiply/divide otherwise; None if it is neither."""
    divide = _is_call(n, _DIVIDE_FUNCTIONS, _DIVIDE_METHODS)
    multiply = _is_call(n, _MULTIPLY_FUNCTIONS, _MULTIPLY_METHODS)
    if not (divide or multiply):
        return None
    if len(n.args) != 2 or n.kwargs:
        return f"{n.name}: a {'divide' if divide else 'multiply'} with arguments {n.args} {dict(n.kwargs)}, not tensor and number"
    a, b = n.args
    if multiply and (not isinstance(a, fx.Node) or _input_scalar(a) is not None):
        a, b = b, a  # number * tensor
    scale = b if _input_scalar(b) is not None else _python_scale(b)
    if not isinstance(a, fx.Node) or scale is None:
        return f"{n.name}: {'divides' if divide else 'multiplies'} by {b!r}, not a finite nonzero Python number"
    return a, scale, divide


def _resolve_scale(site: _Site, placeholders: list[fx.Node], example_inputs) -> Optional[str]:
    """Bake a scale read from a graph input into ``site``, from the example inputs; why not if it cannot be."""
    src = _input_scalar(site.scale_node)
    index = placeholders.index(src)
    if example_inputs is None or index >= len(example_inputs):
        return f"{site.scale_node.name}: the scale is read from the input {src.name}, and no example input resolves it"
    value = _python_scale(float(example_inputs[index]))
    if value is None:
        return f"{site.scale_node.name}: the scale read from {src.name} is {float(example_inputs[index])!r}, not finite and nonzero"
    site.scale = value
    site.scale_check = (index, value, f"{site.gather.name}: the log-softmax's scale {src.name}")
    return None


def _upcast_operand(n: fx.Node) -> Optional[fx.Node]:
    """The tensor ``n`` casts to float32 (``.float()``, ``.to(torch.float32)``), else None."""
    if n.op != "call_method" or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    if n.target == "float" and len(n.args) == 1 and not n.kwargs:
        return n.args[0]
    if n.target == "to":
        if len(n.args) == 2 and not n.kwargs and n.args[1] == torch.float32:
            return n.args[0]
        if len(n.args) == 1 and dict(n.kwargs) == {"dtype": torch.float32}:
            return n.args[0]
    return None


def _log_softmax_input(n: fx.Node) -> "fx.Node | str":
    """The input of ``n`` if it is a log-softmax over the last dim of a 3-D value, else why not."""
    if not _is_call(n, _LOG_SOFTMAX, ("log_softmax",)):
        return f"the gathered log-probs come from {n.format_node()}, not a log_softmax"
    if not n.args or not isinstance(n.args[0], fx.Node):
        return f"{n.name}: log_softmax without a tensor input"
    kwargs = dict(n.kwargs)
    dim = n.args[1] if len(n.args) > 1 else kwargs.pop("dim", None)
    kwargs.pop("_stacklevel", None)
    if kwargs.pop("dtype", None) is not None or len(n.args) > 2 or kwargs:
        return f"{n.name}: log_softmax with further arguments {n.args[2:]} {dict(n.kwargs)}"
    if dim not in (-1, 2):
        return f"{n.name}: log_softmax over dim {dim!r}, not the vocabulary (last) dim"
    return n.args[0]


def _linear_operands(n: fx.Node) -> "tuple[fx.Node, fx.Node] | str":
    args = list(n.args) + [None] * (3 - len(n.args))
    h, w, bias = args[0], args[1], n.kwargs.get("bias", args[2])
    if set(n.kwargs) - {"bias"} or len(n.args) > 3:
        return f"{n.name}: linear with arguments {n.args} {dict(n.kwargs)}"
    if bias is not None:
        return f"{n.name}: the lm_head has a bias"
    if not isinstance(h, fx.Node) or not isinstance(w, fx.Node):
        return f"{n.name}: linear of non-tensor operands"
    return h, w


def _match(gather: fx.Node) -> Union[_Site, str]:
    """The fusable site ending at ``gather``, else why it is not one."""
    if len(gather.args) != (4 if gather.target is gather_unpacked else 3) or gather.kwargs:
        return f"{gather.target.__name__} called with unexpected arguments"
    logp = gather.args[0]
    if not isinstance(logp, fx.Node):
        return "the gathered value is not a node"
    x = _log_softmax_input(logp)
    if isinstance(x, str):
        return x
    replaced = [gather, logp]
    scale_op: "Optional[tuple[float | fx.Node, bool]]" = None
    upcast_seen = scale_first = squeezed = False
    node = x
    # Walk from the log-softmax back to the lm_head, consumer to producer.
    while not _is_call(node, _LINEAR):
        scalar = _scalar_op(node)
        upcast_in = _upcast_operand(node)
        if isinstance(scalar, str):
            return scalar
        if scalar is not None:
            if scale_op is not None:
                return f"{node.name}: a second multiply/divide between the lm_head and the log_softmax"
            node_in, scale, divide = scalar
            scale_op = (scale, divide)
            scale_first = upcast_seen  # the cast, already passed walking backwards, comes after it
        elif upcast_in is not None:
            if upcast_seen:
                return f"{node.name}: a second cast between the lm_head and the log_softmax"
            upcast_seen, node_in = True, upcast_in
        elif _is_identity_getitem(node):
            node_in = node.args[0]
        elif _is_batch_squeeze(node) and gather.target is gather_unpacked:
            squeezed, node_in = True, node.args[0]
        else:
            return f"{node.format_node()} between the lm_head and the log_softmax (only full slices, one scalar multiply/divide and one .float() are fused)"
        replaced.append(node)
        node = node_in
    replaced.append(node)
    operands = _linear_operands(node)
    if isinstance(operands, str):
        return operands
    for n in replaced[1:]:
        if len(n.users) != 1:
            users = ", ".join(u.name for u in n.users)
            return f"{n.name} has {len(n.users)} users ({users}): it would still be needed whole"
    for n in replaced:
        if any(k in n.meta for k in RECOMPUTE_META):
            return f"{n.name} is inside an activation-checkpoint region"
    site = _Site(gather, replaced, *operands, upcast=upcast_seen, squeezed=squeezed)
    if scale_op is not None:
        scale, site.divide = scale_op
        if isinstance(scale, fx.Node):
            site.scale_node = scale
        else:
            site.scale = scale
        site.scale_first = scale_first or not upcast_seen
    return site


def _rewrite_unpacked(graph: fx.Graph, site: _Site, chunk_bytes: int) -> None:
    """``gather_unpacked(logp, unpack_index, valid, index)``: the op reads row ``unpack_index[p]`` for each position p
    of the original layout, at its labels ``index[p]``; zeros at padding, as ``gather_unpacked`` gives."""
    gather = site.gather
    _, unpack_index, valid, index = gather.args
    merged = ev(index).dim() == 2  # [B * S, K]: the logits were [T, V] (squeezed after the lm_head or before it)
    with graph.inserting_before(gather):
        hidden = site.hidden
        if site.squeezed or not merged:
            hidden = graph.call_function(operator.getitem, (site.hidden, 0), name="lm_head_input")
        k = graph.call_method("size", (index, -1))
        labels = graph.create_node("call_method", "reshape", (index, -1, k), name="labels")
        post = dict(scale=site.scale, divide=site.divide, scale_first=site.scale_first, upcast=site.upcast)
        res = graph.call_function(
            torch.ops.dualkv.linear_log_prob.default, (hidden, site.weight, unpack_index, labels),
            {**post, "chunk_bytes": chunk_bytes}, name="linear_log_prob",
        )
        out = graph.call_function(operator.getitem, (res, 0), name="picked_logp")
        keep = graph.call_method("unsqueeze", (valid, -1))
        zero = graph.call_method("new_zeros", (out, ()))
        masked = graph.call_function(torch.where, (keep, out, zero))
        fused = graph.create_node("call_method", "view_as", (masked, index), name=f"{gather.name}_fused")
    # Still zero at padding where the original had values: runtime.padding_reads must keep following it.
    fused.meta[PICKED_META] = ev(index).dim()
    fused.meta["unpacked_rank"] = ev(index).dim()
    _replace(graph, site, fused)


def _replace(graph: fx.Graph, site: _Site, fused: fx.Node) -> None:
    site.gather.replace_all_uses_with(fused)
    for n in site.replaced:  # consumer first: each has no user left when erased
        graph.erase_node(n)
    if site.scale_node is not None and site.scale_node.op != "placeholder" and not site.scale_node.users:
        graph.erase_node(site.scale_node)


def _rewrite(graph: fx.Graph, site: _Site, chunk_bytes: int) -> None:
    gather = site.gather
    if gather.target is gather_unpacked:
        return _rewrite_unpacked(graph, site, chunk_bytes)
    _, prev_index, index = gather.args
    with graph.inserting_before(gather):
        hidden = graph.call_function(operator.getitem, (site.hidden, 0), name="lm_head_input")
        next_ids = graph.call_function(operator.getitem, (index, 0), name="next_ids")
        post = dict(scale=site.scale, divide=site.divide, scale_first=site.scale_first, upcast=site.upcast)
        res = graph.call_function(
            torch.ops.dualkv.linear_log_prob.default,
            (hidden, site.weight, prev_index, next_ids),
            {**post, "chunk_bytes": chunk_bytes},
            name="linear_log_prob",
        )
        out = graph.call_function(operator.getitem, (res, 0), name="next_token_logp")
        fused = graph.create_node("call_method", "unsqueeze", (out, 0), name=f"{gather.name}_fused")
    _replace(graph, site, fused)


def _autocast_reason(graph: fx.Graph) -> Optional[str]:
    for n in graph.nodes:
        if n.op == "call_function" and getattr(n.target, "__name__", None) in _AUTOCAST:
            return "the graph has an autocast region"
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return f"autocast is enabled for {device} while compiling"
    return None


def fuse_linear_log_prob(
    gm: fx.GraphModule, chunk_bytes: int = DEFAULT_CHUNK_BYTES, example_inputs: Optional[Sequence] = None
) -> FusedLogProbs:
    """Fuse each lm_head -> log_softmax -> next-token gather of ``gm`` into ``dualkv::linear_log_prob``.

    Rewrites ``gm`` in place (see the module docstring for what matches and
    for ``example_inputs``); a result with ``count == 0`` left it untouched.
    """
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    result = FusedLogProbs()
    gathers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (gather_previous, gather_unpacked)]
    if not gathers:
        return result
    why = _autocast_reason(gm.graph)
    if why is not None:
        log.debug("dualkv: next-token log-probs left unfused: %s", why)
        return result
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for gather in gathers:
        site = _match(gather)
        if isinstance(site, _Site) and site.scale_node is not None:
            why = _resolve_scale(site, placeholders, example_inputs)
            site = site if why is None else why
        if isinstance(site, str):
            log.debug("dualkv: %s left unfused: %s", gather.name, site)
            continue
        _rewrite(gm.graph, site, chunk_bytes)
        result.count += 1
        if site.scale_check is not None:
            result.scalar_checks.append(site.scale_check)
    if result.count:
        gm.graph.lint()
        gm.recompile()
        log.debug(
            "dualkv: fused %d next-token log-prob gather(s) with their lm_head (chunks of %d bytes)", result.count, chunk_bytes
        )
    return result
