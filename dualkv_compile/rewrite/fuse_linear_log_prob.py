"""Fusion: the packed graph's next-token log-probs (and entropy) from the lm_head in chunks (``dualkv::linear_log_prob``).

Contract
    Input: a packed ``GraphModule`` (``pack_graph``'s output), a chunk budget in bytes, optionally the example
    inputs of its original placeholders (which come first among its own), and whether to fuse entropies
    (``entropy``, default True; False under sequence parallelism, where the op's entropy would cover every
    gathered row). Output: the same module, rewritten in place, and a ``FusedLogProbs``: how many sites fused,
    how many with an entropy, and the scalar inputs baked in (``scalar_checks``: a lifted temperature, compared by
    the caller on every call). Each fused site computes the same values as before (up to the log-softmax's
    rounding: ``kernels.linear_log_prob``) and feeds the same consumers; every other node is left as it was.

Matched: ``gather_previous(logp, prev_index, index)``, or ``gather_unpacked(logp, unpack_index, valid, index)``
(veRL's rolled ids; the result keeps a picked rank, ``graph.meta.set_picked_rank``), of ``logp = log_softmax(x,
-1)``, ``x`` from ``F.linear(h, w)`` (no bias) through nothing but identities, at most one multiply or divide by
a number (a constant, or a lifted float) and at most one cast to float32, each node with one user. It becomes
``linear_log_prob(h[0], w, rows, index[0], ...)``: the ``[1, T, V]`` logits and log-probs and their gradients
are never built. With an entropy of the same log-probs or logits (``entropy_pattern``'s spellings) the op is
``dualkv::linear_log_prob_entropy``, whose second output replaces the pattern's result; an entropy read with no
gather becomes the same op with no rows to pick.

Not matched, by one rule: a site fuses only where the op computes exactly what the chain computed and nothing
else reads the chain's values; anything else (another reader, another op in the chain, a dtype the op would not
reproduce, recompute tags, an autocast region) stays as it is, the reason logged at DEBUG on the "dualkv_compile"
logger (the cases: docs/design.md, "Log-prob fusion").
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Optional, Sequence, Union

import torch
import torch.fx as fx

from ..kernels.linear_log_prob import DEFAULT_CHUNK_BYTES
from ..ops import linear_log_prob as _op  # noqa: F401  (registers torch.ops.dualkv.linear_log_prob and _entropy)
from ..graph import is_call as _is_call
from ..graph.meta import ev, in_checkpoint_region, set_picked_rank, set_unpacked_rank
from ..layout.packed_ops import gather_previous, gather_unpacked
from .entropy_pattern import EntropyMatch, log_prob_entropy, logit_entropy
from .lm_head_pattern import (
    LINEAR, LOG_SOFTMAX, SOFTMAX, batch_squeeze, example_value, identity_getitem, input_scalar, linear_operands,
    log_softmax_input, python_scale, scalar_op, upcast_operand,
)

log = logging.getLogger("dualkv_compile")

__all__ = ["fuse_linear_log_prob", "FusedLogProbs"]

_AUTOCAST = ("_enter_autocast", "_exit_autocast")


@dataclasses.dataclass
class FusedLogProbs:
    """What ``fuse_linear_log_prob`` did: sites fused (each now one op call; an entropy-only site included),
    how many of them with their entropy, and the graph inputs baked in as ``(index, value, what)``."""

    count: int = 0
    entropy: int = 0
    scalar_checks: list[tuple[int, float, str]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Site:
    """One matched site: the nodes it replaces (consumer first) and the op's arguments. ``gather`` is None for an
    entropy alone; ``logp`` None for veRL's entropy alone (no log-softmax)."""

    gather: Optional[fx.Node]
    logp: Optional[fx.Node]
    replaced: list[fx.Node]
    hidden: fx.Node
    weight: fx.Node
    scale: float = 1.0
    divide: bool = False
    scale_first: bool = True
    upcast: bool = False
    scale_node: Optional[fx.Node] = None  # the ``.item()`` or placeholder the scale was read from
    scale_check: Optional[tuple[int, float, str]] = None
    entropy: Optional[EntropyMatch] = None
    squeezed: bool = False  # a batch squeeze(0) between the lm_head and the log-softmax (gather_unpacked only)
    cast_to: Optional[torch.dtype] = None  # the autocast dtype the lm_head ran in (ambient autocast): the op's inputs

    @property
    def name(self) -> str:
        return (self.gather or self.entropy.final).name


