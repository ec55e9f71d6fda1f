"""Outputs of a packed graph that the program after a graph break modifies in place (docs/design.md, semantics 9).

DBRX's experts loop breaks the graph at ``nonzero``: the graph before the break returns
``next_states = torch.zeros_like(hidden)``, and the code after it fills that tensor with ``index_add_``. Three
things went wrong on that path, each checked here on a tiny model of our own against the unmodified model
(logits at valid positions and every parameter gradient):

* the packed graph returned the buffer as a view (``unpack``'s reshape) made inside AOTAutograd's
  ``autograd.Function`` under ``no_grad``, and the in-place op raised "A view was created in no_grad mode and is
  being modified inplace" (``runtime.runner.own_views``);
* the graph after the break, packed on the carried layout, lost ``out.index_add_(...)``: FX's dead-code
  elimination counts a ``call_method`` pure, and its result is unread (``functionalize.eliminate_dead_code``);
* outputs that alias each other (``h`` and ``flat = h.view(-1, d)``) came back as two unpacks, so an in-place
  change of ``flat`` after the break no longer reached ``h`` (``rewrite.output_aliases``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dualkv_compile

from tests.helpers import BATCHES, check_model, grpo_batch

pytest.importorskip("transformers")  # tests.helpers imports it


class _BufferAfterBreak(nn.Module):
    """Embedding, one causal attention block, then DBRX's pattern: a zeros buffer made before a graph break and
    filled in place after it (``index_add_`` of the experts' output). ``alias``: before filling, the program
    also scales ``flat``, a view of the hidden states that the graph before the break returns beside them."""

    def __init__(self, vocab=61, dim=16, heads=2, alias=False):
        super().__init__()
        self.heads, self.alias = heads, alias
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(64, dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.up = nn.Linear(dim, dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids, position_ids):
        B, S = input_ids.shape
        h = self.embed(input_ids) + self.pos(position_ids)
        q, k, v = self.qkv(h).view(B, S, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + a.transpose(1, 2).reshape(B, S, -1)
        flat = h.view(-1, h.shape[-1])
        out = torch.zeros_like(flat)
        torch._dynamo.graph_break()
        if self.alias:
            flat.mul_(2)  # reaches h: flat is a view of it
        idx = torch.arange(flat.shape[0], device=flat.device)
        out.index_add_(0, idx, self.up(flat))
        return self.head(out.view(B, S, -1) + h)


@pytest.mark.parametrize("alias", [False, True], ids=["buffer", "buffer_and_aliased_view"])
def test_output_modified_in_place_after_a_graph_break(one_thread, alias):
    torch._dynamo.reset()
    torch.manual_seed(0)
    batches = [grpo_batch(BATCHES["one_group"], 61), grpo_batch(BATCHES["three_groups"], 61, seed=1)]
    start = len(dualkv_compile.reports())
    check_model(_BufferAfterBreak(alias=alias).train(), batches, forward=lambda m, ids, mask, pos: m(ids, pos))
    reports = dualkv_compile.reports()[start:]
    with_attention = [r for r in reports if r.num_attention]
    # The graph before the break packed every call (the one after it may run unchanged: with ``alias`` it
    # mutates an input that aliases another, which the rewrite refuses).
    assert with_attention and sum(r.packed_calls for r in with_attention) == len(batches), [str(r) for r in reports]
