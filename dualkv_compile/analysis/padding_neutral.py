"""Analysis: whether the original program's recurrent layers read nothing from the padding before a row's tokens.

A recurrence runs along the whole padded row: on a left-padded row its state at the first valid token is what
the padding left in it, and a causal convolution there reads the K-1 padding inputs before it. The packed forms
read zeros and a zero state instead (``rewrite.recurrent_layers``), so they equal the original program only where
the original's padding is neutral. transformers' hybrid layers make it so by multiplying their input by the
attention mask (``apply_mask_to_padding_states``); this pass proves it from the graph.

Contract
    Input: the normalized graph and its ``TokenAxes``. Output: per recurrent node (``analysis.recurrent_rules``)
    in graph order, ``(node, kind, why)``: ``why`` None where the node's padding is proven neutral, else the
    reason. Neutral: a causal convolution whose input is zero at every padding position ahead of a row's first
    token (such a position reads only padding before it); a gated delta rule whose k, v or beta is (a zero
    update leaves the zero state zero, and its output there, q times a zero state, is zero); a Mamba-2 scan whose
    x or B is, and a Mamba (v1) selective scan likewise (its update dt x B^T is zero; its output there, C times the
    zero state plus D x, gated or not, is zero where x is). Zero there
    ("ZLP") is proven forward: a product with the attention mask (zero exactly where the layout pads:
    ``layout.sequences`` reads valid tokens as ``attention_mask != 0``) or with a ZLP value; ops that map zero
    to zero on a ZLP operand (casts, layout ops, silu, a linear map without bias, cat of ZLP values, a ZLP
    convolution without bias, a neutral gated delta rule's output, a Mamba-2 scan's of a ZLP x, a ZLP value
    divided by a nonzero number). The graph is not modified.
"""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .recurrent_rules import GATED_DELTA, MAMBA1, MAMBA2, recurrent_kind
from .node_info import Kind
from .token_axes import TokenAxes
from .token_inputs import Role
from ..ops.forest_recurrent import causal_conv1d

__all__ = ["padding_neutrality"]

# Layout ops and casts: each entry is an entry of the operand (zero stays zero); the mask stays a mask.
_LAYOUT_METHODS = {"to", "float", "half", "bfloat16", "double", "type_as", "contiguous", "clone", "view", "reshape",
                   "transpose", "permute", "unsqueeze", "squeeze", "flatten", "unflatten", "expand", "split",
                   "chunk", "bool", "int", "long"}
_LAYOUT_FUNCS = {operator.getitem, torch.reshape, torch.transpose, torch.permute, torch.unsqueeze, torch.squeeze,
                 torch.flatten, torch.split, torch.functional.split, torch.chunk, torch.Tensor.to, torch.Tensor.contiguous}
# f(0) = 0, pointwise on one tensor operand.
_ZERO_METHODS = {"neg", "silu", "relu", "tanh", "sin", "abs", "__neg__"}
_ZERO_FUNCS = {F.silu, F.relu, torch.relu, torch.tanh, torch.neg, operator.neg, torch.sin, torch.abs, F.gelu}
_MUL = {operator.mul, torch.mul, "mul", "__mul__", "__rmul__", operator.and_, "__and__"}
_DIV = {operator.truediv, torch.div, "div", "__truediv__"}
_LINEAR = {F.linear, torch._C._nn.linear}
_MATMUL = {torch.matmul, operator.matmul, "matmul", "__matmul__"}


def _target(n: fx.Node):
    return n.target if n.op in ("call_function", "call_method") else None


def _flat(index) -> list:
    return list(index) if isinstance(index, (tuple, list)) else [index]


class _Zeros:
    def __init__(self, axes: TokenAxes):
        self.axes = axes
        mask = axes.token_inputs.get(Role.ATTENTION_MASK)
        self.mask: set[fx.Node] = {mask} if mask is not None else set()
        self.zlp: set[fx.Node] = set()
        self.neutral: dict[fx.Node, Optional[str]] = {}

    def visit(self, n: fx.Node) -> None:
        t = _target(n)
        args = n.all_input_nodes
        if t is None or not args:
            return
        first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        info = self.axes.info.get(n)
        if info is None or info.kind is not Kind.TOKEN or info.shift or info.slen not in (None, self.axes.S):
            return  # zero where the layout pads only for a value of every position, aligned (no shift, no gather)
        if t is operator.getitem and any(isinstance(i, fx.Node) for i in _flat(n.args[1])):
            return  # an advanced index moves entries between positions
        if t in _LAYOUT_METHODS or t in _LAYOUT_FUNCS:
            if first in self.mask:
                self.mask.add(n)
            elif first in self.zlp:
                self.zlp.add(n)
            return
        if t in _MUL:
            if any(a in self.mask or a in self.zlp for a in args):
                self.zlp.add(n)
            return
        if t in _DIV:
            # 0 / d is 0 only for a nonzero finite divisor: a Python number here (a tensor could hold 0 there).
            d = n.args[1] if len(n.args) > 1 else None
            if first in self.zlp and isinstance(d, (int, float)) and not isinstance(d, bool) and d != 0 \
                    and math.isfinite(d):
                self.zlp.add(n)
            return
        if t in _ZERO_METHODS or t in _ZERO_FUNCS:
            if first in self.zlp:
                self.zlp.add(n)
            return
        if t in _LINEAR:
            bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
            if first in self.zlp and bias is None:
                self.zlp.add(n)
            return
        if t in _MATMUL:
            w = n.args[1] if len(n.args) > 1 else None
            if first in self.zlp and isinstance(w, fx.Node) and self.axes.info[w].kind is Kind.NONE:
                self.zlp.add(n)
            return
        if t in (torch.cat, torch.concatenate, torch.concat):
            parts = n.args[0]
            if parts and all(p in self.zlp for p in parts):
                self.zlp.add(n)
            return
        if t is causal_conv1d:
            x, _w, bias = n.args
            self.neutral[n] = None if x in self.zlp else f"{n.name}: its input is not zero at the padding before a row's tokens"
            if x in self.zlp and bias is None:
                self.zlp.add(n)
            return
        if t is GATED_DELTA:
            k, v, beta = n.args[1], n.args[2], n.args[4]
            ok = any(a in self.zlp for a in (k, v, beta))
            self.neutral[n] = None if ok else f"{n.name}: none of its k, v, beta is zero at the padding before a row's tokens"
            if ok:
                self.zlp.add(n)
            return
        if t in (MAMBA2, MAMBA1):
            x, Bm = n.args[0], n.args[3]
            ok = x in self.zlp or Bm in self.zlp
            self.neutral[n] = None if ok else f"{n.name}: neither its x nor its B is zero at the padding before a row's tokens"
            if x in self.zlp:
                self.zlp.add(n)


def padding_neutrality(gm: fx.GraphModule, axes: TokenAxes) -> tuple[tuple[fx.Node, str, Optional[str]], ...]:
    """``(node, layer kind, why not neutral or None)`` per recurrent node (see the module docstring)."""
    zeros = _Zeros(axes)
    for n in gm.graph.nodes:
        zeros.visit(n)
    return tuple((n, recurrent_kind(n), why) for n, why in zeros.neutral.items())
