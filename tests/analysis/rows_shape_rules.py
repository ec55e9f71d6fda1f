"""Rule rows of analysis/shape_rules.py: slice_scatter, view, complex views, move, getitem, cat, stack, split, size
(one list per family; ``test_token_rules.TABLES`` runs them).

Written in the row language of ``rule_rows.py``.
"""

from __future__ import annotations

import operator

import torch

from .rule_rows import B, BCAST, COLUMN, D, NONE, S, TOKEN, In, X0, X1, col, fails, fn, ids, mask, merged, meth, out, table, x, y


SLICE_SCATTER = [
    ("features", fn(torch.slice_scatter, X0, X1, -1, 0, 2), [x, In((B, S, 2), "b s -", TOKEN)], out("b s -", TOKEN)),
    ("method", meth("slice_scatter", X0, X1, 2, 2, None), [x, In((B, S, D - 2), "b s -", TOKEN)], out("b s -", TOKEN)),
    ("along-s", fn(torch.slice_scatter, X0, X1, 1, 0, 2), [x, In((B, 2, D), "b - -", TOKEN)], fails("slice_scatter along a token axis")),
    ("constant-src", fn(torch.slice_scatter, X0, X1, -1, 0, 2), [x, In((B, S, 2), "- - -", NONE)],
     fails("combines token and non-token values")),
]