def _resolve_scale(site: _Site, placeholders: list[fx.Node], example_inputs) -> Optional[str]:
    """Bake a scale read from a graph input into ``site``, from the example inputs; why not if it cannot be."""
    src = input_scalar(site.scale_node)
    index = placeholders.index(src)
    if example_inputs is None or index >= len(example_inputs):
        return f"{site.scale_node.name}: the scale is read from the input {src.name}, and no example input resolves it"
    value = python_scale(float(example_inputs[index]))
    if value is None:
        return f"{site.scale_node.name}: the scale read from {src.name} is {float(example_inputs[index])!r}, not finite and nonzero"
    site.scale = value
    site.scale_check = (index, value, f"{site.name}: the log-softmax's scale {src.name}")
    return None


def _match(gather: fx.Node, entropy: bool) -> Union[_Site, str]:
    """The fusable site ending at ``gather``, with an entropy of the same log-probs if ``entropy``, else why not."""
    if len(gather.args) != (4 if gather.target is gather_unpacked else 3) or gather.kwargs:
        return f"{gather.target.__name__} called with unexpected arguments"
    logp = gather.args[0]
    if not isinstance(logp, fx.Node):
        return "the gathered value is not a node"
    x = log_softmax_input(logp)
    if isinstance(x, str):
        return x
    return _match_chain(gather, logp, x, entropy)


def _match_chain(gather: Optional[fx.Node], logp: Optional[fx.Node], x: fx.Node, entropy: bool) -> Union[_Site, str]:
    """The site reading ``x`` (the log-softmax's input): its chain back to the lm_head, and who reads what."""
    replaced = [n for n in (gather, logp) if n is not None]
    scale_op: "Optional[tuple[float | fx.Node, bool]]" = None
    upcast_seen = scale_first = squeezed = False
    node = x
    # Walk from the log-softmax back to the lm_head, consumer to producer.
    while not _is_call(node, LINEAR):
        scalar = scalar_op(node)
        upcast_in = upcast_operand(node)
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
        elif identity_getitem(node):
            node_in = node.args[0]
        elif batch_squeeze(node) and gather is not None and gather.target is gather_unpacked:
            squeezed, node_in = True, node.args[0]
        else:
            return f"{node.format_node()} between the lm_head and the log_softmax (only full slices, one scalar multiply/divide and one .float() are fused)"
        replaced.append(node)
        node = node_in
    replaced.append(node)
    operands = linear_operands(node)
    if isinstance(operands, str):
        return operands
    found = _entropy_reader(gather, logp, x, entropy)
    if isinstance(found, str):
        return found
    expected = {n: {u} for u, n in zip(replaced, replaced[1:])}  # each node's one user: the next toward the gather
    if found is not None:
        source = logp if found.readers <= set(logp.users if logp is not None else ()) else x
        expected[source] = expected.get(source, set()) | found.readers
    for n in replaced[1:] if gather is not None else replaced:
        if set(n.users) != expected.get(n, set()):
            users = ", ".join(u.name for u in n.users)
            return f"{n.name} has {len(n.users)} users ({users}): it would still be needed whole"
    for n in replaced + (found.nodes if found is not None else []):
        if in_checkpoint_region(n):
            return f"{n.name} is inside an activation-checkpoint region"
    site = _Site(gather, logp, replaced, *operands, upcast=upcast_seen, entropy=found, squeezed=squeezed)
    if scale_op is not None:
        scale, site.divide = scale_op
        if isinstance(scale, fx.Node):
            site.scale_node = scale
        else:
            site.scale = scale
        site.scale_first = scale_first or not upcast_seen
    return site


