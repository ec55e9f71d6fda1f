"""Operands passed by keyword (``normalize.positional_args``): made positional before the analysis reads them.

A model that called ``F.linear(input=x, weight=w)`` or ``F.embedding(input=ids, weight=table)`` made the
backend raise ``IndexError`` (the rules read ``node.args``), failing the user's ``torch.compile``.
"""

from __future__ import annotations


import expecttest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dualkv_compile.normalize.positional_args import positional_args

from tests.helpers import capture, check_model, grpo_batch, normalise

VOCAB = 61


class KeywordDecoder(nn.Module):
    """One attention layer whose embedding and projections pass their operands by keyword."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.table = nn.Parameter(torch.randn(VOCAB, dim))
        self.qkv = nn.Parameter(torch.randn(3 * dim, dim) / dim**0.5)
        self.head = nn.Parameter(torch.randn(VOCAB, dim) / dim**0.5)

    def forward(self, input_ids, attention_mask=None):
        B, S = input_ids.shape
        h = F.embedding(input=input_ids, weight=self.table)
        qkv = torch.reshape(input=F.linear(input=h, weight=self.qkv), shape=(B, S, 3, self.heads, -1))
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + a.transpose(1, 2).reshape(shape=(B, S, -1))
        # Keyword-only parameters stay keywords: dtype= of torch.softmax.
        return torch.softmax(F.linear(input=h, weight=self.head), dim=-1, dtype=torch.float32)


class TestPositionalArgs(expecttest.TestCase):
    def test_graph_diff(self):
        ids, _, _ = grpo_batch([(7, [3, 5])], VOCAB)
        gm = capture(KeywordDecoder(), ids)
        out = positional_args(gm)
        assert out is not gm
        # The calls that passed their operands by keyword read positionally; softmax's dtype stays a keyword.
        calls = [ln.strip() for ln in normalise(out.code).splitlines()
                 if "linear(" in ln or "embedding(" in ln or "softmax(" in ln]
        self.assertExpectedInline("\n".join(calls), """\
h = torch.nn.functional.embedding(l_input_ids_, l_self_parameters_table_)
linear = torch._C._nn.linear(h, l_self_parameters_qkv_)
linear_1 = torch._C._nn.linear(h_1, l_self_parameters_head_)
softmax = torch.softmax(linear_1, dim = -1, dtype = torch.float32)""")
        # The original graph is left as it was (the fallback runs it).
        assert "input = " in gm.code and "input = " not in out.code

    def test_only_the_leading_parameters_move(self):
        def f(x, w):
            return (torch.sum(input=x, dim=-1), torch.softmax(input=x, dim=-1),
                    F.layer_norm(input=x, normalized_shape=(4,)), torch.matmul(input=x, other=w),
                    torch.cumsum(input=x, dim=1), F.linear(x, weight=w.t(), bias=None),
                    torch.reshape(input=x, shape=(6, 4)), x.reshape(shape=(3, 8)), x.new_zeros(size=(2,)))

        out = positional_args(capture(f, torch.randn(2, 3, 4), torch.randn(4, 5)))
        self.assertExpectedInline(normalise(out.code), """\
def forward(self, L_x_ : torch.Tensor, L_w_ : torch.Tensor):
    sum_1 = torch.sum(l_x_, dim = -1)
    softmax = torch.softmax(l_x_, dim = -1)
    layer_norm = torch.nn.functional.layer_norm(l_x_, (4,))
    matmul = torch.matmul(l_x_, l_w_)
    cumsum = torch.cumsum(l_x_, dim = 1)
    t = l_w_.t()
    linear = torch._C._nn.linear(l_x_, t, bias = None)
    reshape = torch.reshape(l_x_, (6, 4))
    reshape_1 = l_x_.reshape((3, 8))
    new_zeros = l_x_.new_zeros((2,))
    return (sum_1, softmax, layer_norm, matmul, cumsum, linear, reshape, reshape_1, new_zeros)""")

    def test_an_overloaded_call_moves_with_its_argument_types(self):
        """``torch.var`` binds to an overload only given its arguments' types (on torch 2.12 so did
        ``torch.sum``, ``softmax``, ``cumsum`` and most reductions); it used to keep ``input=``."""
        def f(x):
            return torch.var(input=x, dim=-1), torch.clamp(input=x, min=0.0)

        out = positional_args(capture(f, torch.randn(2, 3, 4)))
        self.assertExpectedInline(normalise(out.code), """\
def forward(self, L_x_ : torch.Tensor):
    var = torch.var(l_x_, dim = -1)
    clamp = torch.clamp(l_x_, min = 0.0)
    return (var, clamp)""")

    def test_a_graph_without_keyword_operands_is_returned_as_is(self):
        def f(x, w):
            return torch.softmax(F.linear(x, w), dim=-1)

        gm = capture(f, torch.randn(2, 3, 4), torch.randn(5, 4))
        assert positional_args(gm) is gm


def test_keyword_operands_pack_and_match_the_model():
    """Before the fix the backend raised IndexError here; now the model runs packed and exact."""
    from dualkv_compile import reports

    model = KeywordDecoder()
    ids, mask, pos = grpo_batch([(9, [4, 6, 3])], VOCAB)
    start = len(reports())
    check_model(model, [(ids, mask, pos)], forward=lambda m, i, mk, p: m(i, mk))
    assert any(r.rewritten and r.packed_calls for r in reports()[start:])
