"""Complex rotary and xIELU families (issue 49): DeepSeek-V2, Llama 4 text and Apertus packed and exact.

DeepSeek-V2 (and Llama 4) rotate q and k as complex numbers: ``polar(ones_like(freqs), freqs)`` of the
positions, ``view_as_complex`` of the pairs, a complex multiply, ``view_as_real``; Apertus' xIELU activation
takes ``torch.min(x, eps)``; Llama 4's layers without rope scale queries by a temperature with ``floor`` of
the positions. Tiny configs (2 layers, hidden 64, float32, sdpa; DeepSeek-V2's second layer an MoE with a
shared expert; Llama 4 with 4 dense layers, the fourth without rope, chunks longer than the rows) through
``torch.compile(model, backend="dualkv")`` on a GRPO batch whose rows are shuffled and left-padded, and
whose sequences form a prefix forest of depth 3 (a system prompt shared by two groups; each group's prompt
with the two tokens its responses start with, one node; the responses' rest, a response of one or two
tokens ending inside; the third group's prompt is shorter, so its left padding differs and it is a tree of
its own: the models count positions from column 0, so its system prompt sits at other positions). Logits at
valid positions and every parameter gradient are within 1e-5 of the unmodified model
(``helpers.check_model``), the call is packed, and its packed token count is the forest's, counted here
from the rows by a trie.

Llama 4 with MoE layers (``llama4_text_moe``): its dispatch copies every token once per expert, expert-major
(``hidden.repeat(num_experts, 1)``, the router's sigmoid scores transposed to the same order, a ``bmm`` per
expert, the copies summed back; analysis/moe_copies.py), and packs exactly as well.
"""

from __future__ import annotations

import pytest
import torch

import dualkv_compile

from .helpers import check_model, grpo_batch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 101
GROUPS = [(6, [3, 5, 2]), (6, [4, 1]), (4, [2, 3])]
SYSTEM = 3  # prompt tokens every group starts with
SHUFFLE = [4, 0, 6, 2, 5, 3, 1]  # the groups' rows interleaved
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               use_cache=False)


def forest_batch():
    """``grpo_batch`` rows (prompts left-padded to one length, responses of a group sharing two leading tokens)
    whose prompts also start with the same ``SYSTEM`` tokens, rows shuffled: ids, mask and positions."""
    ids, mask, pos = grpo_batch(GROUPS, VOCAB, share_response_tokens=2)
    system = torch.randint(1, VOCAB, (SYSTEM,), generator=torch.Generator().manual_seed(7))
    for b in range(ids.shape[0]):
        start = int(mask[b].nonzero()[0])
        ids[b, start : start + SYSTEM] = system
    return ids[SHUFFLE], mask[SHUFFLE], pos[SHUFFLE]


def forest_tokens(ids, mask) -> int:
    """The number of distinct prefixes of the rows' valid runs, each with its first column (the models' positions
    are columns: a prefix at another column is at other positions): the tokens of the packed prefix forest."""
    prefixes = set()
    for row, m in zip(ids, mask):
        start, seq = int(m.nonzero()[0]), tuple(row[m.bool()].tolist())
        prefixes.update((start, seq[: n + 1]) for n in range(len(seq)))
    return len(prefixes)


def deepseek_v2():
    """A dense layer, then an MoE layer (4 routed experts, top-2 greedy, one shared expert); q through a LoRA
    rank, k and v through the latent; the complex rotary on the 8-dim rope part of q and k."""
    return transformers.DeepseekV2Config(
        **_COMMON, num_key_value_heads=4, max_position_embeddings=128, first_k_dense_replace=1, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16, kv_lora_rank=16, q_lora_rank=12,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8, head_dim=8,
    ), transformers.DeepseekV2ForCausalLM


def apertus():
    """xIELU activation (``torch.min(x, eps)``), QK norms, llama3 rope (its default: positions up to 65,536)."""
    return transformers.ApertusConfig(**_COMMON, num_key_value_heads=2, head_dim=16), transformers.ApertusForCausalLM


def llama4_text():
    """Four dense layers (the fourth without rope, with the attention temperature: ``floor`` of positions);
    chunked attention of 1,024 tokens, longer than the rows."""
    return transformers.Llama4TextConfig(
        **{**_COMMON, "num_hidden_layers": 4}, num_key_value_heads=2, head_dim=16, intermediate_size_mlp=96,
        max_position_embeddings=128, attention_chunk_size=1024, moe_layers=[],
    ), transformers.Llama4ForCausalLM


def llama4_text_moe():
    """Two MoE layers (3 experts, top-1 by sigmoid score, a shared expert): every token copied once per expert,
    expert-major, and the copies summed back. The second layer's attention reads the first's dispatch, so the
    call packs only if the dispatch does (it is not computed in the original layout)."""
    return transformers.Llama4TextConfig(
        **_COMMON, num_key_value_heads=2, head_dim=16, intermediate_size_mlp=96, max_position_embeddings=128,
        attention_chunk_size=1024, moe_layers=[0, 1], num_local_experts=3, num_experts_per_tok=1,
    ), transformers.Llama4ForCausalLM


def _model(build):
    cfg, model_cls = build()
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return model_cls(cfg).train()


def _check(build):
    """Run ``check_model`` (logits and every gradient, 1e-5) on the forest batch; return the new reports."""
    torch._dynamo.reset()
    model = _model(build)
    before = len(dualkv_compile.reports())
    check_model(model, [forest_batch()])
    return dualkv_compile.reports()[before:]


def test_forest_batch_is_a_depth_three_forest():
    ids, mask, _ = forest_batch()
    layout = dualkv_compile.detect(ids, mask)
    assert "depth=3" in str(layout) and layout.num_tokens == forest_tokens(ids, mask) < int(mask.sum())


@pytest.mark.parametrize(
    "build", [deepseek_v2, llama4_text, llama4_text_moe, apertus], ids=["deepseek_v2", "llama4_text", "llama4_text_moe", "apertus"]
)
def test_packs_exactly(build):
    reports = _check(build)
    (whole,) = reports
    layers = build()[0].num_hidden_layers
    assert whole.num_attention == layers and whole.rewritten and whole.packed_calls == 1, (whole.reason, whole.fallback_reasons)
    ids, mask, _ = forest_batch()
    stats = whole.last_stats
    assert (stats.tokens_before, stats.tokens_after) == (int(mask.sum()), forest_tokens(ids, mask))