def _entropy_reader(gather, logp, x, entropy: bool) -> "Optional[EntropyMatch] | str":
    """The entropy among the readers of ``logp`` (besides ``gather``) or of ``x`` (besides ``logp``): None if they
    have no other reader, why not if they do and it is not an entropy (or ``entropy`` is off)."""
    candidates = []
    if logp is not None and set(logp.users) - {gather}:
        candidates.append((logp, set(logp.users) - {gather}, log_prob_entropy))
    if set(x.users) - {logp}:
        candidates.append((x, set(x.users) - {logp}, logit_entropy))
    if not candidates:
        return None
    source, readers, match = candidates[0]
    names = ", ".join(sorted(u.name for u in source.users))
    head = f"{source.name} has {len(source.users)} users ({names}): it would still be needed whole"
    if len(candidates) > 1:
        return f"{head} (and {x.name} is read besides the log_softmax too)"
    if not entropy:
        return f"{head} (entropy fusion is off)"
    found = match(source, readers)
    return f"{head} ({found})" if isinstance(found, str) else found


def _autocast_site_reason(site: _Site, placeholders: list[fx.Node], example_inputs) -> Optional[str]:
    """Under ambient autocast (Dynamo compiles a graph for the caller's autocast state): the lm_head ran in the
    autocast dtype, so the op gets its inputs cast to it (``site.cast_to``) and runs with autocast off. Only with
    the ``.float()`` before the log-softmax: then every op after the lm_head computes in the dtypes the chain
    gives, whatever autocast's policy for it. Why not, if not."""
    weight = example_value(site.weight, placeholders, example_inputs)
    if weight is None:
        return f"{site.name}: autocast is on and the lm_head weight's device is unknown"
    device = weight.device.type
    if not torch.is_autocast_enabled(device):
        return None
    if not site.upcast:
        return f"{site.name}: autocast ({device}) is on and the log-softmax's input is not cast to float32 in the graph"
    site.cast_to = torch.get_autocast_dtype(device)
    return None


def _entropy_reason(site: _Site, placeholders: list[fx.Node], example_inputs) -> Optional[str]:
    """Why the op's entropy (float32, float64 for float64 logits) would not have the graph's dtype, if it would not."""
    if site.upcast:
        return None  # the log-softmax runs in float32, the op's entropy dtype
    weight = example_value(site.weight, placeholders, example_inputs)
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else None
    if dtype is None:
        return f"{site.entropy.final.name}: the entropy's dtype is unknown (no example value of {site.weight.name})"
    if dtype not in (torch.float32, torch.float64):
        return f"{site.entropy.final.name}: the graph computes the entropy in {dtype}; the fused op computes it in float32"
    return None


def _insertion_point(site: _Site, graph: fx.Graph) -> "fx.Node | str":
    """Where the op goes: before the first node it replaces, if its inputs are computed by then."""
    if site.entropy is None:
        return site.gather
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min((n for n in (site.gather, *site.entropy.nodes) if n is not None), key=order.__getitem__)
    inputs = [site.hidden, site.weight, *(site.gather.args[1:] if site.gather is not None else ())]
    if all(order[n] < order[first] for n in inputs if isinstance(n, fx.Node)):
        return first
    if all(order[u] > order[site.gather] for u in site.entropy.final.users):
        return site.gather  # the next-token ids are computed after the entropy, which is read after the gather
    return f"{site.entropy.final.name} is read before the next-token ids of {site.gather.name} are computed"


