"""Sums over every token axis, weighted by multiplicity on the packed stream (docs/design.md, semantics 12).

``token_weights`` is checked against the layout's own multiplicities and as the adjoint of ``unpack``
(the sum of an unpacked value equals the weighted sum of the packed one), ``weighted_histc`` against
``torch.histc`` of the entries repeated; then losses that reduce model values over tokens (a z-loss
over valid tokens, a plain mean) through the backend, against the unmodified function, and the
packed graph itself (graph diff on the tiny decoder).
"""

from __future__ import annotations

import functools

import expecttest
import pytest
import torch

import dualkv_compile
from dualkv_compile.analysis.token_axes import analyze_token_axes
from dualkv_compile.analysis.token_inputs import find_token_inputs
from dualkv_compile.backend import dualkv_backend
from dualkv_compile.rewrite.pack_graph import pack_graph
from dualkv_compile.rewrite.packed_inputs import PackedInputs
from dualkv_compile.layout.packed_ops import token_weights, unpack_tokens, weighted_histc

from tests.helpers import capture, grpo_batch, hf_model, normalise, rel
from tests.tiny_decoder import TinyDecoder

VOCAB = 101


def _padded():
    ids, mask, _ = grpo_batch([(6, [3, 4, 1]), (4, [2, 5])], VOCAB, share_response_tokens=1)
    return ids, dualkv_compile.detect(ids, mask)


def _one_row():
    """veRL's remove-padding layout: sequences packed into one row, positions restarting."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, VOCAB, (5,), generator=g)
    rows = [torch.cat([prompt, torch.randint(1, VOCAB, (r,), generator=g)]) for r in (3, 1, 4)]
    ids = torch.cat(rows)[None]
    pos = torch.cat([torch.arange(len(r)) for r in rows])[None]
    return ids, dualkv_compile.detect(ids, position_ids=pos)


@pytest.mark.parametrize("make", [_padded, _one_row], ids=["padded", "one_row"])
@pytest.mark.parametrize("shift, truncate", [(0, False), (1, False), (0, True)], ids=["tokens", "next_token", "truncated"])
def test_token_weights_are_the_adjoint_of_unpack(make, shift, truncate):
    ids, layout = make()
    p = PackedInputs.of(layout)
    T = layout.num_tokens
    w = token_weights(T, p.unpack_index, p.valid, ids, shift, truncate)
    x = torch.randn(1, T, 3, dtype=torch.float64)
    unpacked = unpack_tokens(x, p.unpack_index, p.valid, ids, 0, 1, shift, truncate)
    assert rel((x[0] * w[:, None]).sum(0), unpacked.sum((0, 1))) <= 1e-12
    if shift == 0 and not truncate:
        # The layout's count of sequences per packed token: every position of a sequence is one of them.
        assert torch.equal(w, layout.token_multiplicity())


def test_weighted_histc_counts_repeated_entries():
    g = torch.Generator().manual_seed(0)
    for E in (1, 3, 8, 64, 257):
        x = torch.randint(0, E, (40,), generator=g).float()
        w = torch.randint(0, 5, (40,), generator=g)
        want = torch.histc(x.repeat_interleave(w), bins=E, min=0, max=E)
        assert torch.equal(weighted_histc(x, w, E, 0, E), want)
    x = torch.randn(200, generator=g) * 3  # beyond the range, at its ends, NaN
    x[:3] = torch.tensor([-2.5, 4.0, float("nan")])
    w = torch.randint(0, 4, (200,), generator=g)
    want = torch.histc(x.repeat_interleave(w), bins=7, min=-2.5, max=4.0)
    assert torch.equal(weighted_histc(x, w, 7, -2.5, 4.0), want)


def _z_loss(model, ids, mask):
    """A router-style z-loss over the valid tokens: a sum of model values over both token axes."""
    z = torch.logsumexp(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
    return (z.square() * mask).sum() / mask.sum()


def _mean_loss(model, ids, mask):
    """A plain mean over every position, padding included (no mask factor)."""
    return torch.logsumexp(model(input_ids=ids, attention_mask=mask).logits, dim=-1).mean()


def _compiled(fn, inner):
    torch._dynamo.reset()
    return torch.compile(fn, backend=functools.partial(dualkv_backend, options={"inner": inner}))


def _check(fn, ids, mask, packed_calls, device="cpu"):
    torch.manual_seed(0)
    model, ref = hf_model("llama", "sdpa").to(device), hf_model("llama", "sdpa").to(device)
    ref.load_state_dict(model.state_dict())
    ids, mask = ids.to(device), mask.to(device)
    before = len(dualkv_compile.reports())
    inner = "inductor" if device == "cuda" else "aot_eager"  # on a GPU: token_weights and the sums through Inductor
    got, want = _compiled(fn, inner)(model, ids, mask), fn(ref, ids, mask)
    assert rel(got.detach(), want.detach()) <= 1e-5
    got.backward()
    want.backward()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert rel(a.grad, b.grad) <= 1e-5, name
    (report,) = dualkv_compile.reports()[before:]
    assert report.packed_calls == packed_calls, (report.reason, report.fallback_reasons)
    return report


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))]
)
def test_masked_token_sum_of_model_values_packs_exactly(device):
    """The z-loss's numerator is weighted on the packed stream and the mask (an input, multiplied in on the
    packed stream) is credited as zeroing padding, so the left- and right-padded batch packs. Before, the
    sum read the unpacked ``[B, S]`` values and the mask's packed copy was not seen as a factor: unpacked."""
    ids, mask, _ = grpo_batch([(6, [3, 4, 1]), (4, [2, 5])], VOCAB)
    _check(_z_loss, ids, mask, packed_calls=1, device=device)


