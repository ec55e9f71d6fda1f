"""GQA eager attention that casts the repeated keys (``repeat_kv(key).float()``, as Flint's does) packs exactly.

The op does GQA itself, so the rewrite strips Hugging Face's ``repeat_kv`` from K and V. Flint's cast sits
between the repeat and the matmul on K only; the rewrite once stripped V's repeat but not K's and called the
kernel with K at 4 heads and V at 2, unchecked: wrong logits in the forward, a corrupted heap in the backward.
"""

from __future__ import annotations

import pytest
import torch
import transformers.models.llama.modeling_llama as modeling_llama

import dualkv_compile
import dualkv_compile.ops.attention  # noqa: F401 (registers torch.ops.dualkv)

from tests.helpers import check_model, grpo_batch, hf_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _eager_with_casts(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    key_states = modeling_llama.repeat_kv(key, module.num_key_value_groups)
    value_states = modeling_llama.repeat_kv(value, module.num_key_value_groups)
    w = torch.matmul(query.float(), key_states.float().transpose(2, 3)) * scaling
    if attention_mask is not None:
        w = w + attention_mask
    w = torch.softmax(w, dim=-1).to(value_states.dtype)
    out = torch.matmul(w, value_states).transpose(1, 2).contiguous()
    return out, w


def test_cast_repeated_keys_pack_exactly(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(modeling_llama, "eager_attention_forward", _eager_with_casts)
    model = hf_model("llama", "eager", layers=1)
    check_model(model, [grpo_batch([(6, [3, 5, 2]), (4, [4, 1])], 101)])
    report = dualkv_compile.reports()[-1]
    assert report.rewritten and report.packed_calls == 1, report.reason


def test_op_refuses_k_and_v_with_different_heads():
    """The op checks its operands: the kernels index K and V by head without bounds checks."""
    T = 7
    q, k = torch.randn(1, 4, T, 8), torch.randn(1, 4, T, 8)
    v = torch.randn(1, 2, T, 8)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)
    # One prompt of 3 tokens, two responses of 2: seg_start, seg_len, parent, prefix_len, subtree_end.
    segs = (i32(0, 3, 5), i32(3, 2, 2), i32(-1, 0, 0), i32(0, 3, 3), i32(7, 5, 7))
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        torch.ops.dualkv.attention_fwd(q, k, v, *segs, 3, 3, 0.35, 0.0, "cpu_flash")
