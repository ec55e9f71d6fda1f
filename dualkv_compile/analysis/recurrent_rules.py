"""Token-axis rules of hybrid models' recurrent layers (docs/design.md, semantics 16).

A recurrence along the sequence couples each token to every token before it in its sequence, as causal attention
does; on the packed forest a segment's scan starts from its parent's final state, so a token's value is the one
it has in each root-to-leaf sequence through it. Registered here (``rule_registry`` has a rule's contract):

* ``ops.forest_recurrent.causal_conv1d`` (``normalize.causal_conv``): x ``[B, C, T]`` with its token axes last,
  weight and bias without any: the token axes kept;
* ``dualkv::gated_delta_rule`` (``ops.recurrent``, transformers' GDN fallback as one op): q, k, v
  ``[B, T, H, D]``, g and beta ``[B, T, H]``, from a zero state and returning no final state (training; a
  cached state is generation's: computed in the original layout), its ``impl`` one whose math the forest
  reference is (``GATED_DELTA_IMPLS``, flash-linear-attention's ``GATED_DELTA_KERNELS``; ``KDA_IMPLS`` and
  ``KDA_KERNELS`` with g ``[B, T, H, Dk]``): the output keeps the token axes;
* ``dualkv::mamba2_chunk_scan`` (``ops.recurrent``, transformers' Mamba-2 SSD fallback as one op): x
  ``[B, T, H, P]``, dt ``[B, T, H]``, B and C ``[B, T, G, N]``, A, D and dt_bias constant, from a zero state (the
  op has no other form), its ``impl`` one of ``MAMBA2_IMPLS``: the output keeps the token axes;
* ``dualkv::mamba_selective_scan`` (``ops.recurrent``, transformers' Mamba v1 scan as one op): x, dt and z
  ``[B, D, T]``, B and C ``[B, N, T]`` (token axes last), A, D and delta_bias constant, from a zero state, its
  ``impl`` one of ``MAMBA1_IMPLS``: the output keeps the token axes.

An ``impl`` named here is one the forest reference models; ``analysis.recurrent_math`` also runs it against the
reference once per process, so that a release that changes its math is refused, not packed. What the packed
forms read in place of the padding before a row's tokens is checked per call (``analysis.padding_neutral``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..ops import recurrent as _recurrent  # noqa: F401  (registers dualkv::gated_delta_rule and the scans)
from ..ops.forest_recurrent import causal_conv1d
from .node_info import Kind, NodeInfo, RuleFailed, shape_of
from .recurrent_math import math_agrees
from .rule_registry import token_rule

__all__ = ["GATED_DELTA", "GATED_DELTA_IMPLS", "GATED_DELTA_KERNELS", "KDA_IMPLS", "KDA_KERNELS", "MAMBA1", "MAMBA1_IMPLS", "MAMBA2", "MAMBA2_IMPLS", "RECURRENT_TARGETS", "recurrent_kind"]

GATED_DELTA = torch.ops.dualkv.gated_delta_rule.default
# transformers' torch fallbacks whose math is kernels.recurrent.gated_delta's (tests/kernels/test_forest_recurrence
# and each family's model test compare them).
GATED_DELTA_IMPLS = frozenset(
    f"transformers.models.{m}.modeling_{m}.torch_chunk_gated_delta_rule"
    for m in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "lara_mini")
)
# flash-linear-attention's chunked GDN, which transformers' hub wrapper runs where fla is installed: the same math
# (its own kernel), run per forest level with per-sequence initial states (kernels.recurrent.gated_delta_varlen).
GATED_DELTA_KERNELS = frozenset({"fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule"})
# Kimi's delta attention: the gated delta rule with a decay per key channel (g [B, T, H, Dk]), the same op.
KDA_IMPLS = frozenset(f"transformers.models.{m}.modeling_{m}.chunk_kimi_delta_attention"
                      for m in ("kimi_linear", "bailing_hybrid"))
KDA_KERNELS = frozenset({"fla.ops.kda.chunk.chunk_kda"})  # fla's, run as GATED_DELTA_KERNELS are
MAMBA2 = torch.ops.dualkv.mamba2_chunk_scan.default
# transformers' Mamba-2 torch paths: one function, copied into each family's module (kernels.recurrent.mamba2).
MAMBA2_IMPLS = frozenset(
    f"transformers.models.{m}.modeling_{m}.mamba2_chunk_scan"
    for m in ("mamba2", "nemotron_h", "falcon_h1", "bamba", "zamba2", "granitemoehybrid")
)
MAMBA1 = torch.ops.dualkv.mamba_selective_scan.default
# transformers' Mamba (v1) torch paths: one function, copied into each family's module (kernels.recurrent.mamba1).
MAMBA1_IMPLS = frozenset(
    f"transformers.models.{m}.modeling_{m}.mamba_selective_scan" for m in ("mamba", "falcon_mamba", "jamba")
)
RECURRENT_TARGETS = {causal_conv1d: "causal convolution", GATED_DELTA: "gated delta rule", MAMBA2: "Mamba-2 scan",
                     MAMBA1: "Mamba selective scan"}


def _token(info: NodeInfo, tags, what: str) -> None:
    if info.kind is not Kind.TOKEN or tuple(info.tags) != tuple(tags) or info.shift:
        raise RuleFailed(f"{what} laid out {info.tags} ({info.kind.value}), expected {tags}")


def _known_math(impl: str, impls, what: str, grouped: bool = False) -> None:
    if impl not in impls:
        raise RuleFailed(f"{what} of {impl}: no forest form of its math")
    if not math_agrees(impl, grouped):
        raise RuleFailed(f"{impl} no longer computes what the forest form does (analysis.recurrent_math)")


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
    grouped = shape_of(k)[2] != shape_of(v)[2]  # fewer q/k heads than v heads: the impl must take them so
    _known_math(impl, GATED_DELTA_IMPLS | GATED_DELTA_KERNELS | KDA_IMPLS | KDA_KERNELS, "a gated delta rule",
                grouped)
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        _token(info[x], ("b", "s", None, None), f"the gated delta rule's {name}")
    per_channel = impl in KDA_IMPLS | KDA_KERNELS
    _token(info[g], ("b", "s", None, None) if per_channel else ("b", "s", None), "the gated delta rule's g")
    _token(info[beta], ("b", "s", None), "the gated delta rule's beta")
    for user in node.users:
        if not (user.op == "call_function" and user.target is operator.getitem and user.args[1] == 0):
            raise RuleFailed("the gated delta rule's final state is read")
    return NodeInfo(Kind.TOKEN, ("b", "s", None, None), slen=info[v].slen)


@token_rule(MAMBA2)
def _mamba2(node, info, B, S) -> NodeInfo:
    x, dt, A, Bm, Cm, D, dt_bias, _chunk, _softplus, _lo, _hi, impl = node.args
    _known_math(impl, MAMBA2_IMPLS, "a Mamba-2 scan")
    for t, name in ((x, "x"), (Bm, "B"), (Cm, "C")):
        _token(info[t], ("b", "s", None, None), f"the Mamba-2 scan's {name}")
    _token(info[dt], ("b", "s", None), "the Mamba-2 scan's dt")
    for t, name in ((A, "A"), (D, "D"), (dt_bias, "dt_bias")):
        if t is not None:
            _constant(info[t], f"the Mamba-2 scan's {name}")
    return NodeInfo(Kind.TOKEN, ("b", "s", None, None), slen=info[x].slen)


@token_rule(MAMBA1)
def _mamba1(node, info, B, S) -> NodeInfo:
    x, dt, A, Bm, Cm, D, z, delta_bias, _softplus, _mambapy, _assoc, impl = node.args
    _known_math(impl, MAMBA1_IMPLS, "a Mamba selective scan")
    for t, name in ((x, "x"), (dt, "dt"), (Bm, "B"), (Cm, "C"), (z, "z")):
        if t is not None:
            _token(info[t], ("b", None, "s"), f"the Mamba selective scan's {name}")
    for t, name in ((A, "A"), (D, "D"), (delta_bias, "delta_bias")):
        if t is not None:
            _constant(info[t], f"the Mamba selective scan's {name}")
    return NodeInfo(Kind.TOKEN, ("b", None, "s"), slen=info[x].slen)


def recurrent_kind(n: fx.Node):
    """The layer kind ``n`` computes (``RECURRENT_TARGETS``' words, a gated delta rule's kernel named where it is a
    library's: the forest runs it), or None."""
    kind = RECURRENT_TARGETS.get(n.target) if n.op == "call_function" else None
    if n.target is GATED_DELTA and n.args[-1] in GATED_DELTA_KERNELS | KDA_KERNELS:
        return f"{kind} (flash-linear-attention, a launch per forest level)"
    return kind