VIEW = [
    ("merge-b-s", meth("view", X0, B * S, D), [x], out("bs -", TOKEN)),
    ("split-bs", meth("view", X0, B, S, D), [merged], out("b s -", TOKEN)),
    ("split-bs-after-shift", meth("reshape", X0, B, S - 1, D), [In(((S - 1) * B, D), "bs -", TOKEN, slen=S - 1)],
     out("b s -", TOKEN)),
    ("heads", meth("view", X0, B, S, 2, D // 2), [x], out("b s - -", TOKEN)),
    ("reshape-heads-back", meth("reshape", X0, B, S, D), [In((B, S, 2, D // 2), "b s - -", TOKEN)], out("b s -", TOKEN)),
    ("torch.reshape", fn(torch.reshape, X0, (B * S, D)), [x], out("bs -", TOKEN)),
    ("flatten-b-s", meth("flatten", X0, 0, 1), [x], out("bs -", TOKEN)),
    ("torch.flatten", fn(torch.flatten, X0, 0, 1), [x], out("bs -", TOKEN)),
    ("unflatten", meth("unflatten", X0, 0, (B, S)), [merged], out("b s -", TOKEN)),
    ("unit-dims", meth("view", X0, B, 1, S, D), [x], out("b - s -", TOKEN)),
    # The sequence axis merged with the features (s-major) and split back.
    ("merge-s-features", meth("view", X0, B, S * D), [x], out("b s", TOKEN)),
    ("split-s-features", meth("view", X0, B, S, D), [In((B, S * D), "b s", TOKEN)], out("b s -", TOKEN)),
    # A merged axis of k entries per token split into [tokens * g, k / g]: the first dim keeps whole tokens.
    # [b, s, f] -> [b*s*g, f/g] in one reshape (OLMo-hybrid's per-head gate): merged token-major, g per token.
    ("merge-split-per-token", meth("reshape", X0, B * S * 2, D // 2), [x], out("bs -", TOKEN)),
    ("merge-split-not-token-major", meth("reshape", X0, B * S // 2, 2 * D), [x], fails("splits a token axis")),
    ("per-token-entries-back", meth("reshape", X0, B, S, D), [In((B * S * 2, D // 2), "bs -", TOKEN)], out("b s -", TOKEN)),
    ("per-token-entries-back-wrong-split", meth("reshape", X0, S, B, D), [In((B * S * 2, D // 2), "bs -", TOKEN)],
     fails("splits a token axis")),
    ("split-bs-per-token", meth("view", X0, B * S, 2, D), [In((B * S * 2, D), "bs -", TOKEN)], out("bs - -", TOKEN)),
    ("split-bs-two-per-token", meth("view", X0, B * S * 2, 2), [In((B * S * 4,), "bs", TOKEN)], out("bs -", TOKEN)),
    ("split-s-two-per-token", meth("view", X0, B, 2 * S, 2), [In((B, 4 * S), "b s", TOKEN)], out("b s -", TOKEN)),
    ("split-bs-across-tokens", meth("view", X0, 2, B * S, D), [In((B * S * 2, D), "bs -", TOKEN)],
     fails("reshape [24, 8] -> [2, 12, 8] that splits a token axis")),
    ("split-s", meth("view", X0, B, 2, S // 2, D), [x], fails("reshape [3, 4, 8] -> [3, 2, 2, 8] that splits a token axis")),
    ("split-bs-wrong-slen", meth("view", X0, B, S, D), [In((B * S, D), "bs -", TOKEN, slen=S // 2)],
     fails("reshape splitting the sequence axis")),
    ("merge-s-b", meth("view", X0, S * B, D), [In((S, B, D), "s b -", TOKEN)], fails("reshape merging ['s', 'b']")),
    ("features-ahead", meth("reshape", X0, D * B, S), [In((D, B, S), "- b s", TOKEN)],
     fails("reshape that merges feature dims ahead of a token axis")),
    # A batch of one row (a remove-padding batch [1, total]): the size-1 batch axis keeps its tag.
    ("one-row-heads-back", meth("reshape", X0, 1, S, D), [In((1, S, 2, D // 2), "b s - -", TOKEN)], out("b s -", TOKEN)),
    ("one-row-merge", meth("view", X0, S, D), [In((1, S, D), "b s -", TOKEN)], out("bs -", TOKEN)),
]

def _complex(shape, spec, kind):
    return In(shape, spec, kind, value=torch.randn(shape, dtype=torch.complex64))


COMPLEX = [
    # DeepSeek-V2's q_pe: [b, heads, s, d/2, 2] reals -> [b, heads, s, d/2] complex, and back after the rotation.
    ("view_as_complex", fn(torch.view_as_complex, X0), [In((B, 2, S, 4, 2), "b - s - -", TOKEN)], out("b - s -", TOKEN)),
    ("view_as_complex-merged", fn(torch.view_as_complex, X0), [In((B * S, 4, 2), "bs - -", TOKEN)], out("bs -", TOKEN)),
    ("view_as_complex-column", fn(torch.view_as_complex, X0), [In((1, S, 4, 2), "- s - -", COLUMN)], out("- s -", COLUMN)),
    ("view_as_real", fn(torch.view_as_real, X0), [_complex((B, S, 4), "b s -", TOKEN)], out("b s - -", TOKEN)),
    ("view_as_real-column", fn(torch.view_as_real, X0), [_complex((S, 4), "s -", COLUMN)], out("s - -", COLUMN)),
    # The pair axis is a token axis (a [.., S] value with S == 2): no per-token form.
    ("view_as_complex-of-s", fn(torch.view_as_complex, X0), [In((D, 2), "- s", COLUMN)],
     fails("view_as_complex of a token axis")),
]

MOVE = [
    ("transpose", meth("transpose", X0, 1, 2), [x], out("b - s", TOKEN)),
    ("torch.transpose", fn(torch.transpose, X0, 0, 1), [x], out("s b -", TOKEN)),
    ("permute-args", meth("permute", X0, 0, 2, 1), [x], out("b - s", TOKEN)),
    ("permute-tuple", meth("permute", X0, (2, 0, 1)), [x], out("- b s", TOKEN)),
    ("torch.permute", fn(torch.permute, X0, (1, 0, 2)), [x], out("s b -", TOKEN)),
    ("unsqueeze", meth("unsqueeze", X0, 1), [x], out("b - s -", TOKEN)),
    ("torch.unsqueeze", fn(torch.unsqueeze, X0, -1), [x], out("b s - -", TOKEN)),
    ("squeeze-dim", meth("squeeze", X0, -1), [mask], out("b s", TOKEN)),
    ("squeeze-all", meth("squeeze", X0), [In((B, 1, S, 1), "b - s -", TOKEN)], out("b s", TOKEN)),
    ("torch.squeeze-not-1", fn(torch.squeeze, X0, 2), [x], out("b s -", TOKEN)),
    ("movedim", meth("movedim", X0, 2, 0), [x], out("- b s", TOKEN)),
    ("torch.movedim", fn(torch.movedim, X0, 1, 2), [x], out("b - s", TOKEN)),
    ("t", meth("t", X0), [ids], out("s b", TOKEN)),
    ("expand-features", meth("expand", X0, B, S, D), [mask], out("b s -", TOKEN)),
    # A column value expanded over the batch gains the batch axis; so does a constant (BCAST).
    ("expand-column", meth("expand", X0, B, -1, -1), [col], out("b s -", TOKEN)),
    ("expand-constant", meth("expand", X0, B, D), [In((1, D), "- -", NONE)], out("b -", BCAST)),
    ("expand-new-dims", meth("expand", X0, 2, B, S, D), [x], out("- b s -", TOKEN)),
    ("expand-size-node", meth("expand", X0, X1, -1, -1), [col, In(value=B)], out("b s -", TOKEN)),
]

GETITEM = [
    ("drop-last", fn(operator.getitem, X0, (slice(None), slice(None, -1))), [In((B, S, D), "b s -", TOKEN, slen=S)],
     out("b s -", TOKEN, shift=0, slen=S - 1)),
    ("next-tokens", fn(operator.getitem, X0, (slice(None), slice(1, None))), [In((B, S), "b s", TOKEN, slen=S)],
     out("b s", TOKEN, shift=1, slen=S - 1)),
    ("full-slice", fn(operator.getitem, X0, (slice(None), slice(0, S), Ellipsis)), [In((B, S, D), "b s -", TOKEN, slen=S)],
     out("b s -", TOKEN, slen=S)),
    # apply_mask_to_padding_states' attention_mask[:, -T:] (Qwen3-Next, Mamba, LFM2): the whole axis.
    ("full-slice-negative-start", fn(operator.getitem, X0, (slice(None), slice(-S, None))),
     [In((B, S), "b s", TOKEN, slen=S)], out("b s", TOKEN, slen=S)),
    ("last-columns", fn(operator.getitem, X0, (slice(None), slice(-2, None))), [In((B, S, D), "b s -", TOKEN, slen=S)],
     fails("slice along a token axis (other than one next-token shift)")),
    ("next-tokens-negative-start", fn(operator.getitem, X0, (slice(None), slice(1 - S, None))),
     [In((B, S), "b s", TOKEN, slen=S)], out("b s", TOKEN, shift=1, slen=S - 1)),
    ("feature-index", fn(operator.getitem, X0, (Ellipsis, 0)), [x], out("b s", TOKEN)),
    ("feature-slice", fn(operator.getitem, X0, (Ellipsis, slice(None, D // 2))), [x], out("b s -", TOKEN)),
    ("new-axis", fn(operator.getitem, X0, (slice(None), None, slice(None))), [x], out("b - s -", TOKEN)),
    ("gather-rows-of-constant", fn(operator.getitem, X0, X1), [table, ids], out("b s -", TOKEN)),
    ("split-element", fn(operator.getitem, X0, 1),
     [In(tags="b s -", kind=TOKEN, value=(torch.randn(B, S, D // 2), torch.randn(B, S, D // 2)))], out("b s -", TOKEN)),
    ("single-position", fn(operator.getitem, X0, (slice(None), 0)), [x], fails("indexing a single position of a token axis")),
    ("single-row", fn(operator.getitem, X0, 0), [x], fails("indexing a single position of a token axis")),
    ("strided", fn(operator.getitem, X0, (slice(None), slice(None, None, 2))), [In((B, S, D), "b s -", TOKEN, slen=S)],
     fails("strided slice along a token axis")),
    ("two-columns-off", fn(operator.getitem, X0, (slice(None), slice(1, -1))), [In((B, S, D), "b s -", TOKEN, slen=S)],
     fails("slice along a token axis (other than one next-token shift)")),
    ("shift-twice", fn(operator.getitem, X0, (slice(None), slice(1, None))),
     [In((B, S - 1, D), "b s -", TOKEN, shift=1, slen=S - 1)], fails("other than one next-token shift")),
    ("slice-rows", fn(operator.getitem, X0, slice(1, None)), [x], fails("slice along a token axis")),
    ("advanced", fn(operator.getitem, X0, X1), [x, In((B, S), "b s", TOKEN, value=torch.randint(0, B, (B, S)))],
     fails("advanced indexing of a token value")),
]

CAT = [
    ("features", fn(torch.cat, [X0, X1], -1), [x, y], out("b s -", TOKEN)),
    ("features-kwarg", fn(torch.cat, (X0, X1), dim=2), [x, y], out("b s -", TOKEN)),
    ("concatenate-features", fn(torch.concatenate, [X0, X1], dim=-1), [x, y], out("b s -", TOKEN)),
    ("concat-along-s", fn(torch.concat, [X0, X1], 1), [x, y], fails("concatenation along a token axis")),
    ("skips-empty", fn(torch.cat, [X0, X1], 1), [x, In((0,), "-", NONE)], out("b s -", TOKEN)),
    ("along-s", fn(torch.cat, [X0, X1], 1), [x, y], fails("concatenation along a token axis")),
    ("along-b", fn(torch.cat, [X0, X1]), [x, y], fails("concatenation along a token axis")),
    ("with-constant", fn(torch.cat, [X0, X1], -1), [x, In((B, S, D), "- - -", NONE)],
     fails("combines token and non-token values along one axis")),
    ("different-axes", fn(torch.cat, [X0, X1], -1), [In((S, S, D), "b s -", TOKEN), In((S, S, D), "s b -", TOKEN)],
     fails("combines values with different token axes")),
]

STACK = [
    ("front", fn(torch.stack, [X0, X1]), [x, y], out("- b s -", TOKEN)),
    ("last", fn(torch.stack, [X0, X1], dim=-1), [x, y], out("b s - -", TOKEN)),
    ("with-constant", fn(torch.stack, [X0, X1], 2), [x, In((B, S, D), "- - -", NONE)],
     fails("combines token and non-token values along one axis")),
]

SPLIT = [
    ("split-method", meth("split", X0, 2, -1), [x], out("b s -", TOKEN)),
    ("torch.split", fn(torch.split, X0, [2, 6], dim=2), [x], out("b s -", TOKEN)),
    ("chunk-method", meth("chunk", X0, 2, -1), [x], out("b s -", TOKEN)),
    ("torch.chunk", fn(torch.chunk, X0, 4, 2), [x], out("b s -", TOKEN)),
    ("unbind-method", meth("unbind", X0, -1), [x], out("b s", TOKEN)),
    ("torch.unbind", fn(torch.unbind, X0, 2), [x], out("b s", TOKEN)),
    ("split-along-s", meth("split", X0, 2, 1), [x], fails("split along a token axis")),
    ("torch.chunk-along-b", fn(torch.chunk, X0, 3), [x], fails("split along a token axis")),
    ("unbind-along-s", meth("unbind", X0, 1), [x], fails("split along a token axis")),
]

# x.size() of a token value: sizes of the original layout, no token axes (the rewrite keeps them as numbers).
SIZE = [
    ("size", meth("size", X0), [x], out("", NONE)),
    ("size-of-s", meth("size", X0, 1), [x], out("", NONE)),
    ("size-dim-keyword", meth("size", X0, dim=0), [merged], out("", NONE)),
    ("size-of-column", meth("size", X0, -1), [col], out("", NONE)),
]
