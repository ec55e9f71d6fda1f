"""Rewrite: the packed form of a hybrid model's recurrent layer (docs/design.md, semantics 16).

Contract
    Input: the packer (``pack_graph._Packer``) and a TOKEN node that ``analysis.recurrent_rules`` tagged: a
    ``causal_conv1d`` or a ``dualkv::gated_delta_rule``. Output: its packed form, on the packed operands and the
    layout's inputs: ``forest_causal_conv1d`` reading each token's K-1 predecessors along its path
    (``prev_index``), ``dualkv::forest_gated_delta_rule`` scanning each segment from its parent's final state (the
    chunk size the layer's op was given, its q/k normalisation, its ``impl``: a varlen kernel's runs the forest),
    returned as the ``(output, empty state)`` pair
    the original op returns; ``dualkv::forest_mamba2_scan`` likewise for a ``dualkv::mamba2_chunk_scan`` (its
    chunk size, dt transform and limits), ``dualkv::forest_selective_scan`` for a ``dualkv::mamba_selective_scan``.
    Never the op itself on the packed stream: that would run every sequence of the
    stream as one.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..analysis.recurrent_rules import GATED_DELTA, MAMBA1, MAMBA2
from ..ops.forest_recurrent import causal_conv1d, forest_causal_conv1d
from ..ops.forest_recurrent import forest_gated_delta_rule, forest_mamba2_scan, forest_selective_scan  # noqa: F401

__all__ = ["emit_recurrent"]


def emit_recurrent(packer, n: fx.Node) -> fx.Node:
    """The packed form of the recurrent node ``n`` (see the module docstring)."""
    g, i = packer.g, packer.inp
    if n.target is causal_conv1d:
        x, weight, bias = n.args
        args = (packer.packed_of(x), packer.packed_of(weight), None if bias is None else packer.packed_of(bias),
                i["prev_index"])
        return g.call_function(forest_causal_conv1d, args, name=n.name + "_packed")
    if n.target is GATED_DELTA:
        q, k, v, gate, beta, _state, chunk, _final, l2norm, impl = n.args
        operands = tuple(packer.packed_of(a) for a in (q, k, v, gate, beta))
        segs = tuple(i[f] for f in ("seg_start", "seg_len", "parent", "prefix_len", "subtree_end"))
        out = g.call_function(torch.ops.dualkv.forest_gated_delta_rule.default,
                              operands + segs + (int(chunk) if chunk else 0, bool(l2norm), impl))
        empty = g.call_method("new_empty", (out, (0,)), {"dtype": torch.float32})
        return g.call_function(_pair, (out, empty), name=n.name + "_packed")
    if n.target is MAMBA2:
        x, dt, A, B, C, D, dt_bias, chunk, softplus, lo, hi, _impl = n.args
        operands = tuple(None if a is None else packer.packed_of(a) for a in (x, dt, A, B, C, D, dt_bias))
        segs = tuple(i[f] for f in ("seg_start", "seg_len", "parent", "prefix_len", "subtree_end"))
        return g.call_function(torch.ops.dualkv.forest_mamba2_scan.default,
                               operands + segs + (int(chunk) if chunk else 0, bool(softplus), float(lo), float(hi)),
                               name=n.name + "_packed")
    if n.target is MAMBA1:
        x, dt, A, B, C, D, z, delta_bias, softplus, _mambapy, _assoc, _impl = n.args
        operands = tuple(None if a is None else packer.packed_of(a) for a in (x, dt, A, B, C, D, z, delta_bias))
        segs = tuple(i[f] for f in ("seg_start", "seg_len", "parent", "prefix_len", "subtree_end"))
        return g.call_function(torch.ops.dualkv.forest_selective_scan.default, operands + segs + (bool(softplus),),
                               name=n.name + "_packed")
    raise AssertionError(f"{n.name}: {n.target} has no packed form here")


def _pair(out: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(output, final state)`` tuple ``dualkv::gated_delta_rule`` returns (its state empty in training)."""
    return out, state

