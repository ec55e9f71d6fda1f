"""``dualkv_compile.shared_batch``: the caller's layout carried by every graph of a model FSDP2 splits per layer.

One gloo rank (``tests.gloo_ranks``), FSDP2 on each decoder layer and the root, veRL's remove-padding row
(labels rolled outside the graph). Without ``shared_batch`` no graph of the model sees the token ids by
name, and the row's sequences are not found from the layers' hidden states: nothing packs. Inside it every
graph with attention, and the lm_head's, packs on the caller's layout, exactly.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
import torch.distributed as dist

import dualkv_compile

from tests.gloo_ranks import spawn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available")


def _fsdp_rank(rank):
    from tests.helpers import assert_sharded_grads_close, shard_per_layer
    from tests.rewrite.test_gather_unpacked import remove_padding_row, verl_log_probs_only
    from tests.test_sequence_parallel import tiny_model

    model = tiny_model("qwen3")
    ref = copy.deepcopy(model)
    shard_per_layer(model)
    ids, pos, rolled = remove_padding_row([(9, [3, 5, 2]), (6, [4, 1])], seed=3)
    want = verl_log_probs_only(ref, ids, pos, rolled)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(0))
    (want * weights).sum().backward()

    def run(shared: bool):
        torch._dynamo.reset()  # each run compiles its graphs afresh (a graph refused at compile time stays refused)
        step = torch.compile(functools.partial(verl_log_probs_only, model), backend="dualkv", options={"inner": "aot_eager"})
        model.zero_grad(set_to_none=True)
        if shared:
            with dualkv_compile.shared_batch(ids, None, pos) as layout:
                assert layout.num_tokens < ids.shape[1]
                logp = step(input_ids=ids, position_ids=pos, rolled=rolled)
        else:
            logp = step(input_ids=ids, position_ids=pos, rolled=rolled)
        torch.testing.assert_close(logp, want, rtol=1e-5, atol=1e-5)
        (logp * weights).sum().backward()
        assert_sharded_grads_close(model, ref)
        reports = dualkv_compile.reports()
        return [(r.graph_id, r.packed_calls, r.num_attention, r.fused_log_probs, r.layout_source) for r in reports if r.rewritten], None

    rewritten, _ = run(shared=False)
    assert not any(packed for _, packed, _, _, _ in rewritten), rewritten  # nothing found the layout
    before = len(rewritten)
    rewritten, _ = run(shared=True)
    mine = rewritten[before:]
    # Every graph of the split model dualkv rewrote ran packed on the caller's layout: the decoder layers' and
    # those after them (the final norm, the lm_head, the log-probs after FSDP's root hook).
    assert any(attn for _, _, attn, _, _ in mine) and len(mine) >= 3, mine
    assert all(calls and source == "carried from dualkv_compile.shared_batch" for _, calls, _, _, source in mine), mine


def test_shared_batch_packs_every_piece_of_an_fsdp2_split_model():
    spawn(_fsdp_rank, world=1)


def test_shared_batch_names_a_bad_argument():
    with pytest.raises(ValueError, match="input_ids must be a"):
        with dualkv_compile.shared_batch(torch.zeros(5, dtype=torch.long)):
            pass


def _log_probs_after_a_break(model, input_ids, attention_mask):
    """The lm_head and log-probs in a graph of their own after the backbone's (as after FSDP2's root hook):
    that graph has the token ids (by their name), but neither a mask nor attention."""
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    torch._dynamo.graph_break()
    logp = torch.log_softmax(model.lm_head(hidden)[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("shared", [True, False], ids=["shared_batch", "after_a_packed_graph"])
def test_a_graph_with_ids_but_no_mask_takes_the_current_layout(shared):
    """Detected from the ids alone, every padding position of that graph counted as a token (exact, but the
    lm_head ran on padding: 25,594 rows for 15,198 tokens on the Qwen3-1.7B shape). It now packs on the layout
    current for its batch (the caller's, or the backbone graph's whose output it reads), padding dropped, the
    same values at every valid position, and gradients."""
    from tests.helpers import grpo_batch, hf_model

    model = hf_model("qwen3", "sdpa")
    ref = copy.deepcopy(model)
    ids, mask, _ = grpo_batch([(7, [3, 5, 2]), (5, [4, 1])], vocab=101, left_pad=0, right_pad=2, seed=2)
    valid = (mask[:, 1:] * mask[:, :-1]).bool()
    want = _log_probs_after_a_break(ref, ids, mask)
    want[valid].sum().backward()
    torch._dynamo.reset()
    step = torch.compile(functools.partial(_log_probs_after_a_break, model), backend="dualkv", options={"inner": "aot_eager"})
    before = len(dualkv_compile.reports())
    layout = dualkv_compile.detect(ids, mask)
    with dualkv_compile.shared_batch(ids, mask) if shared else contextlib.nullcontext():
        got = step(ids, mask)
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-5)
    got[valid].sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
    head = [r for r in dualkv_compile.reports()[before:] if r.rewritten and not r.num_attention]
    assert head and all(r.packed_calls == 1 and r.layout_source.startswith("carried from") for r in head), head
    assert all(r.last_stats.tokens_after == layout.num_tokens for r in head), [str(r) for r in head]
