"""Analysis: tag every value of a Dynamo FX graph with its token axes.

Contract
    Input: a torch-level FX graph with static shapes (every node carries ``meta["example_value"]``), the
    placeholders that hold token inputs (``input_ids``, ``attention_mask``, ``position_ids``, ``inputs_embeds``)
    and the batch's ``B`` and ``S``.
    Output: ``TokenAxes``: for each node a ``NodeInfo`` with one tag per dimension (``"b"`` the batch axis, ``"s"``
    the sequence axis, ``"bs"`` the two merged batch-major, or None) and a *kind*:

        TOKEN   per-token value with a batch and a sequence axis, computable on the packed stream
        COLUMN  depends on the column only (``arange(S)``, ``[1, S]`` position ids); gathered at each token's column
        BCAST   a constant expanded over the batch axis (rotary tables); on the packed stream the expand is to 1
        NONE    no token axes (parameters, scalars, constants)
        ORIG    must be computed in the original ``[B, S]`` layout: it mixes tokens (a reduction, shift or slice
                along the sequence) or derives from a value that does; ``cause`` says which node and why
        ROUTED  a step of an MoE expert dispatch, computed on the packed stream only, read only by
                ``moe_rules.routed_rule`` (anything else refuses the graph), never unpacked

    and the graph's attention matches. The graph is not modified.

Rules are per op, registered by target (``rule_registry``; ``token_rules``, ``shape_rules``, ``moe_rules``): a rule
gives a node's tags, computes it in the original layout (ORIG), or refuses the graph. This module is the driver:
inputs, constants, creation ops and the ORIG ancestry are handled here, every other node by its rule.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.fx as fx

from ..graph import Refusal
from ..graph.meta import ev as _ev
from .attention_match import AttentionMatch, find_attention
from .node_info import Coupling, Kind, NodeInfo, RuleFailed, hint, op_name, shape_of, untagged
from .moe_rules import routed_rule
from .shape_rules import is_size_query
from .token_inputs import Role, TokenInputs
from .rule_registry import rule_for
from . import recurrent_rules  # noqa: F401  (registers the recurrent layers' rules)
# With moe_rules and shape_rules above: every rule module imported, so the registry is complete.
from .token_rules import POINTWISE_FUNCS, POINTWISE_METHODS

__all__ = ["Kind", "NodeInfo", "TokenAxes", "Refusal", "analyze_token_axes", "hint", "shape_of"]


@dataclasses.dataclass(frozen=True)
class TokenAxes:
    """``info`` per node; ``B``/``S`` the batch's sizes (the example's, for dynamic-shape graphs)."""

    B: int
    S: int
    info: dict[fx.Node, NodeInfo]
    attention: list[AttentionMatch]
    token_inputs: TokenInputs
    refusals: tuple[str, ...]


_SIDE_EFFECTS = {torch._C._set_grad_enabled, torch._C._log_api_usage_once}


def analyze_token_axes(
    gm: fx.GraphModule,
    token_inputs: TokenInputs,
    batch_shape: Optional[tuple[int, int]] = None,
    attention: Optional[list[AttentionMatch]] = None,
) -> TokenAxes:
    """Tag every node (see the module docstring).

    ``B`` and ``S`` come from ``input_ids``; a graph without them (a part of
    a model after a graph break) is analysed when ``batch_shape`` gives them,
    its token-major inputs given in ``token_inputs`` with the roles
    ``CARRIED`` (``[B, S, ...]``: hidden states, positions) and ``COLUMN``
    (``[1, S, ...]``: values of the column only).
    """
    graph = gm.graph
    refusals: list[str] = []
    for node in graph.nodes:
        if node.op == "call_function" and "flex_attention" in getattr(node.target, "__name__", str(node.target)):
            raise Refusal(
                f"{node.name}: flex_attention with a block mask made outside this graph (Hugging Face's "
                "\"flex_attention\" implementation) cannot be checked or rebuilt for the packed stream; "
                "use attn_implementation=\"sdpa\" or \"eager\""
            )
    ids = token_inputs.get(Role.INPUT_IDS)
    if ids is None and batch_shape is None:
        raise Refusal(
            "no input_ids among this graph's inputs: the layout is detected from token ids "
            "(a graph break may have split the model, leaving this part without them)"
        )
    if ids is not None:
        if _ev(ids).dim() != 2:
            raise Refusal(f"input_ids has shape {shape_of(ids)}, expected [B, S]")
        B, S = shape_of(ids)
    else:
        B, S = batch_shape
    for node in graph.find_nodes(op="placeholder"):
        name = node.name.lower()
        if "past_key" in name or "cache" in name and "cache_position" not in name:
            raise Refusal(f"{node.name}: a KV cache is passed in; packed training needs the full sequence in one call")

    matches = find_attention(graph) if attention is None else attention
    by_output = {m.output: m for m in matches}
    internal = {n for m in matches for n in m.nodes if n is not m.output}
    mask_only = _mask_only(graph, matches, internal)
    info: dict[fx.Node, NodeInfo] = {}
    for node in graph.nodes:
        if node.op == "output":
            continue
        try:
            if node in internal:
                info[node] = NodeInfo(Kind.ORIG, cause=f"{node.name}: inside an attention pattern")
            elif node in by_output:
                info[node] = _attention_info(by_output[node], info)
            else:
                info[node] = _rule(node, info, token_inputs, B, S)
        except RuleFailed as e:
            info[node] = NodeInfo(Kind.ORIG, untagged(_ev(node)), cause=f"{node.name}: {e}")
        except Coupling as e:
            if node not in mask_only:  # a mask's own computation (Llama 4's left padding) is dropped with the mask
                refusals.append(f"{node.name}: {e}")
            info[node] = NodeInfo(Kind.ORIG, cause=f"{node.name}: {e}")
        info[node].from_inputs = _from_inputs(node, info, token_inputs)
    for out in graph.find_nodes(op="output"):
        for a in out.all_input_nodes:
            if info[a].kind is Kind.ROUTED:
                refusals.append(f"{a.name}: an output of the MoE dispatch's expert sort depends on every token of the batch")
    for m in matches:
        if m.refusal:
            refusals.append(m.refusal)
        elif info[m.output].kind is not Kind.TOKEN:
            refusals.append(f"{m.output.name}: attention cannot run on the packed stream: {info[m.output].cause}")
    return TokenAxes(B, S, info, matches, token_inputs, tuple(refusals))


def _mask_only(graph: fx.Graph, matches, internal) -> set:
    """The nodes whose values reach nothing but the attention masks (read by the attentions alone), which the
    rewrite drops: the attention follows the layout instead, and the mask check reads them on a copy of the
    original graph. An op among them that couples tokens (a cumulative sum counting left padding) is no reason
    to refuse the graph."""
    readers = internal | {m.output for m in matches}
    out: set = set()
    masks = {m.mask for m in matches if isinstance(m.mask, fx.Node)}
    for node in reversed(graph.nodes):
        if node.op in ("output", "placeholder") or not node.users:
            continue
        if node in masks and all(u in readers for u in node.users):
            out.add(node)
        elif node not in readers and all(u in out for u in node.users):
            out.add(node)
    return out


# Inputs a value may be computed from and still count as the inputs' alone (NodeInfo.from_inputs).
_PLAIN_INPUT_ROLES = (Role.INPUT_IDS, Role.ATTENTION_MASK, Role.POSITION_IDS)
_RANDOM = ("rand", "bernoulli", "dropout", "multinomial", "normal", "uniform", "exponential", "poisson")


def _from_inputs(node: fx.Node, info, token_inputs: TokenInputs) -> bool:
    """Whether ``node`` is computed from the token ids, mask and positions, sizes and constants alone."""
    if node.op == "placeholder":
        if not isinstance(_ev(node), torch.Tensor):
            return True  # a size (SymInt) or a Python scalar
        # A carried integer or boolean input is a mask or ids handed from graph to graph; a carried float may be
        # a model state (hidden states), whose values the original layout would recompute at full cost.
        plain = _ev(node).dtype in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
        return any(t.node is node and (t.role in _PLAIN_INPUT_ROLES or (t.role is Role.CARRIED and plain)) for t in token_inputs)
    if node.op != "call_function" and node.op != "call_method":
        return False  # get_attr (a module's buffer), call_module
    if any(word in op_name(node) for word in _RANDOM):
        return False  # computed twice (packed and original), it would draw twice
    return all(info[a].from_inputs for a in node.all_input_nodes)


def _attention_info(m: AttentionMatch, info) -> NodeInfo:
    qkv = [info.get(x) for x in (m.q, m.k, m.v)]
    for name, i in zip("qkv", qkv):
        if i is None or i.kind is not Kind.TOKEN:
            cause = i.cause if i is not None and i.cause else f"{name} is not a per-token value"
            return NodeInfo(Kind.ORIG, cause=cause)
        if i.tags != ("b", None, "s", None):
            return NodeInfo(Kind.ORIG, cause=f"{name} has token axes {i.tags}, expected [b, heads, s, dim]")
    return NodeInfo(Kind.TOKEN, ("b", None, "s", None), slen=qkv[0].slen)


def _rule(node: fx.Node, info, token_inputs, B, S) -> NodeInfo:
    ev = _ev(node)
    if node.op == "placeholder":
        for t in token_inputs:
            if t.node is node:
                return _input_info(t, ev, B, S)
        return NodeInfo(Kind.NONE, untagged(_ev(node)))
    if node.op == "get_attr":
        return NodeInfo(Kind.NONE, untagged(_ev(node)))
    ins = [info[a] for a in node.all_input_nodes]
    if node.op == "call_function" and node.target in _SIDE_EFFECTS:
        return NodeInfo(Kind.NONE)
    if any(i.kind is Kind.ROUTED for i in ins):
        return routed_rule(node, info, B, S)  # MoE dispatch: values of the packed stream only
    orig = [i for i in ins if i.kind is Kind.ORIG]
    if orig:
        return NodeInfo(Kind.ORIG, untagged(_ev(node)), cause=orig[0].cause)
    if all(i.kind is Kind.NONE for i in ins):
        if node.op == "call_method" and node.target == "expand":
            return rule_for(node)(node, info, B, S)  # a constant expanded over the batch (BCAST)
        return _creation_info(node, ev, B, S)
    # From here on at least one input is TOKEN or COLUMN.
    if not isinstance(ev, (torch.Tensor, tuple, list)) and not is_size_query(node):
        raise RuleFailed(f"{op_name(node)} of a token value gives a non-tensor")
    rule = rule_for(node)
    if rule is None:
        raise RuleFailed(f"no token-axis rule for {op_name(node)}")
    res = rule(node, info, B, S)
    if res.kind in (Kind.TOKEN, Kind.COLUMN) and res.slen is None:
        _inherit_shift(node, res, info)
    return res


def _inherit_shift(node: fx.Node, res: NodeInfo, info) -> None:
    """A result's shift and sequence length follow its token operands.

    Operands of different shifts meet in the next-token pattern (log-probs at
    column c with the ids at column c + 1): the result is indexed by the
    target token (shift 1) and the rewrite reads the shift-0 operand at each
    token's predecessor. Only pointwise ops and gathers may mix shifts.
    """
    toks = [info[a] for a in node.all_input_nodes if info[a].kind in (Kind.TOKEN, Kind.COLUMN)]
    shifts = {i.shift for i in toks}
    res.shift = max(shifts)
    res.slen = min(i.slen for i in toks)
    if len(shifts) > 1:
        pointwise = node.op == "call_function" and node.target in POINTWISE_FUNCS or node.op == "call_method" and node.target in POINTWISE_METHODS
        if not pointwise:
            raise RuleFailed(f"{op_name(node)} combines values shifted along the sequence")
        if any(i.kind is Kind.COLUMN and i.shift == 0 for i in toks):
            raise RuleFailed("combines a column value with next-token values")


def _input_info(t, ev, B: int, S: int) -> NodeInfo:
    shape = [hint(d) for d in ev.shape]
    role = t.role
    if role in (Role.CARRIED, Role.INPUTS_EMBEDS):
        tags = [None] * ev.dim()
        tags[t.dims[0]], tags[t.dims[1]] = "b", "s"
        return NodeInfo(Kind.TOKEN, tuple(tags), slen=S)
    if role is Role.COLUMN:
        return NodeInfo(Kind.COLUMN, (None, "s") + (None,) * (ev.dim() - 2), slen=S)
    if ev.dim() != 2 or shape[1] != S or shape[0] not in (1, B):
        return NodeInfo(Kind.ORIG, untagged(ev), cause=f"{t} has shape {shape}, expected [B, S]")
    if shape[0] == 1 and B > 1:
        return NodeInfo(Kind.COLUMN, (None, "s"), slen=S)
    return NodeInfo(Kind.TOKEN, ("b", "s"), slen=S)


def _creation_info(node: fx.Node, ev, B: int, S: int) -> NodeInfo:
    if node.op == "call_function" and node.target is torch.arange and isinstance(ev, torch.Tensor):
        # arange(S) is the column index (positions, cache_position); arange(B) the row index, which only a mask
        # builds on. When B == S a static graph holds both as arange(S), with nothing to tell them apart, so each is
        # tagged a column value: the tag is a claim about positions only (entry c stands for column c, and the
        # packed stream gathers entry col(t) for token t), checked where the value meets a token value. Lined up
        # with the s axis, the original reads entry c at column c as well, whatever the arange was written for,
        # so the gather is exact; lined up with the b axis (a row index), it conflicts with b and the value is
        # computed in the original layout (``RuleFailed``), as a constant of length B lined up with b always is.
        if ev.dim() == 1 and hint(ev.shape[0]) == S:
            return NodeInfo(Kind.COLUMN, ("s",), slen=S)
    if isinstance(ev, torch.Tensor):
        return NodeInfo(Kind.NONE, (None,) * ev.dim())
    return NodeInfo(Kind.NONE)
