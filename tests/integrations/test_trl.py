"""``integrations.trl``: TRL's GRPOTrainer scoring forward through dualkv, exact and packed.

TRL 1.16 scores completions with ``model(..., labels=labels, fused_lm_head=True)``: a
forward TRL patches in (``add_fused_lm_head``) that calls the backbone, then flattens
``last_hidden_state[:, :-1]`` to ``[B * (S - 1), H]`` into a chunked log-prob autograd
function. dualkv routes the backbone, so TRL's patch may come before or after it; the
rest runs as TRL wrote it. LoRA through TRL's ``peft_config`` trains exactly as without
dualkv (``test_grpo_lora_matches_the_plain_trainer``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import dualkv_compile
from dualkv_compile.integrations.trl import compile_scoring_forward, enable

from ..helpers import hf_model, rel
from ..test_examples import ROOT, run

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


def _patched_and_routed(order):
    """A tiny Qwen3 with TRL's fused head and dualkv, in the given order: "trl_first" (``enable`` after the
    trainer is built) or "dualkv_first" (``compile_scoring_forward`` on the bare model, then TRL patches it,
    twice: a second trainer built on the same model patches the patched forward again)."""
    model = hf_model("qwen3", "sdpa")
    patch = lambda: trl_utils.add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))  # noqa: E731
    if order == "trl_first":
        patch()
    compile_scoring_forward(model, inner="aot_eager")
    if order == "dualkv_first":
        patch()
        patch()
    return model


@pytest.mark.parametrize("compact, order", [(False, "trl_first"), (True, "trl_first"), (False, "dualkv_first")])
def test_fused_lm_head_forward_packs_and_is_exact(compact, order, monkeypatch):
    """``compact``: TRL on a GPU selects ``hidden_states[mask]`` (a data-dependent shape); elsewhere it flattens
    every position. ``order``: whether TRL patches ``forward`` before dualkv is turned on or after."""
    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: compact)
    torch._dynamo.reset()
    seen = len(dualkv_compile.reports())
    model, ref = _patched_and_routed(order), _fused_model()
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
    graphs = dualkv_compile.reports()[seen:]
    packed = [r for r in graphs if r.num_attention]
    assert len(packed) == 1 and packed[0].packed_calls == 1, [str(r) for r in graphs]
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


def _routed(model):
    return getattr(model.model.forward, "_dualkv_scoring_forward", False)  # the backbone's forward


def test_enable_compiles_policy_and_reference_once():
    trainer = _Trainer(_fused_model(), _fused_model())
    assert enable(trainer, inner="aot_eager") is trainer
    assert _routed(trainer.model) and _routed(trainer.ref_model)
    with pytest.raises(ValueError, match="already enabled on this _Trainer"):
        enable(trainer)
    with pytest.raises(ValueError, match="already enabled on this Qwen3ForCausalLM"):
        compile_scoring_forward(trainer.model)


def test_enable_after_compile_scoring_forward_wraps_nothing_twice():
    """The model routed before the trainer was built: ``enable`` keeps that wrapper (same options) and routes
    the reference model; other options than the model's raise instead of wrapping it again."""
    policy = compile_scoring_forward(hf_model("qwen3", "sdpa"), inner="aot_eager")
    wrapper = policy.model.forward
    trainer = _Trainer(policy, _fused_model())
    enable(trainer, inner="aot_eager")
    assert policy.model.forward is wrapper and _routed(trainer.ref_model)
    assert not getattr(wrapper.__wrapped__, "_dualkv_scoring_forward", False)  # over the original forward
    already = r"trainer.model: dualkv is already enabled on it .* with options \{'inner': 'aot_eager'\}"
    with pytest.raises(ValueError, match=already):
        enable(_Trainer(policy), inner="inductor")


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


def test_trl_grpo_vision_language_matches_the_plain_trainer():
    """The same with a tiny Qwen2.5-VL through its processor, one image a prompt: every scoring forward packed to
    the distinct prefixes of its rows (an image's tokens shared only between rows showing that image), the vision
    tower run on fewer images than it was given, every metric equal to the plain trainer's (1e-5)."""
    out = run("trl_grpo.py", "--vlm", "--steps", "2")
    assert "trl_grpo: OK" in out
    assert "(equal)" in out and "RAN UNPACKED" not in out and "vision tower (images_once): ran on" in out


