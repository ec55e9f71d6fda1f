"""Token-axis rules of hybrid models' recurrent layers (docs/design.md, semantics 16).

A recurrence along the sequence couples each token to every token before it in its sequence, as causal attention
does; on the packed forest a segment's scan starts from its parent's final state, so a token's value is the one
it has in each root-to-leaf sequence through it. Registered here (``rule_registry`` has a rule's contract):

* ``ops.forest_recurrent.causal_conv1d`` (``normalize.causal_conv``): x ``[B, C, T]`` with its token axes last,
  weight and bias without any: the token axes kept;
* ``dualkv::gated_delta_rule`` (``ops.recurrent``, transformers' GDN fallback as one op): q, k, v
  ``[B, T, H, D]``, g and beta ``[B, T, H]``, from a zero state and returning no final state (training; a
  cached state is generation's: computed in the original layout), its ``impl`` one whose math the forest
  reference is (``GATED_DELTA_IMPLS``): the output keeps the token axes.

What the packed forms read in place of the padding before a row's tokens (zeros, a zero state) is the runner's
to check per call against what the original program reads there (``analysis.padding_neutral``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..ops import recurrent as _recurrent  # noqa: F401  (registers torch.ops.dualkv.gated_delta_rule)
from ..ops.forest_recurrent import causal_conv1d
from .node_info import Kind, NodeInfo, RuleFailed
from .rule_registry import token_rule

__all__ = ["GATED_DELTA", "GATED_DELTA_IMPLS", "RECURRENT_TARGETS", "recurrent_kind"]

GATED_DELTA = torch.ops.dualkv.gated_delta_rule.default
# transformers' torch fallbacks whose math is kernels.recurrent.gated_delta's (tests/kernels/test_forest_recurrence
# and each family's model test compare them).
GATED_DELTA_IMPLS = frozenset(
    f"transformers.models.{m}.modeling_{m}.torch_chunk_gated_delta_rule"
    for m in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid")
)
RECURRENT_TARGETS = {causal_conv1d: "causal convolution", GATED_DELTA: "gated delta rule"}


def _token(info: NodeInfo, tags, what: str) -> None:
    if info.kind is not Kind.TOKEN or tuple(info.tags) != tuple(tags) or info.shift:
        raise RuleFailed(f"{what} laid out {info.tags} ({info.kind.value}), expected {tags}")


def _constant(info: NodeInfo, what: str) -> None:
    if info.kind is not Kind.NONE:
        raise RuleFailed(f"{what} varies with the tokens")


@token_rule(causal_conv1d)
def _causal_conv(node, info, B, S) -> NodeInfo:
    x, weight, bias = node.args
    _token(info[x], ("b", None, "s"), "the causal convolution's input")
    _constant(info[weight], "the causal convolution's weight")
    if bias is not None:
        _constant(info[bias], "the causal convolution's bias")
    return NodeInfo(Kind.TOKEN, info[x].tags, slen=info[x].slen)


@token_rule(GATED_DELTA)
def _gated_delta(node, info, B, S) -> NodeInfo:
    q, k, v, g, beta, initial_state, _chunk, output_final_state, _l2norm, impl = node.args
    if initial_state is not None or output_final_state:
        raise RuleFailed("a gated delta rule with a cached state (generation)")
    if impl not in GATED_DELTA_IMPLS:
        raise RuleFailed(f"a gated delta rule of {impl}: no forest form of its math")
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        _token(info[x], ("b", "s", None, None), f"the gated delta rule's {name}")
    for x, name in ((g, "g"), (beta, "beta")):
        _token(info[x], ("b", "s", None), f"the gated delta rule's {name}")
    for user in node.users:
        if not (user.op == "call_function" and user.target is operator.getitem and user.args[1] == 0):
            raise RuleFailed("the gated delta rule's final state is read")
    return NodeInfo(Kind.TOKEN, ("b", "s", None, None), slen=info[v].slen)


def recurrent_kind(n: fx.Node):
    """The layer kind ``n`` computes (``RECURRENT_TARGETS``' words), or None."""
    return RECURRENT_TARGETS.get(n.target) if n.op == "call_function" else None
