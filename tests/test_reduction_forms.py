"""Sums over tokens written the ways losses and routers write them: each weighted on the packed stream, exact.

Each form reduces a model value over both token axes of a padded GRPO batch (one group with a shared
prompt, right padding only, so every form's mask zeroes each position packing does not compute), through
``torch.compile(fn, backend="dualkv")``. The value and every parameter gradient are compared with the
unmodified function, and the call must run packed: the forms cover keepdim, dims given both ways, a merged
``[B*S, F]`` axis, feature dims kept, next-token values, a dtype argument, expert counts by ``scatter_add``,
``index_add`` and (on a batch without padding, as transformers counts without a mask) ``histc``, and an
integer count zeroed at padding by ``& mask``.
"""

from __future__ import annotations

import functools
import operator

import pytest
import torch

import dualkv_compile
from dualkv_compile.backend import dualkv_backend

from tests.helpers import grpo_batch, hf_model, rel

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 101


def _logits(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask).logits.float()


def _keepdim_mean_features(model, ids, mask):
    x = _logits(model, ids, mask)[..., :5] * mask[..., None]
    return x.mean(dim=(1, 0), keepdim=True).square().sum()  # [1, 1, 5]: the original count B * S


def _merged_sum(model, ids, mask):
    x = _logits(model, ids, mask)
    flat = torch.softmax(x, -1).reshape(-1, x.shape[-1]) * mask.reshape(-1, 1)
    return (flat.sum(0) * torch.linspace(-1, 1, x.shape[-1])).sum()


def _next_token_sum_with_dtype(model, ids, mask):
    x = _logits(model, ids, mask)[:, :-1].to(torch.float64)
    logp = torch.log_softmax(x, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.sum(logp * mask[:, 1:], dtype=torch.float32)


def _expert_counts(model, ids, mask):
    """A router's load-balancing statistics, two ways: scatter_add of the mask, index_add of masked probabilities."""
    x = _logits(model, ids, mask)[..., :4].reshape(-1, 4)
    probs = torch.softmax(x, -1)
    top = probs.topk(2, dim=-1).indices.reshape(-1)
    flat_mask = mask.reshape(-1).float()
    a = torch.zeros(4).scatter_add(0, top, flat_mask.repeat_interleave(2))
    b = torch.zeros(4, 4).index_add(0, top, probs.repeat_interleave(2, dim=0) * flat_mask.repeat_interleave(2)[:, None])
    w = (probs * flat_mask[:, None]).sum(0)
    return ((a * w).sum() + (b * w).sum()) / flat_mask.sum()


def _expert_histc(model, ids, mask):
    """histc of expert ids, as transformers counts them without a mask: every position counts (no padding here)."""
    x = _logits(model, ids, mask)[..., :4].reshape(-1, 4)
    probs = torch.softmax(x, -1)
    counts = torch.histc(probs.topk(2, dim=-1).indices.reshape(-1).float(), bins=4, min=0, max=4)
    return (counts / x.shape[0] * probs.sum(0)).sum()


def _integer_count(model, ids, mask):
    x = _logits(model, ids, mask)
    picked = (x.topk(1, dim=-1).indices[..., 0] == ids) & mask.bool()  # how many tokens the model would repeat
    return picked.sum() + (x.logsumexp(-1) * mask).sum() / mask.sum()


# (form, batch without padding)
FORMS = [(_keepdim_mean_features, False), (_merged_sum, False), (_next_token_sum_with_dtype, False),
         (_expert_counts, False), (_expert_histc, True), (_integer_count, False)]


def _compiled_matches_eager(form, dense: bool, backend=dualkv_backend) -> list:
    """Compile ``form`` on a 1-layer Llama with ``backend`` (given ``inner="aot_eager"``), check its value
    and gradients against eager's on a copy (1e-5), and return the graph reports the compile added."""
    torch.manual_seed(0)
    model, ref = hf_model("llama", "sdpa", layers=1), hf_model("llama", "sdpa", layers=1)
    ref.load_state_dict(model.state_dict())
    if dense:
        ids, mask, _ = grpo_batch([(6, [4, 4, 4])], VOCAB, left_pad=0, right_pad=0)
        assert bool(mask.all())
    else:
        ids, mask, _ = grpo_batch([(6, [3, 5, 1, 4])], VOCAB, left_pad=0)
    torch._dynamo.reset()
    before = len(dualkv_compile.reports())
    got = torch.compile(form, backend=functools.partial(backend, options={"inner": "aot_eager"}))(model, ids, mask)
    want = form(ref, ids, mask)
    assert got.dtype == want.dtype and rel(got.double().detach(), want.double().detach()) <= 1e-5
    if want.requires_grad:
        got.backward()
        want.backward()
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            if b.grad is not None:
                assert rel(a.grad, b.grad) <= 1e-5, name
    return dualkv_compile.reports()[before:]


@pytest.mark.parametrize("form, dense", FORMS, ids=[f.__name__.strip("_") for f, _ in FORMS])
def test_reduction_form_packs_exactly(form, dense):
    reports = _compiled_matches_eager(form, dense)
    assert reports and all(r.packed_calls == r.calls for r in reports if r.num_attention), [str(r) for r in reports]
    assert any(r.packed_calls for r in reports), [str(r) for r in reports]


# torch 2.12's Dynamo records a comparison of two tensors as a method call (``call_method __eq__``); 2.13
# records ``operator.eq``. The backend must read both the same way.
_AS_METHODS = {operator.eq: "__eq__", operator.ne: "__ne__", operator.lt: "__lt__", operator.le: "__le__",
               operator.gt: "__gt__", operator.ge: "__ge__"}


def _comparisons_as_methods(gm, example_inputs, **kwargs):
    """``dualkv_backend`` on the graph as torch 2.12 traces it: every comparison a ``call_method``."""
    changed = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _AS_METHODS:
            n.op, n.target = "call_method", _AS_METHODS[n.target]
            changed += 1
    assert changed, "the form compares no tensors: nothing to test"
    gm.recompile()
    return dualkv_backend(gm, example_inputs, **kwargs)


def test_comparison_traced_as_a_method_still_packs():
    """The integer count's ``(argmax == ids) & mask`` packs and is exact when ``==`` is a ``call_method``
    (under torch 2.12 it ran unpacked: the padding-read check did not know ``__eq__`` maps position to position)."""
    reports = [r for r in _compiled_matches_eager(_integer_count, False, _comparisons_as_methods) if r.num_attention]
    assert reports and all(r.packed_calls == r.calls > 0 for r in reports), [str(r) for r in reports]
