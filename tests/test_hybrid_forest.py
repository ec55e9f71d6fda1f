"""Hybrid layers on the packed forest (issue 51): a causal convolution and a gated delta rule, each segment's scan
from its parent's final state, against the unpacked model (docs/design.md, semantics 16).

``TinyHybrid`` is transformers' GDN layer cut to what the rewrite reads: the padding zeroed by the attention mask
(``apply_mask_to_padding_states``), an input projection, ``nn.Conv1d(padding=K-1)`` sliced to the row
(``normalize.causal_conv`` fuses it), transformers' ``torch_chunk_gated_delta_rule`` (Dynamo records the opaque
``dualkv::gated_delta_rule``: ``integrations.hf_hybrids``), then causal attention with the padding mask. Its
switches make the padding before a row's tokens reach the recurrence (``mask=False``; a convolution bias with no
mask after it), which must run the call unpacked with the reason.
"""

from __future__ import annotations

import copy
import functools
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dualkv_compile
from dualkv_compile.backend import dualkv_backend
from dualkv_compile.normalize.causal_conv import fuse_causal_conv1d
from dualkv_compile.ops.forest_recurrent import causal_conv1d

from tests.helpers import capture, grpo_batch, rel

modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
VOCAB = 53


class TinyHybrid(nn.Module):
    def __init__(self, dim=16, heads=2, head_dim=4, kernel=4, mask=True, conv_bias=False):
        super().__init__()
        self.heads, self.hd, self.mask = heads, head_dim, mask
        inner = heads * head_dim
        self.embed = nn.Embedding(VOCAB, dim)
        self.in_proj = nn.Linear(dim, 3 * inner + 2 * heads, bias=False)
        self.conv = nn.Conv1d(3 * inner, 3 * inner, kernel, groups=3 * inner, padding=kernel - 1, bias=conv_bias)
        self.a_log = nn.Parameter(torch.zeros(heads).uniform_(0, 1).log())
        self.out_proj = nn.Linear(inner, dim, bias=False)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, input_ids, attention_mask):
        B, S = input_ids.shape
        h = self.embed(input_ids)
        x = h * attention_mask[:, -S:, None].to(h.dtype) if self.mask else h
        proj = self.in_proj(x)
        mixed, b, a = proj.split([3 * self.heads * self.hd, self.heads, self.heads], dim=-1)
        mixed = F.silu(self.conv(mixed.transpose(1, 2))[..., :S]).transpose(1, 2)
        q, k, v = (t.reshape(B, S, self.heads, self.hd) for t in mixed.split(self.heads * self.hd, dim=-1))
        g = -self.a_log.exp() * F.softplus(a)
        core, _ = modeling.torch_chunk_gated_delta_rule(q, k, v, g, b.sigmoid(), chunk_size=4,
                                                        use_qk_l2norm_in_kernel=True)
        h = h + self.out_proj(core.reshape(B, S, -1))
        q, k, v = self.qkv(h).view(B, S, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        keep = torch.ones(S, S, dtype=torch.bool).tril()[None, None] & attention_mask.bool()[:, None, None, :]
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.head(h + att.transpose(1, 2).reshape(B, S, -1))


def _forest_batch(seed: int):
    """Groups of depth 1-3 (responses sharing a first token or two), rows shuffled, left padding."""
    rnd = random.Random(seed)
    groups = [(rnd.randint(3, 7), [rnd.randint(1, 5) for _ in range(rnd.randint(2, 4))]) for _ in range(rnd.randint(1, 3))]
    ids, mask, _ = grpo_batch(groups, VOCAB, left_pad=rnd.randint(0, 2), seed=seed, share_response_tokens=seed % 3)
    perm = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(seed))
    return ids[perm], mask[perm]


def _run(model, ids, mask):
    torch._dynamo.reset()
    ref = copy.deepcopy(model)
    start = len(dualkv_compile.reports())
    compiled = torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    proj = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1))
    valid = mask.bool()
    out, want = compiled(ids, mask)[valid], ref(ids, mask)[valid]
    (out @ proj).sum().backward()
    (want @ proj).sum().backward()
    assert rel(out, want) <= 1e-5
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel(p.grad, q.grad) <= 1e-5, name
    return dualkv_compile.reports()[start:]


def test_the_convolution_and_its_slice_become_one_call():
    model = TinyHybrid()
    ids, mask = _forest_batch(0)
    gm = capture(model, ids, mask)
    fused = fuse_causal_conv1d(gm)
    calls = [n for n in fused.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls].count(causal_conv1d) == 1
    assert not any(n.target in (torch.conv1d, F.conv1d) for n in calls)
    assert any(n.target in (torch.conv1d, F.conv1d) for n in gm.graph.nodes)  # the original is left as it was
    x = torch.randn(2, 6, 9)
    w = torch.randn(6, 1, 4)
    assert torch.equal(causal_conv1d(x, w), F.conv1d(x, w, padding=3, groups=6)[..., :9])


@pytest.mark.parametrize("variant", ["padding_3", "groups_1", "slice_from_1"])
def test_other_convolutions_are_left_alone(variant):
    class Conv(nn.Module):
        def forward(self, x, w):
            pad, groups, start = (3, 6, 0) if variant != "padding_3" else (2, 6, 0)
            if variant == "groups_1":
                w, groups = w.expand(6, 6, 4).contiguous(), 1
            if variant == "slice_from_1":
                start = 1
            return F.conv1d(x, w, padding=pad, groups=groups)[..., start : x.shape[-1]]

    gm = capture(Conv(), torch.randn(2, 6, 9), torch.randn(6, 1, 4))
    assert fuse_causal_conv1d(gm) is gm


@pytest.mark.parametrize("seed", range(4))
def test_packed_and_exact_on_shuffled_forests(seed, one_thread):
    reports = _run(TinyHybrid(), *_forest_batch(seed))
    assert sum(r.packed_calls for r in reports) == 1
    text = str(reports[0])
    assert "recurrent layers on the forest: causal convolution x1, gated delta rule x1" in text


@pytest.mark.parametrize("switch", [dict(mask=False), dict(conv_bias=True, mask=False)])
def test_left_padding_that_reaches_the_recurrence_runs_unpacked(switch, one_thread):
    ids, mask = _forest_batch(2)
    assert (mask[:, 0] == 0).any()  # some row has padding before its tokens
    reports = _run(TinyHybrid(**switch), ids, mask)
    assert sum(r.packed_calls for r in reports) == 0
    assert any("padding before a row's tokens reaches" in why for r in reports for why in r.fallback_reasons)
    assert "left-padded calls run unpacked: causal_conv1d: its input is not zero" in str(reports[0])


def test_without_left_padding_an_unmasked_model_packs(one_thread):
    ids, mask = _forest_batch(3)
    lead = int((mask.cumsum(1) == 0).sum(1).min())
    keep = (mask.cumsum(1) > 0).any(0)
    ids, mask = ids[:, keep], mask[:, keep]
    if (mask[:, 0] == 0).any():  # rows of other prompt lengths keep some left padding: drop those rows
        rows = mask[:, 0] == 1
        ids, mask = ids[rows], mask[rows]
    assert lead >= 0 and (mask[:, 0] == 1).all()
    reports = _run(TinyHybrid(mask=False), ids, mask)
    assert sum(r.packed_calls for r in reports) == 1
