"""The veRL integration's compiled region without veRL installed: its math against veRL's, and its attention switch."""

from __future__ import annotations

import copy
import functools

import torch

import dualkv_compile
from dualkv_compile.backend import dualkv_backend
from dualkv_compile.integrations.verl import log_probs_and_entropy, sdpa_for_flash_attention

from tests.helpers import hf_model, rel
from tests.rewrite.test_gather_unpacked import GROUPS, remove_padding_row, verl_log_probs


def test_flash_attention_2_config_reads_sdpa_in_the_compiled_call_packed_and_exact():
    model = hf_model("qwen3", "sdpa")
    ref = copy.deepcopy(model)
    # veRL's default; HF's flash path cannot run here, so any trace that reads it would fail the call.
    model.config._attn_implementation = "flash_attention_2"
    ids, pos, rolled = remove_padding_row(GROUPS, seed=5)
    torch._dynamo.reset()
    fn = torch.compile(functools.partial(log_probs_and_entropy, model), backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    with sdpa_for_flash_attention(model):
        assert model.config._attn_implementation == "sdpa"
        logp, entropy = fn(input_ids=ids, position_ids=pos, rolled=rolled, temperature=0.7, calculate_entropy=True)
    assert model.config._attn_implementation == "flash_attention_2"
    ref_logp, ref_entropy = verl_log_probs(ref, ids, pos, rolled)  # veRL's math written out, temperature 0.7
    assert rel(logp, ref_logp) <= 1e-6 and rel(entropy, ref_entropy) <= 1e-6
    report = dualkv_compile.reports()[-1]
    assert report.packed_calls == 1 and report.last_stats.tokens_after < report.last_stats.tokens_before


def test_log_probs_and_entropy_fuse_with_the_lm_head_exact():
    """The integration's region on veRL's row: log-probs at the rolled labels and the entropy both from the
    lm_head in chunks (no [T, V] tensor), equal to veRL's math written out, values and gradients."""
    model = hf_model("qwen3", "sdpa")
    ref = copy.deepcopy(model)
    ids, pos, rolled = remove_padding_row(GROUPS, seed=6)
    torch._dynamo.reset()
    fn = torch.compile(functools.partial(log_probs_and_entropy, model), backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    logp, entropy = fn(input_ids=ids, position_ids=pos, rolled=rolled, temperature=0.7, calculate_entropy=True)
    ref_logp, ref_entropy = verl_log_probs(ref, ids, pos, rolled)
    assert rel(logp, ref_logp) <= 1e-6 and rel(entropy, ref_entropy) <= 1e-6
    g = torch.Generator().manual_seed(1)
    w1, w2 = torch.randn(logp.shape, generator=g), torch.randn(entropy.shape, generator=g)
    ((logp * w1).sum() + (entropy * w2).sum()).backward()
    ((ref_logp * w1).sum() + (ref_entropy * w2).sum()).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel(p.grad, q.grad) <= 1e-5, name
    report = dualkv_compile.reports()[-1]
    assert report.packed_calls == 1 and report.fused_log_probs == 1 and report.fused_entropy == 1, str(report)
