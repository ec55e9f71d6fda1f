"""``checkpoint_inside_hooks``: Hugging Face layers that checkpoint their whole ``__call__`` (transformers up to
5.22) under FSDP2 per layer run uncompiled and unpacked; with the checkpoint moved inside the hooks they pack.

This transformers checkpoints ``forward`` already, so the older arrangement is rebuilt on its decoder layer
(``_call_checkpointing``: the layer's ``__call__`` checkpointed around the module call, as transformers 5.17's
``GradientCheckpointingLayer`` does). One gloo rank (``tests.gloo_ranks``), FSDP2 on each layer and the root,
veRL's remove-padding row inside ``shared_batch``.
"""

from __future__ import annotations

import copy
import functools
import inspect

import pytest
import torch
import torch.distributed as dist

import dualkv_compile
from dualkv_compile.integrations.hf_checkpointing import checkpoint_inside_hooks

from tests.gloo_ranks import spawn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available")


def _call_checkpointing(model):
    """Give every decoder layer transformers 5.17's checkpointing: around ``__call__``, hooks included."""
    base = type(model.model.layers[0])

    class CallCheckpointingLayer(base):
        def __call__(self, *args, **kwargs):
            if self.gradient_checkpointing and self.training:
                return self._gradient_checkpointing_func(functools.partial(super().__call__, **kwargs), *args)
            return super().__call__(*args, **kwargs)

    CallCheckpointingLayer.forward = inspect.unwrap(base.forward)  # this transformers' forward-level checkpoint off
    for layer in model.model.layers:
        layer.__class__ = CallCheckpointingLayer


def _rank(rank):
    from tests.helpers import assert_sharded_grads_close, shard_per_layer
    from tests.rewrite.test_gather_unpacked import remove_padding_row, verl_log_probs_only
    from tests.test_sequence_parallel import tiny_model

    model = tiny_model("qwen3")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _call_checkpointing(model)
    ref = copy.deepcopy(model)
    shard_per_layer(model)
    ids, pos, rolled = remove_padding_row([(9, [3, 5, 2]), (6, [4, 1])], seed=5)
    want = verl_log_probs_only(ref, ids, pos, rolled)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want * weights).sum().backward()

    def run():
        torch._dynamo.reset()
        before = len(dualkv_compile.reports())
        step = torch.compile(functools.partial(verl_log_probs_only, model), backend="dualkv", options={"inner": "aot_eager"})
        model.zero_grad(set_to_none=True)
        with dualkv_compile.shared_batch(ids, None, pos):
            logp = step(input_ids=ids, position_ids=pos, rolled=rolled)
        torch.testing.assert_close(logp, want, rtol=1e-5, atol=1e-5)
        (logp * weights).sum().backward()
        assert_sharded_grads_close(model, ref)
        return [r for r in dualkv_compile.reports()[before:] if r.num_attention]

    # Checkpointed around __call__: Dynamo runs torch.utils.checkpoint eagerly and no layer is compiled.
    assert run() == []
    assert checkpoint_inside_hooks(model) == 2
    assert checkpoint_inside_hooks(model) == 0  # once
    # A subclass per layer class (FSDP2's included), the flag keeping its meaning.
    assert all(layer.gradient_checkpointing and type(layer).__call__ is torch.nn.Module.__call__ for layer in model.model.layers)
    assert len({type(layer) for layer in model.model.layers}) == 1
    # Inside the hooks: the layers' graph compiles, packed, the checkpoint a region of it, exact.
    with_attention = run()
    assert with_attention and all(r.rewritten and r.packed_calls == r.calls for r in with_attention), with_attention


def test_checkpoint_moved_inside_fsdp2_hooks_packs_the_layers():
    spawn(_rank, world=1)


def test_layers_that_checkpoint_forward_are_left_alone():
    from tests.test_sequence_parallel import tiny_model

    model = tiny_model("qwen3")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    forwards = [layer.forward for layer in model.model.layers]
    assert checkpoint_inside_hooks(model) == 0
    assert [layer.forward for layer in model.model.layers] == forwards
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


def test_checkpoint_inside_hooks_names_a_bad_argument():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        checkpoint_inside_hooks("model")
