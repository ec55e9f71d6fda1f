"""An MoE with an expert capacity (Switch-style token dropping) couples tokens: refused with the reason, exact.

A token's place in its expert's queue is a running count over the tokens before it in the batch
(``cumsum`` of the one-hot routing along the flattened token axis); tokens past the capacity are dropped.
Packing removes the shared copies of a prompt from that count, so whether a token is dropped would
change: the graph is refused (docs/design.md, semantics 7) and the original program runs. The same decoder
without the capacity packs, so the refusal is the capacity's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dualkv_compile

from tests.helpers import check_model, grpo_batch

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, DIM, EXPERTS = 61, 16, 4


class CapacityMoEDecoder(nn.Module):
    """Embedding, one causal attention block, a top-1 MoE with ``capacity`` tokens per expert (None: no limit)."""

    def __init__(self, capacity):
        super().__init__()
        self.capacity = capacity
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(64, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.Parameter(torch.randn(EXPERTS, DIM, DIM) * 0.3)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids, position_ids):
        B, S = input_ids.shape
        h = self.embed(input_ids) + self.pos(position_ids)
        q, k, v = self.qkv(h).view(B, S, 3, 2, -1).permute(2, 0, 3, 1, 4)
        h = h + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, DIM)
        flat = h.reshape(B * S, DIM)
        weight, expert = torch.softmax(self.router(flat), dim=-1).topk(1, dim=-1)
        routed = F.one_hot(expert[:, 0], EXPERTS).float()  # [B*S, E]
        if self.capacity is not None:
            queue = torch.cumsum(routed, dim=0) * routed  # each token's place in its expert's queue
            routed = routed * (queue <= self.capacity).float()  # later tokens are dropped
        out = torch.einsum("te,edf,td->tf", routed, self.experts, flat) * weight
        return self.head(h + out.reshape(B, S, DIM))


def _run(capacity):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = CapacityMoEDecoder(capacity)
    batch = grpo_batch([(6, [3, 4, 2]), (5, [2, 3])], VOCAB, left_pad=0, right_pad=0)
    before = len(dualkv_compile.reports())
    # Outputs at valid positions and every gradient against the unmodified model, 1e-5.
    check_model(model, [batch], forward=lambda m, ids, mask, pos: m(ids, pos))
    (report,) = dualkv_compile.reports()[before:]
    return report


def test_capacity_limited_moe_is_refused_and_exact():
    report = _run(capacity=3)  # 5 rows of up to 10 tokens over 4 experts: the capacity binds
    assert not report.rewritten and report.packed_calls == 0
    assert "cumulative sum along the sequence axis couples tokens" in report.reason, report.reason


def test_same_moe_without_capacity_packs():
    report = _run(capacity=None)
    assert report.rewritten and report.packed_calls == 1, report.reason