def test_mean_over_padding_runs_unpacked_and_exact():
    """A mean over every position reads padding's values, which packing does not compute: refused per call."""
    ids, mask, _ = grpo_batch([(6, [3, 4, 1])], VOCAB)
    report = _check(_mean_loss, ids, mask, packed_calls=0)
    assert "reads a position packing does not compute" in report.fallback_reasons[-1]


def test_mean_without_padding_packs_with_the_original_count():
    """No padding (rows of one length): the mean is the weighted sum over the packed tokens divided by B * S."""
    ids, mask, _ = grpo_batch([(6, [4, 4, 4])], VOCAB, left_pad=0, right_pad=0)
    assert bool(mask.all())
    _check(_mean_loss, ids, mask, packed_calls=1)


def _next_token_nll(model, ids, mask):
    """A token-mean negative log-likelihood of the next tokens, masked by ``attention_mask[:, 1:]``: a sum of
    next-token (shift 1) values over both token axes."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = mask[:, 1:].float()
    return -(logp * m).sum() / m.sum()


@pytest.mark.parametrize("left_pad, packed_calls", [(0, 1), (2, 0)], ids=["right_padded", "left_padded"])
def test_next_token_sum_weights_targets(left_pad, packed_calls):
    """Each packed token weighs as many next-token positions as read it. Right-padded rows pack; with left
    padding the mask is 1 at a row's first token, whose log-prob reads the padding column before it, which
    packing does not compute: that call runs unpacked (exact either way)."""
    ids, mask, _ = grpo_batch([(6, [3, 4, 1]), (6, [2, 5])], VOCAB, left_pad=left_pad)  # prompts of one length
    report = _check(_next_token_nll, ids, mask, packed_calls=packed_calls)
    if not packed_calls:
        assert "reads a position packing does not compute" in report.fallback_reasons[-1]


class ZLossDecoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = TinyDecoder()

    def forward(self, input_ids, position_ids, attention_mask):
        z = torch.logsumexp(self.decoder(input_ids, position_ids), dim=-1)
        return (z.square() * attention_mask).sum() / attention_mask.sum()


class TestGraphDiff(expecttest.TestCase):
    def test_token_sum_is_weighted_on_the_packed_stream(self):
        """The sum over both token axes is the packed values times ``token_weights``, summed: no ``unpack``.
        The mask's own sum (inputs alone) stays in the original layout."""
        torch.manual_seed(0)
        ids = torch.randint(1, 61, (3, 7))
        pos = torch.arange(7).expand(3, 7)
        gm = capture(ZLossDecoder(), ids, pos, torch.ones(3, 7))
        packed = pack_graph(gm, analyze_token_axes(gm, find_token_inputs(gm.graph)), "reference")
        code = normalise(packed.code)
        tail = code[code.index("    z_packed"):]
        self.assertExpectedInline(tail, """\
    z_packed = torch.logsumexp(linear_2_packed, dim = -1)
    square_packed = z_packed.square()
    mul_packed = square_packed * pack_tokens_2
    token_weights = dualkv_compile_layout_packed_ops_token_weights(size, unpack_index, valid, l_input_ids_, 0, False)
    view = token_weights.view((1, -1))
    to = view.to(torch.float32)
    mul = mul_packed * to
    sum_1 = mul.sum()
    sum_2 = l_attention_mask_.sum()
    truediv = sum_1 / sum_2
    return (truediv,)""")
