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
