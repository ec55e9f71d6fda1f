"""``find_token_inputs``: which placeholders are the token inputs, by name."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import dualkv_compile
from dualkv_compile.analysis.token_inputs import Role, find_token_inputs
from dualkv_compile.backend import dualkv_backend
from tests.helpers import capture, hf_model, rel


def _graph_reading(names_in_order):
    """A graph whose placeholders are the batch keys ``names_in_order``, read in that order."""

    def f(batch):
        return sum(batch[k].sum() for k in names_in_order)

    batch = {k: torch.ones(2, 3, dtype=torch.long) for k in names_in_order}
    return capture(f, batch).graph


@pytest.mark.parametrize(
    "names, expected",
    [
        (["input_ids_rmpad_rolled", "input_ids"], "input_ids"),  # veRL's rolled labels, read first
        (["input_ids", "input_ids_rmpad_rolled"], "input_ids"),
        (["input_ids_rmpad_rolled", "input_ids_rmpad"], "input_ids_rmpad"),  # no exact name: the shortest
        (["old_attention_mask", "attention_mask"], "attention_mask"),
    ],
)
def test_the_name_that_ends_with_the_role_wins_whatever_the_order(names, expected):
    found = find_token_inputs(_graph_reading(names))
    role = Role.ATTENTION_MASK if "mask" in expected else Role.INPUT_IDS
    assert found.get(role).name.lower().rstrip("_").endswith("batch_" + expected)


def test_labels_named_like_input_ids_read_first_do_not_stop_packing():
    """veRL's remove-padding actor reads ``input_ids_rmpad_rolled`` (the labels); taking it for the
    token ids refused the graph ("combines a constant of length 27 with the s axis")."""
    model = hf_model("qwen3", "sdpa")
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, 101, (6,), generator=g)
    seqs = [torch.cat([prompt, torch.randint(2, 101, (n,), generator=g)]) for n in (3, 4, 2)]
    ids = torch.cat(seqs)[None]
    batch = {
        "input_ids": ids,
        "position_ids": torch.cat([torch.arange(len(s)) for s in seqs])[None],
        "input_ids_rmpad_rolled": torch.roll(ids, -1, 1),
    }

    def loss(m, batch):
        labels = batch["input_ids_rmpad_rolled"].squeeze(0)
        logits = m(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits.squeeze(0)
        return torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    out, expected = compiled(model, batch), loss(ref, batch)
    assert rel(out, expected) <= 1e-6
    report = dualkv_compile.reports()[-1]
    assert report.rewritten and report.packed_calls == 1, (report.reason, report.fallback_reasons)


def test_multimodal_positions_are_carried_and_checked():
    """A vision-language model's language model after the image merge: hidden states ``[B, S, H]`` and multimodal
    rotary positions ``[3, B, S]`` from the graph before. The positions are a carried token input (b, s at axes 1
    and 2), so two rows whose embeddings are equal share a column only where their positions are equal too: rows 0
    and 1 share columns 0-4 and part at 5 (row 1's height positions differ from there), rows 2 and 3 share all 12.
    Exact against the eager model; 5 + 7 + 7 + 12 = 31 packed tokens."""
    from tests.vlm_batch import tiny_vlm

    lm = tiny_vlm("qwen2_5_vl").model.language_model
    ref = copy.deepcopy(lm)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(12, 64, generator=g), torch.randn(12, 64, generator=g)
    emb = torch.stack([a, a, b, b]).requires_grad_()
    pos = torch.arange(12).expand(3, 4, 12).clone()
    pos[1, 1, 5:] += 1
    mask = torch.ones(4, 12, dtype=torch.long)

    def hidden(m, e):
        return m(inputs_embeds=e, position_ids=pos, attention_mask=mask).last_hidden_state

    torch._dynamo.reset()
    compiled = torch.compile(functools.partial(hidden, lm), backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    out, expected = compiled(emb), hidden(ref, emb)
    assert (out - expected).abs().max().item() <= 1e-5
    report = next(r for r in reversed(dualkv_compile.reports()) if r.num_attention)
    assert report.rewritten and report.packed_calls == 1, (report.reason, report.fallback_reasons)
    assert report.last_stats.tokens_after == 31, report.last_stats