def _example():
    """examples/trl_grpo.py as a module: its ``train`` runs here (no second interpreter to start)."""
    spec = importlib.util.spec_from_file_location("trl_grpo_example", os.path.join(ROOT, "examples", "trl_grpo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_plain_lora_runs = {}  # the plain trainer's log, shared by both orders


# enable_before in make test-slow (make test's budget): the same trainer path with LoRA applied before dualkv.
@pytest.mark.parametrize("order", ["enable_after", pytest.param("enable_before", marks=pytest.mark.slow)])
def test_grpo_lora_matches_the_plain_trainer(order, tmp_path):
    """GRPOTrainer with ``peft_config=LoraConfig(...)``, 2 steps on CPU (float32), dualkv turned on after the
    trainer is built (``enable``) or on the bare model before it (``compile_scoring_forward``: TRL then wraps
    it with PEFT and patches its forward): every scoring forward packed to the distinct prefixes of its rows,
    every metric TRL logged equal to the trainer without dualkv (1e-5)."""
    peft = pytest.importorskip("peft")
    ex = _example()
    # One layer: the trainer's path is the same as with two, in half the compile time (make test's budget).
    argv = ["--steps", "2", "--lora", "--layers", "1"] + (["--enable-before"] if order == "enable_before" else [])
    args = ex.parse_args(argv)
    args.output_dir = str(tmp_path)
    if "log" not in _plain_lora_runs:
        _plain_lora_runs["log"] = ex.train(args, use_dualkv=False)[0].state.log_history
    torch._dynamo.reset()
    seen = len(dualkv_compile.reports())
    trainer, calls, _, _ = ex.train(args, use_dualkv=True)

    assert isinstance(trainer.model, peft.PeftModel)
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained), trained
    assert calls
    for c in calls:
        stats = c["stats"]
        assert stats is not None, "a scoring forward ran unpacked"
        # The oracle: each distinct prefix of the rows' valid runs once (the example's, from the batch alone).
        oracle = ex.distinct_prefixes(c["ids"], c["mask"])
        assert stats.tokens_before == int(c["mask"].sum()) > stats.tokens_after == oracle
    graphs = dualkv_compile.reports()[seen:]
    with_attention = [r for r in graphs if r.num_attention]
    assert with_attention and all(r.rewritten and r.packed_calls > 0 for r in with_attention), [str(r) for r in graphs]
    diffs = ex.metric_diffs(_plain_lora_runs["log"], trainer.state.log_history)
    assert {"loss", "grad_norm", "entropy", "reward"} <= set(diffs)
    assert max(diffs.values()) <= 1e-5, diffs


def test_grpo_with_checkpointing_is_not_recompiled_at_every_step(tmp_path):
    """TRL's default gradient checkpointing, one generation per step for 3 steps: TRL switches checkpointing off
    and on around each generation, and transformers adds an input-embedding hook at each switch-on. Dynamo
    guards on the hook count, so the forward was recompiled at every step (on an H100, 18 s a step for a
    Qwen3-0.6B shape). With the copies dropped: no recompile after Dynamo's dynamic-size one, packed at
    every step."""
    ex = _example()
    # This seed's first batch is 16 x 16: rows as many as columns (which packs since a02bda3).
    args = ex.parse_args(["--steps", "3", "--steps-per-generation", "1", "--layers", "1"])
    args.output_dir = str(tmp_path)
    torch._dynamo.reset()
    seen = len(dualkv_compile.reports())
    trainer, calls, _, _ = ex.train(args, use_dualkv=True)
    assert trainer.args.gradient_checkpointing and len(calls) == 3
    assert all(c["stats"] is not None for c in calls), "a scoring forward ran unpacked"
    with_attention = [r for r in dualkv_compile.reports()[seen:] if r.num_attention]
    # The static graph of the first call and the one Dynamo compiles with dynamic sizes at the next length;
    # no third (the hook copies made one at every step).
    assert len(with_attention) == 2 and sum(r.packed_calls for r in with_attention) == 3, [str(r) for r in with_attention]
