"""``integrations.trl``: TRL's GRPOTrainer scoring forward through dualkv, exact and packed.

TRL 1.16 scores completions with ``model(..., labels=labels, fused_lm_head=True)``:
the backbone, then ``last_hidden_state[:, :-1]`` flattened to ``[B * (S - 1), H]``
into a chunked log-prob autograd function that Dynamo cannot trace (a graph
break). The backbone's graph must pack with that merged output; the rest runs
as TRL wrote it.
"""

from __future__ import annotations

import pytest
import torch

import dualkv_compile
from dualkv_compile.integrations.trl import compile_scoring_forward, enable

from ..helpers import hf_model, rel
from ..test_examples import run

trl_utils = pytest.importorskip("trl.trainer.utils")

pytestmark = pytest.mark.usefixtures("one_thread")


def _trl_batch(seed=0):
    """TRL's layout: prompts left padded, completions right padded, rows of two groups shuffled."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for p in (5, 7):
        prompt = torch.randint(2, 101, (p,), generator=g)
        rows += [(prompt, torch.randint(2, 101, (r,), generator=g)) for r in (3, 4, 2)]
    rows = [rows[i] for i in (3, 0, 4, 1, 5, 2)]
    P, C = max(len(a) for a, _ in rows), max(len(b) for _, b in rows)
    ids = torch.zeros(len(rows), P + C, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (a, b) in enumerate(rows):
        ids[i, P - len(a) : P], ids[i, P : P + len(b)] = a, b
        mask[i, P - len(a) : P + len(b)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-C] = -100  # TRL scores the completion tokens only
    return ids, mask, labels, C


def _fused_model():
    model = hf_model("qwen3", "sdpa")
    trl_utils.add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    return model


@pytest.mark.parametrize("compact", [False, True])
def test_fused_lm_head_forward_packs_and_is_exact(compact, monkeypatch):
    """``compact``: TRL on a GPU selects ``hidden_states[mask]`` (a data-dependent shape: the graph breaks
    before it, and the backbone's graph returns ``[B, S - 1, H]``); elsewhere it flattens every position."""
    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: compact)
    torch._dynamo.reset()
    model, ref = _fused_model(), _fused_model()
    compile_scoring_forward(model, inner="aot_eager")
    ids, mask, labels, C = _trl_batch()
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    expected = ref(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    for name in ("log_probs", "entropy"):
        assert rel(getattr(out, name)[:, -C:], getattr(expected, name)[:, -C:]) <= 1e-5, name
    loss = lambda o: (o.log_probs[:, -C:] * torch.linspace(-1, 1, C)).sum() + o.entropy.sum()  # noqa: E731
    loss(out).backward()
    loss(expected).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel(p.grad, q.grad) <= 1e-5, name
    packed = [r for r in dualkv_compile.reports()[-3:] if r.num_attention]
    assert len(packed) == 1 and packed[0].packed_calls == 1, [str(r) for r in dualkv_compile.reports()[-3:]]
    # Two prompts of 5 and 7 once, completions 3+4+2 twice: 30 packed tokens of 54.
    assert (packed[0].last_stats.tokens_before, packed[0].last_stats.tokens_after) == (54, 30)


def test_generation_runs_the_original_forward():
    torch._dynamo.reset()
    model, ref = _fused_model(), _fused_model()
    model.config.use_cache = ref.config.use_cache = True
    compile_scoring_forward(model, inner="aot_eager")
    seen = len(dualkv_compile.reports())
    ids = torch.randint(2, 101, (2, 5), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))
    assert len(dualkv_compile.reports()) == seen  # nothing compiled


class _Trainer:
    def __init__(self, model, ref_model=None):
        self.model, self.ref_model = model, ref_model


def test_enable_compiles_policy_and_reference_once():
    trainer = _Trainer(_fused_model(), _fused_model())
    assert enable(trainer, inner="aot_eager") is trainer
    for m in (trainer.model, trainer.ref_model):
        assert getattr(m.forward, "_dualkv_scoring_forward", False)
    with pytest.raises(ValueError, match="already enabled"):
        enable(trainer)


def test_enable_names_bad_arguments():
    with pytest.raises(TypeError, match="trainer must be a TRL GRPOTrainer"):
        enable(object())
    with pytest.raises(ValueError, match=r"options: unknown dualkv option\(s\) \['innr'\]"):
        enable(_Trainer(_fused_model()), innr="aot_eager")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        compile_scoring_forward("model")


def test_trl_grpo_example_matches_the_plain_trainer():
    """GRPOTrainer, 2 steps on CPU: every scoring forward packed (rho of the distinct prefixes, rows shuffled
    or not), every logged metric equal to the plain trainer's (float32, 1e-5)."""
    out = run("trl_grpo.py", "--steps", "2")
    assert "trl_grpo: OK" in out
    assert "rows of one prompt interleaved" in out and "(equal)" in out and "RAN UNPACKED" not in out
