"""Activation checkpointing (torch.utils.checkpoint per decoder layer) with the dualkv backend.

Dynamo turns each checkpoint region into a higher-order-op call whose
subgraph holds the layer, attention included; the analysis does not enter
those subgraphs yet, so the graph is refused with a reason naming
checkpointing, and the compiled model stays exact (it runs unchanged).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import dualkv_compile
from dualkv_compile.backend import dualkv_backend

from .test_backend import _hf_model, _rel, grpo_batch

pytest.importorskip("transformers")


def test_gradient_checkpointing_refused_with_reason_and_exact(one_thread):
    torch._dynamo.reset()
    model = _hf_model("qwen3", "sdpa", layers=2)
    ref = copy.deepcopy(model)
    # Hugging Face's per-layer checkpointing (torch.utils.checkpoint, non-reentrant); the name works in 5.17 and 5.23.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    ids, mask, _ = grpo_batch([(7, [3, 5, 4, 2])], 101)
    start = len(dualkv_compile.reports())
    out = compiled(input_ids=ids, attention_mask=mask).logits
    expect = ref(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    assert _rel(out[valid], expect[valid]) <= 1e-5
    out[valid].square().mean().backward()
    expect[valid].square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) <= 1e-5, name
    new = dualkv_compile.reports()[start:]
    assert new and not any(r.rewritten for r in new), [str(r) for r in new]
    assert any("activation checkpointing" in (r.reason or "") for r in new), [r.reason for r in new]

    # The same model without checkpointing is rewritten and runs packed: the refusal is checkpointing's alone.
    model.gradient_checkpointing_disable()
    torch._dynamo.reset()
    start = len(dualkv_compile.reports())
    torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))(input_ids=ids, attention_mask=mask)
    assert any(r.rewritten and r.packed_calls == 1 for r in dualkv_compile.reports()[start:])
