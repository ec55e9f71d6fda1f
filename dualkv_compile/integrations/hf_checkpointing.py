"""Hugging Face activation checkpointing moved inside each layer's module hooks, so Dynamo compiles the layers.

Assumes: a Hugging Face model whose decoder layers are ``GradientCheckpointingLayer``s, with gradient
checkpointing switched on the Hugging Face way (``model.gradient_checkpointing_enable(...)``), and FSDP2's
``fully_shard`` (or any module hook Dynamo cannot trace) on each layer.

Why: up to transformers 5.22 such a layer checkpoints its whole ``__call__``: ``torch.utils.checkpoint`` around
the module call, FSDP2's hooks included. Dynamo cannot trace those hooks inside the checkpointed region, so it
runs ``torch.utils.checkpoint`` eagerly, and that function disables Dynamo for everything it calls: every
layer then runs uncompiled on the caller's rows. Exact, but nothing is packed: each row's copy of a shared
prompt goes through every layer (seen on an H100 with transformers 5.17, torch 2.11: a Qwen3-1.7B-shaped step
1.04x "faster" with dualkv, the layers never compiled). Newer transformers checkpoint the layer's ``forward``
instead, inside the hooks, which Dynamo traces (non-reentrant checkpointing becomes a region of the layer's
graph, recomputed in the backward).

Guarantees: ``checkpoint_inside_hooks(model)`` gives each such layer that newer arrangement. The layer's
``forward`` becomes its checkpointing function (the one ``gradient_checkpointing_enable`` installed, with its
``use_reentrant`` and other arguments) around its own ``forward``, and the layer's ``gradient_checkpointing``
flag goes off so its ``__call__`` no longer wraps the hooks. Same computation, same recompute in the backward
(in training with gradients on; otherwise the plain ``forward``), the same cache arguments dropped as
transformers drops them. A layer whose class does not checkpoint ``__call__`` (newer transformers), or whose
checkpointing is off, is left alone; calling it twice changes nothing more. Reentrant checkpointing
(``use_reentrant=True``) is still not traced by Dynamo: pass ``{"use_reentrant": False}``.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("dualkv_compile")

__all__ = ["checkpoint_inside_hooks"]

# Keyword arguments a checkpointed layer must not pass on (the recompute would read or write the cache again).
_CACHE_KWARGS = (("use_cache", False), ("past_key_values", None), ("layer_past", None))


def _checkpoints_its_call(layer: torch.nn.Module, base) -> bool:
    """A Hugging Face checkpointing layer whose class (FSDP2's ``FSDP<Layer>`` subclass included) checkpoints
    ``__call__``: it overrides ``nn.Module.__call__``."""
    return (isinstance(layer, base) and type(layer).__call__ is not torch.nn.Module.__call__
            and callable(getattr(layer, "_gradient_checkpointing_func", None)))


def _checkpointed(layer: torch.nn.Module, forward, checkpoint):
    @functools.wraps(forward)
    def checkpointed_forward(*args, **kwargs):
        if not (layer.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        if not getattr(layer, "_can_checkpoint_with_cache", False):
            for key, off in _CACHE_KWARGS:
                if kwargs.get(key):
                    kwargs[key] = off
        return checkpoint(functools.partial(forward, **kwargs), *args)

    checkpointed_forward._dualkv_checkpointed = True
    return checkpointed_forward


def checkpoint_inside_hooks(model: torch.nn.Module) -> int:
    """Move each checkpointed Hugging Face layer's checkpoint from around its ``__call__`` to around its ``forward``
    (module docstring); returns how many layers moved. ``TypeError`` if ``model`` is not an ``nn.Module``."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"checkpoint_inside_hooks: model must be a torch.nn.Module, got {type(model).__name__}")
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # no transformers, or one without the class: nothing of its kind to move
        return 0
    moved = 0
    for layer in model.modules():
        if not getattr(layer, "gradient_checkpointing", False) or not _checkpoints_its_call(layer, GradientCheckpointingLayer):
            continue
        if getattr(layer.forward, "_dualkv_checkpointed", False):
            continue
        layer.forward = _checkpointed(layer, layer.forward, layer._gradient_checkpointing_func)
        layer.gradient_checkpointing = False
        moved += 1
    if moved:
        log.info("dualkv: activation checkpointing of %d layers moved inside their module hooks (so Dynamo compiles them)", moved)
    return moved
