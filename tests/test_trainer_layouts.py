"""Unmodified Hugging Face models on the layouts trainers feed (docs/design.md, semantics 10-11): exact and packed.

* shuffled rows (TRL's GRPOTrainer shuffles a batch; veRL rebalances rows):
  the same rho as the unshuffled batch;
* one packed row with restarting position ids and no mask (veRL's
  remove-padding, TRL's padding-free): transformers builds the block-diagonal
  causal mask from the position ids, which the layout's sequences must match;
* a system prompt shared by two groups: a tree of depth 3 (system, group
  prompt, responses), and ``explain()`` says so.

Logits at every valid position and every parameter gradient are compared
with the unmodified model on the same batch (float32, 1e-5).
"""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch

import dualkv_compile
from dualkv_compile import explain
from dualkv_compile.backend import dualkv_backend

from .helpers import hf_model, rel

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 101


def _tokens(g, n):
    return torch.randint(1, VOCAB, (n,), generator=g)


def _rows(system: int, groups, seed=0):
    """Token rows ``[system | prompt_g | response]`` for groups of (prompt_len, [response lens])."""
    g = torch.Generator().manual_seed(seed)
    sys_tokens = _tokens(g, system)
    rows = []
    for P, Rs in groups:
        prompt = _tokens(g, P)
        rows += [torch.cat([sys_tokens, prompt, _tokens(g, R)]) for R in Rs]
    return rows


def _padded(rows):
    """Right-padded ``[B, S]`` ids and mask (prompts left-aligned: equal positions, equal columns)."""
    S = max(len(r) for r in rows) + 1
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _packed_row(rows):
    """All rows in one ``[1, total]`` row, position ids restarting at each sequence, no mask (veRL remove-padding)."""
    return {
        "input_ids": torch.cat(rows)[None],
        "position_ids": torch.cat([torch.arange(len(r)) for r in rows])[None],
    }


TWO_GROUPS = [(6, [3, 5, 2]), (4, [4, 1])]
SHUFFLE = [3, 0, 4, 1, 2]  # rows of the two groups interleaved


def _check(family, impl, batch):
    """Run the compiled copy and the unmodified model; return the last layout stats of the packed graph."""
    torch._dynamo.reset()
    model = hf_model(family, impl)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    out = compiled(**batch).logits
    expected = ref(**batch).logits
    valid = batch["attention_mask"].bool() if "attention_mask" in batch else torch.ones(batch["input_ids"].shape, dtype=torch.bool)
    assert rel(out[valid], expected[valid]) <= 1e-5
    proj = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1))
    (out[valid] @ proj).sum().backward()
    (expected[valid] @ proj).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel(p.grad, q.grad) <= 1e-5, name
    report = dualkv_compile.reports()[-1]
    assert report.rewritten and report.packed_calls == 1, (report.reason, report.fallback_reasons)
    return report.last_stats


