"""The Mamba-2 scan on the packed forest (issue 51): each segment's scan from its parent's final state, against
the unpacked model (docs/design.md, semantics 16).

``TinyMamba2`` is transformers' Mamba-2 mixer (``Mamba2Mixer.torch_forward``, also Nemotron-H's, Falcon-H1's,
Bamba's, Zamba2's and GraniteMoeHybrid's) cut to what the rewrite reads: the padding zeroed by the attention mask
(``apply_mask_to_padding_states``) before the input projection and again after the convolution, the causal
convolution over x, B and C, dt through ``dt_bias`` and softplus inside the scan, transformers' own
``mamba2_chunk_scan`` (Dynamo records the opaque ``dualkv::mamba2_chunk_scan``: ``integrations.hf_hybrids``),
then optionally causal attention with the padding mask. Its switches: no attention at all (a pure state-space
model packs too), no mask (the padding before a row's tokens reaches the scan: unpacked, with the reason), a
binding ``dt_limit``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dualkv_compile.analysis.analyze import analyze
from dualkv_compile.normalize.causal_conv import fuse_causal_conv1d

from tests.helpers import capture
from tests.test_hybrid_forest import VOCAB, _forest_batch, _run

modeling = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")


class TinyMamba2(nn.Module):
    def __init__(self, dim=16, heads=4, head_dim=4, groups=2, state=4, kernel=4, attention=True, mask=True,
                 dt_limit=(0.0, float("inf")), divide=None):
        super().__init__()
        self.h, self.p, self.g, self.n = heads, head_dim, groups, state
        self.attention, self.mask, self.dt_limit, self.divide = attention, mask, dt_limit, divide
        inner, conv_dim = heads * head_dim, heads * head_dim + 2 * groups * state
        self.embed = nn.Embedding(VOCAB, dim)
        self.in_proj = nn.Linear(dim, inner + conv_dim + heads, bias=False)
        self.conv = nn.Conv1d(conv_dim, conv_dim, kernel, groups=conv_dim, padding=kernel - 1, bias=False)
        self.A_log = nn.Parameter(torch.linspace(0.0, 1.0, heads))
        self.D = nn.Parameter(torch.randn(heads))
        self.dt_bias = nn.Parameter(torch.randn(heads))
        self.out_proj = nn.Linear(inner, dim, bias=False)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False) if attention else None
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def _masked(self, x, attention_mask):
        return x * attention_mask[:, :, None].to(x.dtype) if self.mask else x

    def forward(self, input_ids, attention_mask):
        B, S = input_ids.shape
        h = self.embed(input_ids)
        proj = self.in_proj(self._masked(h, attention_mask))
        gate, xbc, dt = proj.split([self.h * self.p, self.h * self.p + 2 * self.g * self.n, self.h], dim=-1)
        xbc = self._masked(F.silu(self.conv(xbc.transpose(1, 2))[..., :S].transpose(1, 2)), attention_mask)
        x, Bm, Cm = xbc.split([self.h * self.p, self.g * self.n, self.g * self.n], dim=-1)
        if self.divide == "number":
            x, Bm = x / 2.0, Bm / 2.0
        elif self.divide == "tensor":  # a tensor divisor could be zero at the padding: 0 / 0 is not 0
            x, Bm = x / xbc.sum(-1, keepdim=True), Bm / xbc.sum(-1, keepdim=True)
        y = modeling.mamba2_chunk_scan(
            x.reshape(B, S, self.h, self.p), dt, -torch.exp(self.A_log.float()), Bm.reshape(B, S, self.g, self.n),
            Cm.reshape(B, S, self.g, self.n), 4, D=self.D, dt_bias=self.dt_bias, dt_softplus=True,
            dt_limit=self.dt_limit)
        y = y.reshape(B, S, -1).to(h.dtype) * F.silu(gate)
        h = h + self.out_proj(y)
        if self.attention:
            q, k, v = self.qkv(h).view(B, S, 3, 2, -1).permute(2, 0, 3, 1, 4)
            keep = torch.ones(S, S, dtype=torch.bool).tril()[None, None] & attention_mask.bool()[:, None, None, :]
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
            h = h + att.transpose(1, 2).reshape(B, S, -1)
        return self.head(h)


def test_the_scan_is_one_opaque_op():
    gm = capture(TinyMamba2(), *_forest_batch(0))
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("dualkv.mamba2_chunk_scan.default") == 1
    assert not any("cumsum" in t for t in targets)  # none of the chunked scan's own ops


@pytest.mark.parametrize("model", [dict(), dict(attention=False), dict(dt_limit=(0.0, 0.5))],
                         ids=["with_attention", "state_space_only", "binding_dt_limit"])
@pytest.mark.parametrize("seed", range(2))
def test_packed_and_exact_on_shuffled_forests(model, seed, one_thread):
    reports = _run(TinyMamba2(**model), *_forest_batch(seed))
    assert sum(r.packed_calls for r in reports) == 1
    assert "recurrent layers on the forest: causal convolution x1, Mamba-2 scan x1" in str(reports[0])


def test_left_padding_that_reaches_the_scan_runs_unpacked(one_thread):
    ids, mask = _forest_batch(2)
    assert (mask[:, 0] == 0).any()  # some row has padding before its tokens
    reports = _run(TinyMamba2(mask=False), ids, mask)
    assert sum(r.packed_calls for r in reports) == 0
    assert any("padding before a row's tokens reaches" in why for r in reports for why in r.fallback_reasons)


def _neutrality(**switches):
    ids, mask = _forest_batch(2)
    inputs = []
    gm = fuse_causal_conv1d(capture(TinyMamba2(**switches), ids, mask, example_inputs=inputs))
    result = analyze(gm, inputs)
    assert result.refusal is None
    return [(kind, why) for _, kind, why in result.recurrent]


def test_padding_neutrality_of_the_scan():
    assert _neutrality() == [("causal convolution", None), ("Mamba-2 scan", None)]
    (_, conv_why), (scan, scan_why) = _neutrality(mask=False)
    assert "its input is not zero" in conv_why
    assert scan == "Mamba-2 scan" and "neither its x nor its B" in scan_why


@pytest.mark.parametrize("divide", ["number", "tensor"])
def test_a_zero_divided_is_zero_only_by_a_nonzero_number(divide):
    (_, conv_why), (_, scan_why) = _neutrality(divide=divide)
    assert conv_why is None
    assert (scan_why is None) == (divide == "number"), scan_why