def _rewrite(graph: fx.Graph, site: _Site, where: fx.Node, chunk_bytes: int) -> None:
    gather, ent = site.gather, site.entropy
    picked = gather is not None and gather.target is gather_unpacked
    # [T, V] logits: squeezed after the lm_head, or (a [B * S, K] index without a squeeze) before it.
    merged = site.squeezed or (picked and ev(gather.args[3]).dim() == 2)
    with graph.inserting_before(where):
        hidden, weight = site.hidden, site.weight
        if site.squeezed or not merged:
            hidden = graph.call_function(operator.getitem, (site.hidden, 0), name="lm_head_input")
        if site.cast_to is not None:  # as autocast cast the lm_head's operands (a no-op where they have its dtype)
            hidden = graph.call_method("to", (hidden, site.cast_to))
            weight = graph.call_method("to", (site.weight, site.cast_to))
        if picked:
            _, prev_index, valid, index = gather.args  # the rows are unpack_index: each original position's
            k = graph.call_method("size", (index, -1))
            next_ids = graph.create_node("call_method", "reshape", (index, -1, k), name="labels")
        elif gather is not None:
            _, prev_index, index = gather.args
            next_ids = graph.call_function(operator.getitem, (index, 0), name="next_ids")
        else:  # the entropy alone: no log-probs picked
            prev_index = graph.call_method("new_zeros", (hidden, (0,)), {"dtype": torch.int64})
            next_ids = graph.call_method("new_zeros", (hidden, (0, 1)), {"dtype": torch.int64})
        post = dict(scale=site.scale, divide=site.divide, scale_first=site.scale_first, upcast=site.upcast)
        op, name = (torch.ops.dualkv.linear_log_prob.default, "linear_log_prob") if ent is None else (
            torch.ops.dualkv.linear_log_prob_entropy.default, "linear_log_prob_entropy")
        res = graph.call_function(op, (hidden, weight, prev_index, next_ids), {**post, "chunk_bytes": chunk_bytes}, name=name)
        if picked:
            out = graph.call_function(operator.getitem, (res, 0), name="picked_logp")
            keep = graph.call_method("unsqueeze", (valid, -1))
            masked = graph.call_function(torch.where, (keep, out, graph.call_method("new_zeros", (out, ()))))
            fused = graph.create_node("call_method", "view_as", (masked, index), name=f"{gather.name}_fused")
            # Still zero at padding where the original had values: analysis.padding_reads must keep following it.
            set_picked_rank(fused, ev(index).dim())
            set_unpacked_rank(fused, ev(index).dim())
        elif gather is not None:
            out = graph.call_function(operator.getitem, (res, 0), name="next_token_logp")
            fused = graph.create_node("call_method", "unsqueeze", (out, 0), name=f"{gather.name}_fused")
        if ent is not None:
            # [N] -> the graph's [1, T] (N = T: every packed row); minus it where the pattern computed -H.
            entropy = graph.call_function(operator.getitem, (res, 1), name="entropy")
            if not merged:  # the graph's [T] entropy of squeezed logits stays [T]
                entropy = graph.create_node("call_method", "unsqueeze", (entropy, 0), name=f"{ent.final.name}_fused")
            if ent.negated:
                entropy = graph.call_function(operator.neg, (entropy,), name=f"{ent.final.name}_negated")
    if gather is not None:
        gather.replace_all_uses_with(fused)
    if ent is not None:
        ent.final.replace_all_uses_with(entropy)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted({*site.replaced, *(ent.nodes if ent else ())}, key=order.__getitem__, reverse=True):
        graph.erase_node(n)  # consumers first: each has no user left when erased
    if site.scale_node is not None and site.scale_node.op != "placeholder" and not site.scale_node.users:
        graph.erase_node(site.scale_node)


def _in_autocast_regions(graph: fx.Graph) -> set[fx.Node]:
    """The nodes between an ``_enter_autocast`` and its ``_exit_autocast`` (regions the graph enters itself)."""
    inside, depth = set(), 0
    for n in graph.nodes:
        name = getattr(n.target, "__name__", None) if n.op == "call_function" else None
        if name in _AUTOCAST:
            depth += 1 if name == "_enter_autocast" else -1
        elif depth > 0:
            inside.add(n)
    return inside


