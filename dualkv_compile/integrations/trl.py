"""dualkv in TRL's ``GRPOTrainer``: one line after the trainer is built.

    trainer = GRPOTrainer(model=..., args=GRPOConfig(...), ...)
    dualkv_compile.integrations.trl.enable(trainer)          # options: as torch.compile(..., backend="dualkv")
    trainer.train()

Why not ``GRPOConfig(torch_compile=True, torch_compile_backend="dualkv")``:
accelerate checks the backend's name against its own list ("'DUALKV' is not
a valid DynamoBackend"), and it would compile generation too. ``enable``
compiles only the scoring forward.

What it assumes
    TRL scores completions with ``model(input_ids, attention_mask, labels=...,
    fused_lm_head=True)`` (TRL >= 1.16 patches ``forward`` with
    ``add_fused_lm_head``), or with ``model(input_ids, attention_mask,
    logits_to_keep=...)`` in earlier releases; generation calls the same
    ``forward`` with a KV cache (``past_key_values``) or ``use_cache=True``.

What it guarantees
    The policy's (and the reference model's) scoring forward runs through the
    dualkv backend: the backbone on the packed stream, each prompt of the
    batch once, in whatever order the trainer's rows come; the hidden states
    leave it in the trainer's layout, so TRL's fused lm_head and loss run
    unchanged on them. Generation runs the original forward, uncompiled. A
    batch with nothing to share, or a graph the backend refuses, runs the
    original program (``dualkv_compile.explain`` / ``reports()`` say which).
    Calling ``enable`` twice on one trainer raises.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from ..backend import dualkv_backend
from ..config import DualKVConfig

log = logging.getLogger("dualkv_compile")

__all__ = ["enable", "compile_scoring_forward"]

_MARK = "_dualkv_scoring_forward"


def compile_scoring_forward(model: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """Route ``model``'s scoring calls through ``torch.compile(..., backend="dualkv")``.

    ``model.forward`` (the instance's, as TRL patched it, or the class's) is
    replaced by a wrapper with the same signature, and ``model.generate`` by
    one that marks its calls: a call made inside ``generate``, or with a KV
    cache (``past_key_values``), goes to the original forward; every other
    call to the compiled one. Returns ``model``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if getattr(model.forward, _MARK, False):
        raise ValueError(f"model: dualkv is already enabled on this {type(model).__name__}")
    DualKVConfig.from_options(options)  # bad options fail here, naming the option
    original = model.forward
    compiled = torch.compile(original, backend=functools.partial(dualkv_backend, options=dict(options)))
    generating = [0]  # depth of generate() calls in progress

    # functools.wraps keeps the signature: generate() validates its model kwargs against it.
    @functools.wraps(original)
    def forward(*args, **kwargs):
        if generating[0] or kwargs.get("past_key_values") is not None:
            return original(*args, **kwargs)
        return compiled(*args, **kwargs)

    setattr(forward, _MARK, True)
    model.forward = forward
    original_generate = getattr(model, "generate", None)
    if callable(original_generate):

        @functools.wraps(original_generate)
        def generate(*args, **kwargs):
            generating[0] += 1
            try:
                return original_generate(*args, **kwargs)
            finally:
                generating[0] -= 1

        model.generate = generate
    return model


def _scored_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose ``forward`` TRL calls and patches: a PEFT model's base model."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def enable(trainer: Any, **options: Any) -> Any:
    """Turn dualkv on for a TRL ``GRPOTrainer`` (or a trainer built like it): the policy's and the
    reference model's scoring forward. ``options`` are ``DualKVConfig`` fields (``inner``,
    ``min_rho``, ``attention_backend``, ...). Returns ``trainer``."""
    model = getattr(trainer, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"trainer must be a TRL GRPOTrainer (an object with a torch.nn.Module .model), got {type(trainer).__name__}"
        )
    compile_scoring_forward(_scored_module(model), **options)
    ref = getattr(trainer, "ref_model", None)
    if isinstance(ref, torch.nn.Module):
        compile_scoring_forward(_scored_module(ref), **options)
    log.info("dualkv: enabled on %s's scoring forward%s", type(trainer).__name__, " and its reference model's" if ref is not None else "")
    return trainer