MODELS = [("llama", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa"), ("qwen3", "eager")]


def _models(*fast):
    """MODELS with those not in ``fast`` under `make test-slow` (the suite's time budget); the tests below
    split the four between them, so each family and attention implementation runs in `make test`."""
    return [m if m in fast else pytest.param(*m, marks=pytest.mark.slow) for m in MODELS]


@pytest.mark.parametrize("family,impl", _models(("qwen3", "sdpa"), ("llama", "eager")))
def test_shuffled_rows_pack_as_the_unshuffled_batch(family, impl):
    rows = _rows(0, TWO_GROUPS, seed=1)
    stats = _check(family, impl, _padded([rows[i] for i in SHUFFLE]))
    # By hand: prompts 6 and 4 once, responses 3+5+2 and 4+1: 6 + 10 + 4 + 5 = 25 packed tokens of 41.
    assert (stats.tokens_before, stats.tokens_after, stats.num_groups, stats.depth) == (41, 25, 2, 2)


@pytest.mark.parametrize("family,impl", _models(("llama", "sdpa"), ("qwen3", "eager")))
def test_one_packed_row_with_restarting_positions(family, impl):
    rows = _rows(5, TWO_GROUPS, seed=2)
    stats = _check(family, impl, _packed_row([rows[i] for i in SHUFFLE]))
    # System 5 once, prompts 6 and 4 once each, responses 15: 30 packed tokens of 66, one tree of depth 3.
    assert (stats.num_rows, stats.num_sequences) == (1, 5)
    assert (stats.tokens_before, stats.tokens_after, stats.num_groups, stats.depth) == (66, 30, 1, 3)


@pytest.mark.parametrize("family,impl", _models(("qwen3", "sdpa"), ("llama", "eager")))
def test_system_prompt_shared_by_two_groups(family, impl):
    rows = _rows(5, TWO_GROUPS, seed=3)
    stats = _check(family, impl, _padded(rows))
    assert (stats.tokens_before, stats.tokens_after, stats.num_groups, stats.depth) == (66, 30, 1, 3)


def test_explain_shows_tree_depth_and_rho():
    rows = _rows(5, TWO_GROUPS, seed=3)
    model = hf_model("llama", "sdpa")
    buf = io.StringIO()
    explain(model, **_padded(rows), options={"inner": "aot_eager"}, file=buf)
    text = buf.getvalue()
    assert "5 sequences in 1 trees of depth 3" in text
    assert "tokens 66 -> 30 (rho 2.20x)" in text


@pytest.mark.parametrize("family,impl", [("qwen3", "sdpa"), ("llama", "eager")])
def test_one_packed_row_with_flash_attention_kwargs(family, impl):
    """FlashAttention-style ``cu_seq_lens_q/k`` and ``max_length_q/k`` beside the restarting position ids (as a
    padding-free collator passes them): SDPA and eager attention take the sequences from the position ids and
    ignore the kwargs, and so does the layout. (The flash-attn varlen kernels read them instead; neither machine
    here has flash-attn, and an op with no token-axis rule refuses its graph, which then runs unchanged.)"""
    rows = [_rows(5, TWO_GROUPS, seed=2)[i] for i in SHUFFLE]
    batch = _packed_row(rows)
    lens = torch.tensor([len(r) for r in rows])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()])
    batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=int(lens.max()), max_length_k=int(lens.max()))
    stats = _check(family, impl, batch)
    assert (stats.num_sequences, stats.tokens_before, stats.tokens_after, stats.depth) == (5, 66, 30, 3)


def _next_token_loss(model, batch):
    """The summed log-prob of every next token within its sequence: of the attention mask in padded rows, of
    the position ids (a token whose position is 0 starts a new sequence) in a packed row."""
    logits = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}).logits
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    keep = batch["attention_mask"][:, 1:] if "attention_mask" in batch else batch["position_ids"][:, 1:] != 0
    return (logp * keep).sum()


def test_alternating_padded_and_packed_row_batches_all_pack():
    """One ``@policy_loss`` called on padded rows, then one packed row, then padded rows again (a trainer's
    mixed micro-batches). Dynamo recompiles at each change with the sizes that changed made dynamic; an input
    seen in one layout only (the position ids, the mask) stays static, and broadcasting against it turns the
    symbolic size into a constant mid-trace, which leaves ``x.size()`` calls on model values in the graph. Each
    call must pack (all of it: every graph, every call) and equal the undecorated loss and its gradients."""
    torch._dynamo.reset()  # Dynamo's record of which sizes changed is per code object: start from none
    model = hf_model("llama", "sdpa", layers=1)
    ref = copy.deepcopy(model)
    # inner="eager": the packed graph and the fallback run uncompiled (the test's time is Dynamo's three traces).
    decorated = dualkv_compile.policy_loss(_next_token_loss, inner="eager")
    batches = [
        _padded(_rows(0, TWO_GROUPS, seed=4)),
        _packed_row([_rows(3, TWO_GROUPS, seed=5)[i] for i in SHUFFLE]),
        _padded(_rows(3, [(6, [2, 5]), (3, [1, 3, 2])], seed=6)),  # [5, 15]: another S
    ]
    start = len(dualkv_compile.reports())
    for batch in batches:
        loss, expected = decorated(model, batch), _next_token_loss(ref, batch)
        assert rel(loss.detach(), expected.detach()) <= 1e-5
        loss.backward()
        expected.backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert rel(p.grad, q.grad) <= 1e-5, name
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    new = dualkv_compile.reports()[start:]
    assert all(r.rewritten and r.packed_calls == r.calls and not r.fallback_reasons for r in new), [str(r) for r in new]
    assert sum(r.calls for r in new) == len(batches), [str(r) for r in new]  # a refused graph counts no calls
