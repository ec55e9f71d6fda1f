"""Side graphs (analysis.side_graphs): pruned to what the returned values need, in-place ops included only where
they may write those values; a copy that cannot run on its own says why, and its padding-read factors are unknown."""

from __future__ import annotations

import copy

import pytest
import torch

import dualkv_compile
from dualkv_compile.analysis.side_graphs import graph_returning

from tests.helpers import assert_loss_and_grads_match, capture, hf_model

pytestmark = pytest.mark.usefixtures("one_thread")


# --- the pruning, on small Dynamo graphs (nodes are named after the variables) ---


def _cut(f, args, returned, drop_trailing=0, example_values=True):
    """``graph_returning`` of ``f``'s Dynamo graph; without ``example_values``, by the structural rules alone
    (nodes the rewrite makes have none)."""
    gm = capture(f, *[a.clone() for a in args])
    if not example_values:
        for n in gm.graph.nodes:
            n.meta.pop("example_value", None)
    nodes = {n.name: n for n in gm.graph.nodes}
    return graph_returning(gm, [nodes[r] for r in returned], "Cut", drop_trailing=drop_trailing)


def _targets(gm):
    return {n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "") for n in gm.graph.nodes}


def _masked(x, y):
    m = x.clone()
    v = m[:, :2]  # a view: writing it writes m
    v.zero_()
    out = y.new_zeros(3)
    out[0] = y.sum()  # writes a tensor the mask never shares: left out, with what it reads
    return m.sum(), out


@pytest.mark.parametrize("example_values", [True, False])
def test_write_through_a_view_of_a_needed_value_is_kept_the_others_left_out(example_values):
    x, y = torch.ones(2, 3), torch.ones(3)
    gm = _cut(_masked, (x, y), ["m"], example_values=example_values)
    assert gm.unusable is None
    assert "zero_" in _targets(gm) and "setitem" not in _targets(gm) and "sum" not in _targets(gm), gm.code
    (m,) = gm(x, y)
    torch.testing.assert_close(m, torch.tensor([[0.0, 0, 1], [0, 0, 1]]))
    assert x.eq(1).all()  # the caller's tensors are untouched


def _unknown_alias(x):
    c = x.clone()
    e = torch.einsum("ij->ji", c)  # an op not known to allocate: it may return a view of c (it does)
    e.mul_(0)
    return c + 1


@pytest.mark.parametrize("example_values", [True, False])
def test_an_op_not_known_to_allocate_counts_as_a_view(example_values):
    gm = _cut(_unknown_alias, (torch.ones(2, 2),), ["add"], example_values=example_values)
    assert gm.unusable is None and "mul_" in _targets(gm), gm.code
    assert gm(torch.ones(2, 2))[0].eq(1).all()


def _writes_input(x):
    x[0] = 0
    return x * 2


def _random_mask(x):
    keep = torch.rand(x.shape) > 0.5
    return x * keep, x + 1


def _written_after_read(x):
    m = x.clone()
    v = m[1:]
    s = v * 2  # the program reads v here; a copy returning v would return it after the write below
    m.zero_()
    return s, v


def _layout_write(x, layout):
    m = x.clone()
    m[0] = layout.sum()
    return m


@pytest.mark.parametrize(
    "f, nargs, returned, drop, why",
    [
        (_writes_input, 1, ["mul"], 0, "may write a graph input"),
        (_random_mask, 1, ["mul"], 0, "draws random numbers"),
        (_written_after_read, 1, ["v"], 0, "v may be written in place (zero_, zero_) after it is read"),
        (_layout_write, 2, ["m"], 1, "an in-place op that may write them, setitem (setitem), would read the packed program's l_layout_"),
    ],
)
def test_a_copy_that_cannot_run_on_its_own_says_why(f, nargs, returned, drop, why):
    gm = _cut(f, [torch.ones(3, 2)] * nargs, returned, drop)
    assert gm.unusable is not None and why in gm.unusable, gm.unusable


def test_inputs_written_are_copied_where_asked():
    """The attention masks' copy (mask_graph) runs once, on the caller's tensors: it writes copies of them."""
    x = torch.ones(3, 2)
    gm = capture(_writes_input, x.clone())
    nodes = {n.name: n for n in gm.graph.nodes}
    cut = graph_returning(gm, [nodes["mul"]], "Cut", copy_written_inputs=True)
    assert cut.unusable is None, cut.unusable
    torch.testing.assert_close(cut(x)[0], torch.tensor([[0.0, 0], [2, 2], [2, 2]]))
    assert x.eq(1).all()


