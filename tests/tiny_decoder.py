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
    hidden states in training), "noise" (multiplicative noise per token, as
    router jitter draws), "graph_break" (a graph break between the attention
    block and the head).
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
        if self.coupling == "noise":
            h = h * (1 + 0.01 * torch.randn_like(h))
        q, k, v = self.qkv(self.norm(h)).view(B, S, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        p = 0.1 if self.coupling == "dropout" and self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.coupling != "bidirectional")
        h = h + self.out(a.transpose(1, 2).reshape(B, S, -1))
        if self.coupling == "graph_break":
            torch._dynamo.graph_break()
        return self.head(h)


class MatmulRotaryDecoder(nn.Module):
    """Rotary positions built as transformers 5.17 builds them for Qwen3/Llama.

    ``inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1) @ position_ids[:, None, :]``:
    a constant expanded over the batch meets the position ids (a [B, S]
    token input, or a [1, S] column built from ``arange``).
    """

    def __init__(self, vocab=61, dim=32, heads=2, kv_heads=1):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.embed = nn.Embedding(vocab, dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd)))

    def forward(self, input_ids, position_ids=None):
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S)[None]
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        h = self.embed(input_ids)
        q = self.q(h).view(B, S, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(B, S, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)

        def rotate(x):
            half = x.shape[-1] // 2
            return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

        a = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True, enable_gqa=True)
        return self.head(h + self.out(a.transpose(1, 2).reshape(B, S, -1)))
