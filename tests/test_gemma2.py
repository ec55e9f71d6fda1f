"""A tiny Gemma 2 (eager attention, logit softcap, alternating sliding-window layers) through the dualkv backend.

Gemma 2's attention caps the scaled scores (``c * tanh(s / c)``) before the
mask and an fp32 softmax; the rewrite matches it and runs the shared-prompt
kernel with the same cap. Its sliding-window layers' window is read from the
graph and runs in the kernel on each token's depth: packed and exact whether
or not the window binds, also when the first batch's sequences are all
shorter than the window (a batch the mask check cannot tell a window on). Checked against the unmodified model: logits at
valid positions and every parameter gradient within 1e-5 relative.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import dualkv_compile
from dualkv_compile.backend import dualkv_backend
from tests.helpers import grpo_batch, rel

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

GROUPS = [(7, [3, 5, 4]), (5, [2, 6])]  # two GRPO groups: 5 rows of 16 columns, 51 valid tokens


def gemma2(softcap=50.0, sliding_window=4096, layers=2):
    cfg = transformers.Gemma2Config(
        vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, use_cache=False,
        attn_logit_softcapping=softcap, sliding_window=sliding_window, torch_dtype=torch.float32,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(cfg).train()


def run(model, batches, dynamic=None):
    """Compile a copy with dualkv; per batch, the max relative differences of the logits (valid positions) and the
    parameter gradients against the unmodified model; and the reports made."""
    torch._dynamo.reset()
    ref_model = copy.deepcopy(model)
    compiled = torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}),
                             dynamic=dynamic)
    start = len(dualkv_compile.reports())
    diffs = []
    for ids, mask, _ in batches:
        out = compiled(input_ids=ids, attention_mask=mask).logits
        ref = ref_model(input_ids=ids, attention_mask=mask).logits
        valid = mask.bool()
        proj = torch.randn(out.shape[-1], generator=torch.Generator().manual_seed(1))
        (out[valid] @ proj).sum().backward()
        (ref[valid] @ proj).sum().backward()
        grads = [rel(p.grad, q.grad) for p, q in zip(model.parameters(), ref_model.parameters())]
        diffs.append((rel(out[valid].detach(), ref[valid].detach()), max(grads)))
        model.zero_grad(set_to_none=True)
        ref_model.zero_grad(set_to_none=True)
    return diffs, dualkv_compile.reports()[start:]


@pytest.mark.parametrize("softcap", [50.0, 1.0])
def test_gemma2_softcap_packs_exactly(softcap):
    diffs, reports = run(gemma2(softcap), [grpo_batch(GROUPS, 101)])
    (logits, grads), = diffs
    assert logits <= 1e-5 and grads <= 1e-5, diffs
    (report,) = reports
    assert report.rewritten and report.num_attention == 2 and report.packed_calls == 1, report.reason
    assert (report.last_stats.tokens_before, report.last_stats.tokens_after) == (51, 32)


def test_binding_sliding_window_packs_exactly():
    # Every sequence of the first batch is at most 7 tokens, within the window of 8: its masks are causal, so the
    # first call's mask check cannot see the window; the second batch (same shape) has sequences of 12 tokens,
    # where it binds. The window is read from the graph, so both batches pack and stay exact.
    batches = [grpo_batch([(4, [3, 2]), (3, [4])], 101, left_pad=8), grpo_batch([(8, [4, 1]), (4, [2])], 101, left_pad=4)]
    assert batches[0][0].shape == batches[1][0].shape
    diffs, reports = run(gemma2(1.0, sliding_window=8), batches)
    assert all(d <= 1e-5 for pair in diffs for d in pair), diffs
    (report,) = reports
    assert report.rewritten and report.packed_calls == 2, report


def test_sliding_window_under_dynamic_shapes_packs_past_the_window():
    # The window of 20 binds on the second batch (S = 24) and not on the first (S = 16): one packed graph for
    # both, with the window as a constant of its attention, not a guard on the sequence length.
    batches = [grpo_batch(GROUPS, 101), grpo_batch([(12, [8, 9]), (4, [2, 6, 1])], 101)]  # S = 16, then 24
    diffs, reports = run(gemma2(1.0, sliding_window=20, layers=1), batches, dynamic=True)
    assert all(d <= 1e-5 for pair in diffs for d in pair), diffs
    assert sum(r.packed_calls for r in reports) == 2, [str(r) for r in reports]
