"""A small hand-written decoder for backend tests: readable graphs, and switches for each refusal."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyDecoder(nn.Module):
    """Embedding, one pre-norm attention block with rotary-free positions, lm head.

    coupling: None, "dropout" (attention dropout in training), "cumsum" (a
    running sum along the sequence feeding the block), "bidirectional"
    (attention without the causal flag), "batchnorm" (batch norm over the
    hidden states in training), "graph_break" (a graph break between the
    attention block and the head).
    """

    def __init__(self, vocab=61, dim=16, heads=2, coupling=None):
        super().__init__()
        self.heads, self.coupling = heads, coupling
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(64, dim)
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.bn = nn.BatchNorm1d(dim)

    def forward(self, input_ids, position_ids):
        B, S = input_ids.shape
        h = self.embed(input_ids) + self.pos(position_ids)
        if self.coupling == "cumsum":
            h = h.cumsum(1)
        if self.coupling == "batchnorm":
            h = self.bn(h.reshape(B * S, -1)).reshape(B, S, -1)
        q, k, v = self.qkv(self.norm(h)).view(B, S, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        p = 0.1 if self.coupling == "dropout" and self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.coupling != "bidirectional")
        h = h + self.out(a.transpose(1, 2).reshape(B, S, -1))
        if self.coupling == "graph_break":
            torch._dynamo.graph_break()
        return self.head(h)
