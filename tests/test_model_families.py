"""Dense Hugging Face families beyond Llama/Qwen: packed and exact on a GRPO batch (issue 19 keeps them so).

Mistral, Gemma, Gemma3 (text), Phi3, OLMo2 and GPT-NeoX, tiny configs (one layer, float32, sdpa) through
``torch.compile(model, backend="dualkv")``: logits at valid positions and every parameter gradient within
1e-5 of the unmodified model on the same padded batch, and the call packed (41 tokens -> 25).
"""

from __future__ import annotations

import pytest
import torch

import dualkv_compile

from .helpers import check_model, grpo_batch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 101
GROUPS = [(6, [3, 5, 2]), (4, [4, 1])]
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
               max_position_embeddings=128, use_cache=False)
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, head_dim=8)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_key_value_heads=2, head_dim=8)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(num_key_value_heads=2, head_dim=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=2, pad_token_id=0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=2)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.5)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dense_family_packs_exactly(family):
    config_cls, model_cls, extra = FAMILIES[family]
    cfg = getattr(transformers, config_cls)(**_COMMON, **extra)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).train()
    torch._dynamo.reset()
    before = len(dualkv_compile.reports())
    check_model(model, [grpo_batch(GROUPS, VOCAB)])  # logits at valid positions and every gradient, 1e-5
    reports = dualkv_compile.reports()[before:]
    assert sum(r.packed_calls for r in reports) >= 1, [(r.reason, r.fallback_reasons) for r in reports]
    assert all(r.last_stats.tokens_after == 25 for r in reports if r.packed_calls), [str(r) for r in reports]
