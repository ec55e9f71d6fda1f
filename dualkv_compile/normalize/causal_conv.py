"""The short causal convolution of hybrid layers as one call: ``conv1d(..., padding=K-1)[..., :T]`` fused.

Contract
    Input: a Dynamo ``GraphModule`` (operands positional: ``positional_args``).
    Output: ``gm`` itself where no call matches; otherwise a new ``GraphModule`` (``gm`` is left unchanged) in
    which each depthwise causal convolution, ``torch.conv1d(x, w, b, stride 1, padding K-1, dilation 1, groups
    C)`` of x ``[B, C, T]`` and w ``[C, 1, K]`` read by exactly one ``[..., :T]`` slice of its last axis (as
    transformers' GDN, Mamba, Mamba-2, Nemotron-H, Falcon-H1 and LFM2 torch paths write it), is one call of
    ``ops.forest_recurrent.causal_conv1d`` (the same two ops). The slice keeps the convolution's first T outputs:
    each reads its own input and the K-1 before it, zeros before the row's start.

Why: the padded convolution's output is longer than its input along the token axis, which the analysis cannot
tag; the fused call keeps the token axis (output ``[B, C, T]``) and has a packed form on the forest.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..graph import copy_graph_module
from ..graph.meta import copy_meta, ev
from ..ops.forest_recurrent import causal_conv1d

__all__ = ["fuse_causal_conv1d"]

_CONV = {torch.conv1d, F.conv1d}
_DEFAULTS = {"stride": 1, "padding": 0, "dilation": 1, "groups": 1}
_POSITIONS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def _int(x) -> Optional[int]:
    """An int, or a one-element tuple/list of one; None for anything else (a string padding, a node)."""
    if isinstance(x, (tuple, list)) and len(x) == 1:
        x = x[0]
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _conv_args(n: fx.Node) -> Optional[tuple]:
    """``(x, weight, bias)`` if ``n`` is a depthwise conv1d padded by K-1 on both sides, else None."""
    if n.op != "call_function" or n.target not in _CONV:
        return None
    if len(n.args) > len(_POSITIONS) or set(n.kwargs) - set(_POSITIONS):
        return None
    bound = dict(zip(_POSITIONS, n.args))
    bound.update(n.kwargs)
    x, w = bound.get("input"), bound.get("weight")
    bias = bound.get("bias")
    if not isinstance(x, fx.Node) or not isinstance(w, fx.Node) or not (bias is None or isinstance(bias, fx.Node)):
        return None
    xv, wv = ev(x), ev(w)
    if not isinstance(xv, torch.Tensor) or not isinstance(wv, torch.Tensor) or xv.dim() != 3 or wv.dim() != 3:
        return None
    C, K = xv.shape[1], wv.shape[-1]
    sizes = {k: _int(bound.get(k, d)) for k, d in _DEFAULTS.items()}
    if sizes != {"stride": 1, "padding": K - 1, "dilation": 1, "groups": C} or tuple(wv.shape[:2]) != (C, 1):
        return None
    return x, w, bias


def _keeps_first(getitem: fx.Node, T) -> bool:
    """``y[..., :T]`` or ``y[:, :, :T]``: every row and channel, the first T entries of the last axis."""
    if getitem.op != "call_function" or getitem.target is not operator.getitem or len(getitem.args) != 2:
        return False
    idx = getitem.args[1]
    if not isinstance(idx, tuple) or not idx:
        return False
    last = idx[-1]
    if not isinstance(last, slice) or last.start not in (None, 0) or last.step not in (None, 1) or last.stop != T:
        return False
    lead = idx[:-1]
    whole = slice(None, None, None)
    return lead in ((Ellipsis,), (whole, whole))


def fuse_causal_conv1d(gm: fx.GraphModule) -> fx.GraphModule:
    """See the module docstring."""
    found = []
    for n in gm.graph.nodes:
        parts = _conv_args(n)
        if parts is None or len(n.users) != 1:
            continue
        (reader,) = n.users
        if _keeps_first(reader, ev(parts[0]).shape[-1]):
            found.append((n.name, reader.name))
    if not found:
        return gm
    gm = copy_graph_module(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    for conv_name, slice_name in found:
        conv, sliced = nodes[conv_name], nodes[slice_name]
        x, w, bias = _conv_args(conv)
        with gm.graph.inserting_before(sliced):
            fused = gm.graph.call_function(causal_conv1d, (x, w, bias))
        copy_meta(sliced, fused)
        sliced.replace_all_uses_with(fused)
        gm.graph.erase_node(sliced)
        gm.graph.erase_node(conv)
    gm.graph.lint()
    gm.recompile()
    return gm
