"""Rule rows of analysis/token_rules.py: pointwise, like, linear, embedding, matmul, reductions, min/max, scatter,
new_like, softmax, norms, coupling, dropout, cumulative (one list per family; ``test_token_rules.TABLES`` runs them).

Written in the row language of ``rule_rows.py``.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from .rule_rows import (
    B, BCAST, COLUMN, D, NONE, S, TOKEN, In, Kind, X0, X1, X2, bx, by, col, couples, fails, fn, idx, ids, mask, merged,
    meth, out, table, w, weighs, x, x_bds, y,
)


def _complex(shape, spec, kind):
    return In(shape, spec, kind, value=torch.randn(shape, dtype=torch.complex64))


def _pointwise_rows():
    binary_funcs = [
        operator.add, operator.sub, operator.mul, operator.truediv, operator.pow, operator.eq, operator.ne,
        operator.lt, operator.le, operator.gt, operator.ge, torch.add, torch.sub, torch.mul, torch.div,
        torch.pow, torch.maximum, torch.minimum,
    ]
    unary_funcs = [
        operator.neg, operator.pos, torch.rsqrt, torch.sqrt, torch.exp, torch.log, torch.tanh, torch.sigmoid,
        torch.sin, torch.cos, torch.neg, torch.abs, torch.erf, torch.reciprocal, torch.square, F.silu, F.gelu,
        F.relu, F.tanh, F.sigmoid, F.softplus, F.mish, F.leaky_relu, torch._C._nn.gelu, F.hardtanh,
        torch.log1p, torch.expm1, torch.sign, torch.nan_to_num, torch.floor, torch.ceil, torch.round, torch.trunc,
        torch.clone, torch.detach,
    ]
    rows = [(f.__name__, fn(f, X0, X1), [x, w], out("b s -", TOKEN)) for f in binary_funcs]
    rows += [(f.__name__, fn(f, X0), [x], out("b s -", TOKEN)) for f in unary_funcs]
    rows += [
        ("floordiv-scalar", fn(operator.floordiv, X0, 2), [x], out("b s -", TOKEN)),
        ("mod-scalar", fn(operator.mod, X0, 3), [x], out("b s -", TOKEN)),
        ("and", fn(operator.and_, X0, X1), [bx, by], out("b s -", TOKEN)),
        ("or", fn(operator.or_, X0, X1), [bx, by], out("b s -", TOKEN)),
        ("xor", fn(operator.xor, X0, X1), [bx, by], out("b s -", TOKEN)),
        ("invert", fn(operator.invert, X0), [bx], out("b s -", TOKEN)),
        ("logical_and", fn(torch.logical_and, X0, X1), [bx, by], out("b s -", TOKEN)),
        ("logical_or", fn(torch.logical_or, X0, X1), [bx, by], out("b s -", TOKEN)),
        ("logical_not", fn(torch.logical_not, X0), [bx], out("b s -", TOKEN)),
        ("where", fn(torch.where, X0, X1, X2), [mask, x, w], out("b s -", TOKEN)),
        ("clamp", fn(torch.clamp, X0, min=0.0), [x], out("b s -", TOKEN)),
        ("masked_fill", fn(torch.masked_fill, X0, X1, 0.0), [x, mask], out("b s -", TOKEN)),
        ("gather-last", fn(torch.gather, X0, -1, X1), [x, idx], out("b s -", TOKEN)),
        # A column value (one row of positions) broadcasts against the token value's batch axis.
        ("column-times-token", fn(operator.mul, X0, X1), [col, x], out("b s -", TOKEN)),
        # A constant of size 1 along the token axes lines up after packing.
        ("size-1-constant", fn(operator.add, X0, X1), [x, In((1, 1, D), "- - -", NONE)], out("b s -", TOKEN)),
        ("column-only", fn(torch.cos, X0), [col], out("- s -", COLUMN)),
        # Complex rotary (DeepSeek-V2, Llama 4): polar(ones_like(freqs), freqs) of a column value, times the
        # token value's complex pairs.
        ("polar", fn(torch.polar, X0, X1), [x, y], out("b s -", TOKEN)),
        ("polar-column", fn(torch.polar, X0, X1), [col, col], out("- s -", COLUMN)),
        ("complex-mul", fn(operator.mul, X0, X1),
         [_complex((B, S, D), "b s -", TOKEN), _complex((1, S, D), "- s -", COLUMN)], out("b s -", TOKEN)),
        ("gather-token-axis", fn(torch.gather, X0, 1, X1), [x, idx], fails("gather along a token axis")),
        ("clash-b-s", fn(operator.add, X0, X1), [In((S, S), "b s", TOKEN), In((S, S), "s b", TOKEN)],
         fails("broadcasts token axis b against s")),
        ("constant-along-s", fn(operator.add, X0, X1), [x, In((S, D), "- -", NONE)],
         fails("combines a constant of length 4 with the s axis")),
    ]
    methods = [
        ("to", (torch.float64,)), ("float", ()), ("half", ()), ("bfloat16", ()), ("double", ()),
        ("type_as", (X1,)), ("contiguous", ()), ("clone", ()), ("detach", ()), ("pow", (2,)), ("rsqrt", ()),
        ("sqrt", ()), ("exp", ()), ("log", ()), ("sin", ()), ("cos", ()), ("neg", ()), ("abs", ()),
        ("sigmoid", ()), ("tanh", ()), ("mul", (X1,)), ("add", (X1,)), ("sub", (X1,)), ("div", (X1,)),
        ("clamp", (0.0,)), ("type", (torch.float64,)), ("requires_grad_", ()), ("long", ()), ("int", ()),
        ("bool", ()), ("log1p", ()), ("expm1", ()), ("square", ()), ("reciprocal", ()), ("float_power", (2,)),
        ("nan_to_num", ()), ("fill_", (0.0,)), ("zero_", ()), ("floor", ()), ("ceil", ()), ("round", ()), ("trunc", ()),
        # comparisons as methods (torch 2.12's Dynamo records ``a == b`` as ``call_method __eq__``)
        ("__eq__", (X1,)), ("__ne__", (X1,)), ("__lt__", (X1,)), ("__le__", (X1,)), ("__gt__", (X1,)),
        ("__ge__", (X1,)), ("eq", (X1,)), ("ne", (X1,)), ("lt", (0.0,)), ("le", (X1,)), ("gt", (0.0,)), ("ge", (X1,)),
    ]
    rows += [(f"{m}-method", meth(m, X0, *a), [x, w], out("b s -", TOKEN)) for m, a in methods]
    rows += [
        ("masked_fill-method", meth("masked_fill", X0, X1, 0.0), [x, mask], out("b s -", TOKEN)),
        ("where-method", meth("where", X0, X1, X2), [x, mask, w], out("b s -", TOKEN)),
        ("__and__-method", meth("__and__", X0, X1), [bx, by], out("b s -", TOKEN)),
        ("__or__-method", meth("__or__", X0, X1), [bx, by], out("b s -", TOKEN)),
        ("__invert__-method", meth("__invert__", X0), [bx], out("b s -", TOKEN)),
        ("gather-method", meth("gather", X0, -1, X1), [x, idx], out("b s -", TOKEN)),
        ("gather-method-token-axis", meth("gather", X0, 1, X1), [x, idx], fails("gather along a token axis")),
        ("mul-method-constant-along-b", meth("mul", X0, X1), [x, In((B, 1, D), "- - -", NONE)],
         fails("combines a constant of length 3 with the b axis")),
    ]
    return rows


LIKE = [
    # The result has its operand's axes, shift and sequence length.
    (f.__name__, fn(f, X0, *a), [In((B, S - 1, D), "b s -", TOKEN, shift=1, slen=S - 1)],
     out("b s -", TOKEN, shift=1, slen=S - 1))
    for f, a in [(torch.ones_like, ()), (torch.zeros_like, ()), (torch.empty_like, ()), (torch.full_like, (1.0,))]
] + [
    ("zeros_like-column", fn(torch.zeros_like, X0), [col], out("- s -", COLUMN)),
    # Noise per token: the original draws for each copy of a shared prompt (as dropout does): refused.
    ("rand_like", fn(torch.rand_like, X0), [x], couples("rand_like draws different values for the copies")),
    ("randn_like-merged", fn(torch.randn_like, X0), [merged], couples("randn_like draws different values")),
    ("randint_like", fn(torch.randint_like, X0, 5), [x], couples("randint_like draws different values")),
    ("randn_like-column", fn(torch.randn_like, X0), [col], out("- s -", COLUMN)),
]

LINEAR = [
    ("projection", fn(F.linear, X0, X1, X2), [x, In((16, D), "- -", NONE), In((16,), "-", NONE)], out("b s -", TOKEN)),
    ("no-bias", fn(F.linear, X0, X1), [merged, In((16, D), "- -", NONE)], out("bs -", TOKEN)),
    ("token-weight", fn(F.linear, X0, X1), [x, In((S, D), "s -", COLUMN)], fails("linear with a token-dependent weight")),
    ("token-bias", fn(F.linear, X0, X1, X2), [x, In((S, D), "- -", NONE), In((S,), "s", COLUMN)],
     fails("linear with a token-dependent weight")),
    ("over-s", fn(F.linear, X0, X1), [x_bds, In((16, S), "- -", NONE)], fails("linear over a token axis")),
]

EMBEDDING = [
    ("ids", fn(F.embedding, X0, X1), [ids, table], out("b s -", TOKEN)),
    ("position-ids-column", fn(F.embedding, X0, X1), [In((1, S), "- s", COLUMN, value=torch.arange(S)[None]), table],
     out("- s -", COLUMN)),
    ("token-table", fn(F.embedding, X0, X1), [ids, In((10, S), "- s", COLUMN)], fails("embedding with a token-dependent table")),
    # torch.embedding takes (weight, indices): ATen's order, not F.embedding's.
    ("torch.embedding", fn(torch.embedding, X0, X1), [table, ids], out("b s -", TOKEN)),
    ("torch.embedding-token-table", fn(torch.embedding, X0, X1), [In((10, S), "- s", COLUMN), ids],
     fails("embedding with a token-dependent table")),
    ("keywords", fn(F.embedding, input=X0, weight=X1), [ids, table], out("b s -", TOKEN)),
]

MATMUL = [
    ("projection", fn(torch.matmul, X0, X1), [x, In((D, 16), "- -", NONE)], out("b s -", TOKEN)),
    ("operator", fn(operator.matmul, X0, X1), [x, In((D, 16), "- -", NONE)], out("b s -", TOKEN)),
    # Rotary: inv_freq[:, None] @ positions[None, :] (a column value on the right).
    ("rotary", fn(torch.matmul, X0, X1), [In((D, 1), "- -", NONE), In((1, S), "- s", COLUMN)], out("- s", COLUMN)),
    ("bmm-batch-constant", fn(torch.bmm, X0, X1), [x, In((B, D, 16), "b - -", BCAST)], out("b s -", TOKEN)),
    ("bmm-constant-over-b", fn(torch.bmm, X0, X1), [x, In((B, D, 16), "- - -", NONE)],
     fails("matmul broadcasting a constant over a token axis")),
    ("contracts-s", fn(torch.matmul, X0, X1), [x_bds, x], fails("matmul that contracts over a token axis")),
    ("attention-like", fn(torch.matmul, X0, X1), [x, x_bds], fails("matmul between two token values (attention-like)")),
    ("vector", fn(torch.matmul, X0, X1), [x, w], fails("matmul with a vector operand")),
    ("different-batch-axes", fn(torch.matmul, X0, X1), [In((S, S, 2, D), "b s - -", TOKEN), In((S, S, D, 2), "s b - -", TOKEN)],
     fails("matmul broadcasting different token axes")),
]

REDUCTIONS = [
    (f"{m}-method", meth(m, X0, dim=-1), [x], out("b s", TOKEN))
    for m in ("mean", "sum", "amax", "amin", "norm", "var", "std", "logsumexp", "prod")
] + [
    (f.__name__, fn(f, X0, dim=-1), [x], out("b s", TOKEN))
    for f in (torch.mean, torch.sum, torch.amax, torch.amin, torch.norm, torch.var, torch.std, torch.logsumexp)
] + [
    ("keepdim", meth("sum", X0, -1, True), [x], out("b s -", TOKEN)),
    ("dims-tuple", fn(torch.mean, X0, (2, 3)), [In((B, S, 2, D), "b s - -", TOKEN)], out("b s", TOKEN)),
    # Over some token axes only (per row, per column): not a sum of per-token terms; the original layout.
    ("along-s", meth("mean", X0, 1), [x], fails("mean along some token axes only")),
    ("along-b-keepdim", fn(torch.sum, X0, 0, keepdim=True), [x], fails("sum along some token axes only")),
    # Over every token axis: weighted by multiplicity on the packed stream (analysis/token_reductions.py).
    ("all-axes", meth("sum", X0), [x], weighs("", "sum")),
    ("token-axes", fn(torch.sum, X0, (0, 1)), [x], weighs("-", "sum")),
    ("mean-token-axes-keepdim", meth("mean", X0, (1, 0), True), [x], weighs("- - -", "mean")),
    ("merged-axis", meth("sum", X0, 0), [merged], weighs("-", "sum")),
    ("torch.mean-merged", fn(torch.mean, X0, dim=0), [merged], weighs("-", "mean")),
    ("next-token-values", meth("sum", X0), [In((B, S - 1), "b s", TOKEN, shift=1, slen=S - 1)], weighs("", "sum")),
    ("mean-of-ints", meth("sum", X0), [In((B, S), "b s", TOKEN, value=torch.ones(B, S, dtype=torch.long))], weighs("", "sum")),
    ("amax-all-axes", fn(torch.amax, X0, (0, 1)), [x], fails("amax along a token axis")),
    ("logsumexp-merged", meth("logsumexp", X0, 0), [merged], fails("logsumexp along a token axis")),
    ("var-method-all", meth("var", X0), [x], fails("var along a token axis")),
    ("sum-column", meth("sum", X0), [col], fails("sum of a column value over the token axes")),
    ("sum-of-inputs", meth("sum", X0), [In((B, S), "b s", TOKEN, from_inputs=True)],
     fails("sum over the token axes of a value of the inputs alone")),
    # norm takes p first: x.norm(2, 1) reduces the sequence axis (dim 1), not dim 2.
    ("norm-p-then-dim-along-s", meth("norm", X0, 2, 1), [x], fails("norm along a token axis")),
    ("torch.norm-p-then-dim-along-s", fn(torch.norm, X0, 2, 1), [x], fails("norm along a token axis")),
    ("norm-p-then-dim", meth("norm", X0, 2, -1), [x], out("b s", TOKEN)),
    ("norm-p-dim-keepdim", meth("norm", X0, 2, -1, True), [x], out("b s -", TOKEN)),
]

_SCALAR = In((), "", NONE)  # xIELU's eps, a 0-d buffer
MIN_MAX = [
    # With a tensor: elementwise (Apertus' xIELU: torch.min(x, eps)).
    ("min-tensor", fn(torch.min, X0, X1), [x, _SCALAR], out("b s -", TOKEN)),
    ("max-tensor", fn(torch.max, X0, X1), [x, y], out("b s -", TOKEN)),
    ("min-other-keyword", fn(torch.min, X0, other=X1), [x, w], out("b s -", TOKEN)),
    ("min-method-tensor", meth("min", X0, X1), [x, _SCALAR], out("b s -", TOKEN)),
    ("max-method-tensor", meth("max", X0, X1), [col, x], out("b s -", TOKEN)),
    ("min-tensor-constant-along-s", fn(torch.min, X0, X1), [x, In((S, D), "- -", NONE)],
     fails("combines a constant of length 4 with the s axis")),
    # With a dim: (values, indices), both with the reduced value's tags; over a feature dim, per token.
    ("min-dim", fn(torch.min, X0, -1), [x], out("b s", TOKEN)),
    ("max-dim-keepdim", fn(torch.max, X0, dim=2, keepdim=True), [x], out("b s -", TOKEN)),
    ("min-method-dim", meth("min", X0, -1), [x], out("b s", TOKEN)),
    ("max-method-dim-keepdim", meth("max", X0, -1, True), [x], out("b s -", TOKEN)),
    ("min-column-features", fn(torch.min, X0, 2), [col], out("- s", COLUMN)),
    # Over a token axis, or over every dim (a reduction across tokens, as amax): the original layout.
    ("min-along-s", fn(torch.min, X0, 1), [x], fails("min along a token axis")),
    ("max-method-along-b", meth("max", X0, dim=0), [x], fails("max along a token axis")),
    ("max-merged", meth("max", X0, 0), [merged], fails("max along a token axis")),
    ("min-all", fn(torch.min, X0), [x], fails("min along a token axis")),
    ("max-method-all", meth("max", X0), [x], fails("max along a token axis")),
    ("min-method-all-column", meth("min", X0), [col], fails("min along a token axis")),
    ("max-unknown-keyword", fn(torch.max, X0, -1, keepdim=False, out=None), [x], fails("max with arguments this rule")),
]

# Expert counts: a constant ``zeros(E)`` gathers each token's entries (top-k ids, a mask repeated k times).
_E_IDS = In((B * S * 2,), "bs", TOKEN, value=torch.randint(0, 4, (B * S * 2,)))
_E_SRC = In((B * S * 2,), "bs", TOKEN)
_E_BASE = In((4,), "-", NONE, value=torch.zeros(4))
SCATTER = [
    ("scatter_add-method", meth("scatter_add", X0, 0, X1, X2), [_E_BASE, _E_IDS, _E_SRC], weighs("-", "scatter_add", 2)),
    ("torch.scatter_add", fn(torch.scatter_add, X0, 0, X1, X2), [_E_BASE, _E_IDS, _E_SRC], weighs("-", "scatter_add", 2)),
    ("index_add-method", meth("index_add", X0, 0, X1, X2), [_E_BASE, _E_IDS, _E_SRC], weighs("-", "index_add", 2)),
    ("torch.index_add", fn(torch.index_add, X0, 0, X1, X2), [_E_BASE, _E_IDS, _E_SRC], weighs("-", "index_add", 2)),
    # The mask's counts alone (no model value): computed in the original layout from the inputs.
    ("of-inputs-alone", meth("scatter_add", X0, 0, X1, X2),
     [_E_BASE, In((B * S * 2,), "bs", TOKEN, value=torch.randint(0, 4, (B * S * 2,)), from_inputs=True), In((B * S * 2,), "bs", TOKEN, from_inputs=True)],
     fails("of the inputs alone")),
    ("into-token-value", meth("scatter_add", X0, 0, X1, X2), [In((B * S * 2,), "bs", TOKEN), _E_IDS, _E_SRC],
     fails("into a value with token axes")),
    ("index-without-token-axes", meth("index_add", X0, 0, X1, X2), [In((B * S * 2, 3), "bs -", TOKEN), In((4,), "-", NONE, value=torch.arange(4)), In((4, 3), "- -", NONE)],
     fails("into a value with token axes")),
    ("along-features", meth("scatter_add", X0, 1, X1, X2),
     [In((B * S, 4), "bs -", TOKEN), In((B * S, 2), "bs -", TOKEN, value=torch.randint(0, 4, (B * S, 2))), In((B * S, 2), "bs -", TOKEN)],
     fails("into a value with token axes")),
    ("split-token-axes", meth("scatter_add", X0, 0, X1, X2),
     [In((4, S), "- -", NONE, value=torch.zeros(4, S)), In((B, S), "b s", TOKEN, value=torch.randint(0, 4, (B, S))), In((B, S), "b s", TOKEN)],
     fails("one merged token axis at dim 0 expected")),
]

NEW_LIKE = [
    # DeepSeek-V3's key states: kv.new_empty(*kv.shape[:-1], d), filled slice by slice.
    ("new_empty-sizes", meth("new_empty", X0, B, S, 24), [x], out("b s -", TOKEN)),
    ("new_zeros-tuple", meth("new_zeros", X0, (B, S, 2)), [x], out("b s -", TOKEN)),
    ("new_ones-merged", meth("new_ones", X0, (B * S, 3)), [merged], out("bs -", TOKEN)),
    ("new_full", meth("new_full", X0, (B, S, D), 1.0), [x], out("b s -", TOKEN)),
    ("new_empty-other-length", meth("new_empty", X0, B, S + 1, D), [x], fails("do not repeat the token axes")),
    ("new_zeros-other-rank", meth("new_zeros", X0, (B * S, D)), [x], fails("do not repeat the token axes")),
]

SOFTMAX = [
    ("F.softmax", fn(F.softmax, X0, -1), [x], out("b s -", TOKEN)),
    ("F.log_softmax", fn(F.log_softmax, X0, dim=-1), [x], out("b s -", TOKEN)),
    ("torch.softmax", fn(torch.softmax, X0, 2), [x], out("b s -", TOKEN)),
    ("torch.log_softmax", fn(torch.log_softmax, X0, -1), [x], out("b s -", TOKEN)),
    ("softmax-method", meth("softmax", X0, -1), [x], out("b s -", TOKEN)),
    ("log_softmax-method", meth("log_softmax", X0, dim=-1), [x], out("b s -", TOKEN)),
    ("along-s", fn(F.softmax, X0, 1), [x], fails("softmax along a token axis")),
    ("along-s-last", meth("softmax", X0, -1), [x_bds], fails("softmax along a token axis")),
]

NORMS = [
    ("F.layer_norm", fn(F.layer_norm, X0, (D,)), [x], out("b s -", TOKEN)),
    ("F.rms_norm", fn(F.rms_norm, X0, (D,), X1), [x, w], out("b s -", TOKEN)),
    ("torch.layer_norm", fn(torch.layer_norm, X0, [D]), [x], out("b s -", TOKEN)),
    ("torch.rms_norm", fn(torch.rms_norm, X0, [D]), [x], out("b s -", TOKEN)),
    ("over-s", fn(F.layer_norm, X0, (S, D)), [x], fails("normalisation over a token axis")),
    ("over-s-last", fn(F.rms_norm, X0, (S,)), [x_bds], fails("normalisation over a token axis")),
]

COUPLING = [
    ("F.batch_norm", fn(F.batch_norm, X0, X1, X2, training=True), [x_bds, In((D,), "-", NONE), In((D,), "-", NONE, value=torch.ones(D))],
     couples("batch_norm mixes values across the batch")),
    ("torch.batch_norm", fn(torch.batch_norm, X0, None, None, X1, X2, False, 0.1, 1e-5, False),
     [x_bds, In((D,), "-", NONE), In((D,), "-", NONE, value=torch.ones(D))], couples("batch_norm mixes values across the batch")),
    ("F.instance_norm", fn(F.instance_norm, X0), [x_bds], couples("instance_norm mixes values along the sequence")),
]

DROPOUT = [
    ("p0", fn(F.dropout, X0, 0.0), [x], out("b s -", TOKEN)),
    ("eval", fn(F.dropout, X0, p=0.1, training=False), [x], out("b s -", TOKEN)),
    ("keeps-shift", fn(torch.dropout, X0, 0.1, False), [In((B, S - 1, D), "b s -", TOKEN, shift=1, slen=S - 1)],
     out("b s -", TOKEN, shift=1, slen=S - 1)),
    ("training", fn(F.dropout, X0, 0.1, True), [x], couples("dropout p=0.1 in training mode draws different masks")),
    ("training-default", fn(F.dropout, X0), [x], couples("dropout p=0.5 in training mode")),
    ("torch.dropout-training", fn(torch.dropout, X0, 0.2, True), [x], couples("dropout p=0.2 in training mode")),
]

CUMULATIVE = [
    ("cumsum-features", fn(torch.cumsum, X0, -1), [x], out("b s -", TOKEN)),
    ("cumprod-features", fn(torch.cumprod, X0, dim=2), [x], out("b s -", TOKEN)),
    ("cumsum-method-features", meth("cumsum", X0, -1), [x], out("b s -", TOKEN)),
    ("cumprod-method-features", meth("cumprod", X0, 2), [x], out("b s -", TOKEN)),
    ("cumsum-along-s", fn(torch.cumsum, X0, 1), [x], couples("cumulative sum along the sequence axis")),
    ("cumsum-method-along-s", meth("cumsum", X0, dim=-1), [x_bds], couples("cumulative sum along the sequence axis")),
    ("cumprod-along-bs", meth("cumprod", X0, 0), [merged], couples("cumulative sum along the sequence axis")),
    # Along the batch axis the rows stay apart.
    ("cumsum-along-b", fn(torch.cumsum, X0, 0), [x], out("b s -", TOKEN)),
    # MoE dispatch values in expert-sorted order (tag r): a running sum over them mixes tokens.
    ("cumsum-along-expert-order", fn(torch.cumsum, X0, 0), [In((B * S * 2, D), "r -", Kind.ROUTED)],
     couples("cumulative sum along the sequence axis")),
]
