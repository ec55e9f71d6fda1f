"""Labels computed outside the graph (veRL's ``input_ids_rmpad_rolled``): log-probs picked from the packed rows.

veRL's FSDP engine runs the model on one remove-padding row of all sequences, squeezes the batch axis
(``logits.squeeze(0)``) and gathers the log-probs at labels it rolled outside the model
(``torch.roll(input_ids, -1)``). The labels are in the original layout and differ between the copies
of a shared token (the last prompt token of a group is followed by each response's first token), so
the log-probs cannot be packed; the graph must still not unpack the ``[T, V]`` logits to pick them.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch.fx.passes.shape_prop import ShapeProp

import dualkv_compile
from dualkv_compile.backend import dualkv_backend
from dualkv_compile.layout.packed_ops import gather_unpacked, unpack_merged, unpack_tokens

from tests.helpers import VOCAB, grpo_batch, hf_model, packed_loss_graph, rel


def remove_padding_row(groups, seed=0):
    """One row of every sequence back to back (position ids restart at each), and the labels rolled by one."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for P, responses in groups:
        prompt = torch.randint(0, VOCAB, (P,), generator=g)
        seqs += [torch.cat([prompt, torch.randint(0, VOCAB, (R,), generator=g)]) for R in responses]
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    return ids, pos, torch.roll(ids, -1, 1).squeeze(0)


def entropy_from_logits(logits):
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def verl_log_probs(model, input_ids, position_ids, rolled):
    """The remove-padding computation of veRL 0.9's ``FSDPEngineWithLMHead`` (temperature 0.7), written out."""
    logits = model(input_ids=input_ids, attention_mask=None, position_ids=position_ids, use_cache=False).logits
    logits = logits.squeeze(0) / 0.7
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, rolled.unsqueeze(-1)).squeeze(-1)
    return logp, entropy_from_logits(logits)


GROUPS = [(6, [3, 4, 2]), (4, [2, 5])]


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))


def test_remove_padding_row_with_rolled_labels_is_packed_and_exact_everywhere():
    model = hf_model("qwen3", "sdpa")
    ref = copy.deepcopy(model)
    ids, pos, rolled = remove_padding_row(GROUPS)
    logp, entropy = _compiled(functools.partial(verl_log_probs, model))(input_ids=ids, position_ids=pos, rolled=rolled)
    ref_logp, ref_entropy = verl_log_probs(ref, ids, pos, rolled)
    # Every position, the sequences' last ones too (their label is the next sequence's first token).
    assert rel(logp, ref_logp) <= 1e-6 and rel(entropy, ref_entropy) <= 1e-6
    (logp.sum() + 0.1 * entropy.sum()).backward()
    (ref_logp.sum() + 0.1 * ref_entropy.sum()).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel(p.grad, q.grad) <= 1e-5, name
    report = dualkv_compile.reports()[-1]
    assert report.rewritten and report.packed_calls == 1, (report.reason, report.fallback_reasons)
    assert report.last_stats.tokens_after < report.last_stats.tokens_before


def test_rolled_labels_pick_from_packed_rows_without_unpacking_the_logits():
    model = hf_model("qwen3", "sdpa", layers=1)
    ids, pos, rolled = remove_padding_row(GROUPS)

    def loss(m, batch):
        logp, entropy = verl_log_probs(m, batch["input_ids"], batch["position_ids"], batch["rolled"])
        return logp.sum() + entropy.sum()

    batch = {"input_ids": ids, "position_ids": pos, "rolled": rolled}
    packed, layout = packed_loss_graph(loss, model, batch, chunked_log_probs=False)
    picks = [n for n in packed.graph.nodes if n.target is gather_unpacked]
    assert len(picks) == 1
    # The squeezed [T, V] logits stay packed: what leaves the packed stream is per token, never V wide.
    for n in packed.graph.nodes:
        if n.target in (unpack_tokens, unpack_merged):
            assert n.meta["tensor_meta"].shape[-1] != VOCAB, n.format_node()
    assert tuple(picks[0].meta["tensor_meta"].shape) == (ids.shape[1], 1)
    assert layout.num_tokens < ids.shape[1]


