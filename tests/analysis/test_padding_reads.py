"""Reading a position packing does not compute (docs/design.md, semantics 8): exact, unpacked where no mask zeroes it."""

from __future__ import annotations

import copy

import pytest
import torch

import dualkv_compile

from tests.helpers import cuda_syncs, hf_model
from tests.helpers import assert_loss_and_grads_match

pytestmark = pytest.mark.usefixtures("one_thread")


def _next_token_loss(model, ids, mask, loss_mask):
    logits = model(input_ids=ids, attention_mask=mask).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    w = loss_mask[:, 1:].float()
    return -(logp * w).sum() / w.sum()


def _empty_prompt_batch():
    """Rows [pad | response]: the first response token's log-prob comes from the padding column's logits."""
    ids = torch.tensor([[0, 5, 8, 9, 1], [0, 5, 8, 7, 2], [0, 5, 8, 3, 3]])
    return ids, (ids != 0).long()


def _run(loss, model, *args):
    torch._dynamo.reset()
    ref_model = copy.deepcopy(model)
    got = dualkv_compile.policy_loss(loss, inner="aot_eager", min_rho=1.0)(model, *args)
    assert_loss_and_grads_match(got, loss(ref_model, *args), model, ref_model)
    return [r for r in dualkv_compile.reports() if r.num_attention]


def test_empty_prompt_runs_unpacked_and_exact():
    ids, mask = _empty_prompt_batch()
    reports = _run(lambda m, i, a: _next_token_loss(m, i, a, a), hf_model("qwen3", "sdpa"), ids, mask)
    assert reports[-1].packed_calls == 0
    assert "reads a position packing does not compute" in reports[-1].fallback_reasons[-1]


def test_left_padded_prompt_with_response_mask_packs():
    """The same read, multiplied by a mask that is zero there (a prompt token is never in the loss): packed, exact."""
    ids = torch.tensor([[0, 0, 4, 5, 8, 9, 1], [0, 0, 4, 5, 8, 7, 0], [0, 0, 4, 5, 8, 3, 3]])
    mask = (ids != 0).long()
    response = mask.clone()
    response[:, :5] = 0  # prompt [4, 5, 8]
    reports = _run(lambda m, i, a, r: _next_token_loss(m, i, a, r), hf_model("qwen3", "sdpa"), ids, mask, response)
    assert reports[-1].packed_calls == 1, reports[-1]


def _verl_loss(model, ids, mask, responses, response_mask):
    """veRL's form: the response columns sliced out of the logits, gathered with the responses."""
    R = responses.shape[1]
    logits = model(input_ids=ids, attention_mask=mask).logits
    logp = torch.log_softmax(logits[:, -R - 1 : -1].float(), -1).gather(-1, responses[..., None]).squeeze(-1)
    return -(logp * response_mask).sum() / response_mask.sum()


@pytest.mark.parametrize("prompt_len", [0, 2])
def test_verl_slice_reads_padding_only_for_an_empty_prompt(prompt_len):
    P, R = 3, 4
    prompt = torch.tensor([7, 11, 13])[:prompt_len]
    responses = torch.tensor([[5, 8, 9, 0], [5, 8, 7, 2], [5, 8, 3, 3]])
    response_mask = (responses != 0).long()
    ids = torch.zeros(3, P + R, dtype=torch.long)
    ids[:, P - prompt_len : P] = prompt  # left-padded prompt
    ids[:, P:] = responses
    mask = (ids != 0).long()
    reports = _run(_verl_loss, hf_model("llama", "sdpa"), ids, mask, responses, response_mask.float())
    if prompt_len == 0:
        assert reports[-1].packed_calls == 0 and "packing does not compute" in reports[-1].fallback_reasons[-1]
    else:
        assert reports[-1].packed_calls == 1, reports[-1]


def test_nan_padding_embedding_poisons_the_original_program_only():
    """docs/supported.md: a NaN in the padding token's embedding row makes the unmodified model's loss
    NaN (its padding positions reach valid ones through a zero weight times NaN), while dualkv, which never reads
    padding, gives the loss of the model with a finite padding row."""
    ids = torch.tensor([[0, 0, 4, 5, 8, 9, 1], [0, 0, 4, 5, 8, 7, 0], [0, 0, 4, 5, 8, 3, 3]])
    mask = (ids != 0).long()
    response = mask.clone()
    response[:, :5] = 0
    model = hf_model("qwen3", "sdpa")
    clean = copy.deepcopy(model)
    with torch.no_grad():
        model.model.embed_tokens.weight[0] = float("nan")

    def loss(model, input_ids, attention_mask, response_mask):
        return _next_token_loss(model, input_ids, attention_mask, response_mask)

    torch._dynamo.reset()
    assert torch.isnan(loss(model, ids, mask, response))
    got = dualkv_compile.policy_loss(loss, inner="aot_eager")(model, ids, mask, response)
    assert [r.packed_calls for r in dualkv_compile.reports() if r.num_attention][-1] == 1
    torch.testing.assert_close(got, loss(clean, ids, mask, response), rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_call_with_a_masked_padding_read_syncs_once():
    """The padding reads' masks ride in the layout's one host transfer: a packed call of a loss that reads a
    next-token value under a response mask synchronises with the device once (it was twice: the layout's read,
    then the padding-read check's)."""
    dev = torch.device("cuda")
    ids = torch.tensor([[0, 0, 4, 5, 8, 9, 1], [0, 0, 4, 5, 8, 7, 0], [0, 0, 4, 5, 8, 3, 3]], device=dev)
    mask = (ids != 0).long()
    response = mask.clone()
    response[:, :5] = 0
    torch._dynamo.reset()
    model = hf_model("qwen3", "sdpa").to(dev)
    loss = dualkv_compile.policy_loss(lambda m, i, a, r: _next_token_loss(m, i, a, r), inner="aot_eager", min_rho=1.0)
    for _ in range(2):  # compile, then a warm call
        loss(model, ids, mask, response).backward()
    out, syncs = cuda_syncs(lambda: loss(model, ids, mask, response))
    reports = [r for r in dualkv_compile.reports() if r.num_attention]
    assert reports[-1].packed_calls == 3, reports[-1]
    assert len(syncs) == 1, syncs
    assert torch.isfinite(out)