def _autocast_region_reason(site: _Site, in_regions: set[fx.Node]) -> Optional[str]:
    """Why not, if a node the op replaces runs inside an autocast region the graph enters and exits itself (its
    dtype policy would have to be replayed inside the op). A region elsewhere (transformers 5.17's rotary embedding
    turns autocast off around its cos/sin) leaves the site to the caller's autocast state (_autocast_site_reason)."""
    if in_regions.intersection([*site.replaced, *(site.entropy.nodes if site.entropy is not None else ())]):
        return f"{site.name} runs inside an autocast region of the graph"
    return None


def _entropy_alone(graph: fx.Graph):
    """(logp or None, x) of each log-softmax no gather reads and each softmax beside no log-softmax: the sources
    an entropy alone may read (``_match_chain`` decides)."""
    for n in graph.nodes:
        if _is_call(n, LOG_SOFTMAX, ("log_softmax",)) and not any(u.target in (gather_previous, gather_unpacked) for u in n.users):
            x = log_softmax_input(n)
            if isinstance(x, fx.Node) and not isinstance(log_prob_entropy(n, n.users), str):
                yield n, x
        elif _is_call(n, SOFTMAX, ("softmax",)) and n.args and isinstance(n.args[0], fx.Node):
            x = n.args[0]
            if x.users and not any(_is_call(u, LOG_SOFTMAX, ("log_softmax",)) for u in x.users):
                if not isinstance(logit_entropy(x, x.users), str):
                    yield None, x


def fuse_linear_log_prob(
    gm: fx.GraphModule, chunk_bytes: int = DEFAULT_CHUNK_BYTES, example_inputs: Optional[Sequence] = None, entropy: bool = True
) -> FusedLogProbs:
    """Fuse each lm_head -> log_softmax -> next-token gather of ``gm`` into ``dualkv::linear_log_prob``, and with
    ``entropy`` an entropy of the same log-probs (with the gather, or alone) into ``dualkv::linear_log_prob_entropy``.

    Rewrites ``gm`` in place (see the module docstring for what matches and
    for ``example_inputs``); a result with ``count == 0`` left it untouched.
    """
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    result = FusedLogProbs()
    gathers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (gather_previous, gather_unpacked)]
    if not gathers and not (entropy and any(True for _ in _entropy_alone(gm.graph))):
        return result
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    # Once: a fusion erases its chain and adds the op, never a region's ends, and the sites matched later (the
    # entropies alone) are nodes of the graph as it is now.
    in_regions = _in_autocast_regions(gm.graph)

    def fuse(name: str, site: Union[_Site, str]) -> None:
        if isinstance(site, _Site) and site.scale_node is not None:
            why = _resolve_scale(site, placeholders, example_inputs)
            site = site if why is None else why
        if isinstance(site, _Site) and site.entropy is not None:
            why = _entropy_reason(site, placeholders, example_inputs)
            site = site if why is None else why
        if isinstance(site, _Site):
            why = _autocast_region_reason(site, in_regions)
            site = site if why is None else why
        if isinstance(site, _Site) and any(torch.is_autocast_enabled(d) for d in ("cuda", "cpu")):
            why = _autocast_site_reason(site, placeholders, example_inputs)
            site = site if why is None else why
        where = _insertion_point(site, gm.graph) if isinstance(site, _Site) else site
        if isinstance(where, str):
            log.debug("dualkv: %s left unfused: %s", name, where)
            return
        _rewrite(gm.graph, site, where, chunk_bytes)
        result.count += 1
        result.entropy += site.entropy is not None
        if site.scale_check is not None:
            result.scalar_checks.append(site.scale_check)

    for gather in gathers:
        fuse(gather.name, _match(gather, entropy))
    # Entropies alone, looked for again in the graph the gathers' fusions left.
    for logp, x in list(_entropy_alone(gm.graph)) if entropy else ():
        fuse((logp or x).name, _match_chain(None, logp, x, entropy))
    if result.count:
        gm.graph.lint()
        gm.recompile()
        log.debug(
            "dualkv: fused %d lm_head -> log-softmax site(s), %d with their entropy (chunks of %d bytes)",
            result.count, result.entropy, chunk_bytes,
        )
    return result