def test_random_numbers_not_needed_are_left_out():
    gm = _cut(_random_mask, (torch.ones(3),), ["add"])
    assert gm.unusable is None and "rand" not in _targets(gm), gm.code


# --- end to end: padding-read factors evaluated per call ---


def _run(loss, model, *args):
    torch._dynamo.reset()
    ref_model = copy.deepcopy(model)
    got = dualkv_compile.policy_loss(loss, inner="aot_eager", min_rho=1.0)(model, *args)
    assert_loss_and_grads_match(got, loss(ref_model, *args), model, ref_model)
    return [r for r in dualkv_compile.reports() if r.num_attention][-1]


def _pad_input(x):
    """flash-attn's / veRL's pad_input: an in-place write of model values into a fresh buffer."""
    out = x.new_zeros(x.shape)
    out[:, :] = x
    return out


def _sequences_in_one_row():
    torch.manual_seed(0)
    prompt = torch.randint(2, 101, (6,))
    seqs = [torch.cat([prompt, torch.randint(2, 101, (n,))]) for n in (3, 4, 2)]
    return {
        "input_ids": torch.cat(seqs)[None],
        "position_ids": torch.cat([torch.arange(len(s)) for s in seqs])[None],
        "loss_mask": torch.cat([torch.cat([torch.zeros(6), torch.ones(len(s) - 6)]) for s in seqs])[None],
    }


def test_write_elsewhere_in_the_graph_packs_and_is_exact():
    """The factor graph of ``lp * loss_mask`` used to keep the pad_input write, the model and the layout inputs."""

    def loss(model, batch):
        ids = batch["input_ids"]
        logits = model(input_ids=ids, position_ids=batch["position_ids"]).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        lp = lp * batch["loss_mask"][:, 1:]
        return _pad_input(torch.nn.functional.pad(lp, (0, 1))).sum()

    report = _run(loss, hf_model("qwen3", "sdpa", layers=1), _sequences_in_one_row())
    assert report.rewritten and report.packed_calls == 1, str(report)


_IDS = torch.tensor([[0, 0, 4, 5, 8, 9, 1], [0, 0, 4, 5, 8, 7, 0], [0, 0, 4, 5, 8, 3, 3]])  # prompt [4, 5, 8], left-padded


def _loss_with_head_written(head):
    """A next-token loss whose mask is changed in place at the first 3 columns (the padding and the first prompt
    token, whose log-probs packing does not compute): ``head`` "zeroes" them or "raises" them to 1."""

    def loss(model, ids, mask, loss_mask):
        logits = model(input_ids=ids, attention_mask=mask).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        if head == "zeroes":
            w = torch.ones(ids.shape[1])
            w[:3] = 0
            m = loss_mask * w
        else:
            w = torch.zeros(ids.shape[1])
            w[:3] = 1
            m = loss_mask + w
        return -_pad_input(logp * m[:, 1:]).sum() / loss_mask.sum()

    return loss


@pytest.mark.parametrize("head", ["zeroes", "raises"])
def test_mask_written_in_place_is_evaluated_with_the_write(head):
    """Without the write, the factor is wrong: "zeroes" would not pack (the mask is 1 at the first valid token),
    "raises" would pack where the program reads padding log-probs (its response mask is 0 there), and be wrong."""
    mask = (_IDS != 0).long()
    loss_mask = mask.float() if head == "zeroes" else torch.where(torch.arange(7) < 5, 0.0, mask.float())
    report = _run(_loss_with_head_written(head), hf_model("qwen3", "sdpa"), _IDS, mask, loss_mask)
    assert report.rewritten, str(report)
    if head == "zeroes":
        assert report.packed_calls == 1, str(report)
    else:
        assert report.packed_calls == 0 and "packing does not compute" in report.fallback_reasons[-1], str(report)


def test_mask_written_from_model_values_is_unknown_and_runs_unpacked():
    """The write that makes the mask reads the model: its factor graph would need the packed program, so the mask
    is unknown and a call that needs it runs unpacked (it used to raise a TypeError for the missing layout inputs)."""

    def loss(model, ids, mask, loss_mask):
        logits = model(input_ids=ids, attention_mask=mask).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        w = torch.ones(ids.shape[1])
        w[:3] = logp[:, 3:4].detach().sum() * 0  # reads a column packing computes: itself no padding read
        return -(logp * (loss_mask * w)[:, 1:]).sum() / loss_mask.sum()

    mask = (_IDS != 0).long()
    report = _run(loss, hf_model("qwen3", "sdpa"), _IDS, mask, mask.float())
    assert report.rewritten and report.packed_calls == 0, str(report)
    why = report.fallback_reasons[-1]
    assert "its mask could not be evaluated before the call" in why and "packed program" in why, why