def test_gather_unpacked_equals_unpack_then_gather():
    """The op against its definition, values and gradients, at padding positions too (zeros)."""
    g = torch.Generator().manual_seed(3)
    T, V, B, S, K = 5, 7, 2, 4, 2
    x = torch.randn(1, T, V, generator=g, requires_grad=True)
    unpack_index = torch.tensor([0, 1, 2, 0, 0, 3, 4, 0])
    valid = torch.tensor([True, True, True, False, True, True, True, True])
    index = torch.randint(0, V, (B, S, K), generator=g)
    got = gather_unpacked(x, unpack_index, valid, index)
    unpacked = unpack_tokens(x, unpack_index, valid, torch.zeros(B, S), 0, 1)
    want = unpacked.gather(-1, index)
    assert torch.equal(got, want)
    w = torch.randn(B, S, K, generator=g)
    (gx,) = torch.autograd.grad((got * w).sum(), x)
    (wx,) = torch.autograd.grad((want * w).sum(), x)
    assert torch.allclose(gx, wx)
    # The merged form: [T, V] and a [B * S, K] index.
    merged = gather_unpacked(x[0], unpack_index, valid, index.reshape(B * S, K))
    assert torch.equal(merged, want.reshape(B * S, K))


def test_padded_batch_with_labels_from_outside_reading_padding_falls_back():
    """A [B, S] batch whose labels come in as an input: the masked loss packs; a loss that reads the log-probs
    at padding positions unmasked (the original has values there, packing zeros) must not."""
    model = hf_model("qwen3", "sdpa", layers=1)
    ids, mask, _ = grpo_batch([(5, [3, 4, 2])], VOCAB, seed=2)
    labels = torch.roll(ids, -1, 1)
    loss_mask = torch.roll(mask, -1, 1) * mask

    def logp_of(m, input_ids, attention_mask, labels):
        logits = m(input_ids=input_ids, attention_mask=attention_mask).logits
        return torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)

    def masked(m, input_ids, attention_mask, labels, loss_mask):
        return (logp_of(m, input_ids, attention_mask, labels) * loss_mask).sum()

    def unmasked(m, input_ids, attention_mask, labels, loss_mask):
        return logp_of(m, input_ids, attention_mask, labels).exp().sum()

    for fn, packs in ((masked, True), (unmasked, False)):
        out = _compiled(functools.partial(fn, model))(input_ids=ids, attention_mask=mask, labels=labels, loss_mask=loss_mask)
        assert rel(out, fn(model, ids, mask, labels, loss_mask)) <= 1e-5, fn.__name__
        report = dualkv_compile.reports()[-1]
        assert report.rewritten, report.reason
        assert (report.packed_calls == 1) is packs, (fn.__name__, report.fallback_reasons)


def verl_log_probs_only(model, input_ids, position_ids, rolled):
    """veRL's computation with the entropy off (its ``calculate_entropy=False``): the log-probs alone read the logits."""
    logits = model(input_ids=input_ids, attention_mask=None, position_ids=position_ids, use_cache=False).logits
    logits = logits.squeeze(0) / 0.7
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, rolled.unsqueeze(-1)).squeeze(-1)


def test_rolled_labels_fuse_with_the_lm_head_exact():
    """The picked log-probs come straight from the lm_head in chunks (``dualkv::linear_log_prob`` reading each
    position's packed row): no [T, V] tensor, the shared last prompt token's row serving every response."""
    model = hf_model("qwen3", "sdpa")
    ref = copy.deepcopy(model)
    ids, pos, rolled = remove_padding_row(GROUPS, seed=4)
    logp = _compiled(functools.partial(verl_log_probs_only, model))(input_ids=ids, position_ids=pos, rolled=rolled)
    want = verl_log_probs_only(ref, ids, pos, rolled)
    assert rel(logp, want) <= 1e-6
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(0))
    (logp * weights).sum().backward()
    (want * weights).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel(p.grad, q.grad) <= 1e-5, name
    report = dualkv_compile.reports()[-1]
    assert report.packed_calls == 1 and report.fused_log_probs == 1, str(report)

    def loss(m, batch):
        return verl_log_probs_only(m, batch["input_ids"], batch["position_ids"], batch["rolled"]).sum()

    packed, _ = packed_loss_graph(loss, hf_model("qwen3", "sdpa", layers=1), {"input_ids": ids, "position_ids": pos, "rolled": rolled})
    wide = [n.name for n in packed.graph.nodes
            if n.op != "placeholder" and getattr(n.meta.get("tensor_meta"), "shape", (0,))[-1:] == (VOCAB,)]
    assert wide == [], wide
