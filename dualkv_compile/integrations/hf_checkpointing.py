"""Hugging Face activation checkpointing moved inside each layer's module hooks, so Dynamo compiles the layers.

Assumes: a Hugging Face model whose decoder layers are ``GradientCheckpointingLayer``s, gradient checkpointing
switched on the Hugging Face way (``model.gradient_checkpointing_enable(...)``), and FSDP2's ``fully_shard`` (or
any module hook Dynamo cannot trace) on each layer. Up to transformers 5.22 such a layer checkpoints its whole
``__call__``, the hooks included; Dynamo cannot trace the hooks inside the region, runs ``torch.utils.checkpoint``
eagerly, and every layer then runs uncompiled on the caller's rows: exact, but nothing is packed. Newer
transformers checkpoint the layer's ``forward`` inside the hooks, which Dynamo traces.

Guarantees: ``checkpoint_inside_hooks(model)`` gives each such layer that newer arrangement: its class becomes a
subclass of its own (made once per class) whose ``forward`` is the layer's checkpointing function (the one
``gradient_checkpointing_enable`` installed, with its ``use_reentrant`` and other arguments) around the class's
``forward``, and whose ``__call__`` is ``nn.Module``'s again, so the hooks run outside the checkpoint. Same
computation, same recompute in the backward, the same cache arguments dropped as transformers drops them; the
layer's ``gradient_checkpointing`` flag keeps its meaning. A layer whose class does not checkpoint ``__call__``,
or whose checkpointing is off, is left alone; a second call changes nothing. Reentrant checkpointing is still not
traced by Dynamo: pass ``{"use_reentrant": False}``. Why a subclass: docs/design.md, "Trainer integrations".
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


_SUBCLASSES: dict[type, type] = {}


def _checkpoint_inside(cls: type) -> type:
    """``cls`` with ``forward`` checkpointed and ``nn.Module.__call__`` back (one subclass per class)."""
    sub = _SUBCLASSES.get(cls)
    if sub is not None:
        return sub
    inner = cls.forward

    @functools.wraps(inner)
    def forward(self, *args, **kwargs):
        if not (self.gradient_checkpointing and self.training and torch.is_grad_enabled()):
            return inner(self, *args, **kwargs)
        if not getattr(self, "_can_checkpoint_with_cache", False):
            for key, off in _CACHE_KWARGS:
                if kwargs.get(key):
                    kwargs[key] = off
        return self._gradient_checkpointing_func(functools.partial(inner, self, **kwargs), *args)

    sub = type(cls.__name__, (cls,), {"forward": forward, "__call__": torch.nn.Module.__call__, "__module__": cls.__module__})
    _SUBCLASSES[cls] = sub
    return sub


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
        layer.__class__ = _checkpoint_inside(type(layer))
        moved += 1
    if moved:
        log.info("dualkv: activation checkpointing of %d layers moved inside their module hooks (so Dynamo compiles them)", moved)
    return moved
