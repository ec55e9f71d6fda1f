"""dualkv in TRL's ``GRPOTrainer``: one line after the trainer is built (or one before).

    trainer = GRPOTrainer(model=..., args=GRPOConfig(...), peft_config=..., ...)
    dualkv_compile.integrations.trl.enable(trainer)          # options: as torch.compile(..., backend="dualkv")
    trainer.train()

or ``dualkv_compile.integrations.trl.compile_scoring_forward(model)`` before the trainer is built (TRL then
patches and wraps the model as usual). ``GRPOConfig(torch_compile_backend="dualkv")`` does not work: accelerate
accepts only its own backend names, and it would compile generation too.

Assumes TRL scores completions by calling the causal LM, which runs its backbone (``base_model``) through
``Module.__call__``; generation calls the same backbone with a KV cache or inside ``generate``; nothing replaces
the backbone or its ``forward`` after ``enable``. Guarantees: the policy's (and the reference model's) backbone
runs through the dualkv backend on every scoring call, each prompt of the batch once in whatever row order, its
hidden states back in TRL's layout for TRL's fused lm_head and loss; generation runs the original forward; a
batch with nothing to share, or a refused graph, runs the original program (``explain()`` says which). LoRA
adapters are traced inside the backbone; ``lora_dropout`` > 0 in training mode refuses that graph. Never wrapped
twice: ``compile_scoring_forward`` on a routed backbone raises, ``enable`` twice on one trainer raises, and
``enable`` on a trainer whose models were routed before it was built keeps them when the options agree and
raises when they differ. Why the backbone, not the causal LM's ``forward``: docs/design.md, "Trainer integrations".
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch

from ..backend import dualkv_backend
from ..config import DualKVConfig
from .hf_checkpointing import checkpoint_inside_hooks
from .hf_vision import images_once, is_vision_language

log = logging.getLogger("dualkv_compile")

__all__ = ["enable", "compile_scoring_forward"]

_MARK = "_dualkv_scoring_forward"  # on the wrapper: True
_OPTIONS = "_dualkv_options"  # on the wrapper: the options it compiled with
_TRAINER_MARK = "_dualkv_enabled"


def _scored_module(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM TRL calls and patches: a PEFT model's base model, else the model itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The module TRL's fused head calls (``self.base_model``); the model itself when it has none."""
    body = getattr(_scored_module(model), "base_model", None)
    return body if isinstance(body, torch.nn.Module) else _scored_module(model)


def _routed_options(fn: Any) -> Optional[dict]:
    """The options of the dualkv wrapper in ``fn``'s chain of ``__wrapped__`` (another library may have wrapped
    ours since), or None."""
    for _ in range(32):  # a bound on the chain: a cycle of __wrapped__ must not hang us
        if fn is None:
            return None
        if getattr(fn, _MARK, False):
            return getattr(fn, _OPTIONS, {})
        fn = getattr(fn, "__wrapped__", None)
    return None


def drop_repeated_input_grad_hooks(model: torch.nn.Module) -> int:
    """Remove the copies of transformers' ``make_inputs_require_grads`` hook beyond the first on each module.

    TRL switches gradient checkpointing off around generation and on again after it, twice a step, and each
    switch-on (``enable_input_require_grads``) adds one more such hook to the input embeddings without removing
    the last. The copies change nothing (each sets ``requires_grad`` on the same output), but Dynamo guards on
    how many hooks a module has: the compiled forward was recompiled at every step until the recompile limit
    sent it to eager, unpacked (docs/benchmarks.md, "Behind the code"). Returns how many went."""
    dropped = 0
    for module in model.modules():
        hooks = module._forward_hooks
        if len(hooks) < 2:
            continue
        seen = False
        for key, hook in list(hooks.items()):
            if getattr(hook, "__name__", None) != "make_inputs_require_grads" or getattr(hook, "__closure__", None):
                continue
            if seen:  # a copy: the same function, nothing captured
                del hooks[key]
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)
                dropped += 1
            seen = True
    return dropped


def compile_scoring_forward(model: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """Route ``model``'s scoring calls through ``torch.compile(..., backend="dualkv")``.

    The backbone's ``forward`` (see the module docstring: ``base_model`` of the causal LM, a PEFT model
    unwrapped) is replaced by a wrapper with the same signature, and the causal LM's ``generate`` by one
    that marks its calls: a backbone call made inside ``generate``, or with a KV cache (``past_key_values``),
    goes to the original forward; every other call to the compiled one. Call it before or after TRL patches
    the model. Returns ``model``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    body = _backbone(model)
    if _routed_options(body.forward) is not None:
        raise ValueError(f"model: dualkv is already enabled on this {type(model).__name__}")
    DualKVConfig.from_options(options)  # bad options fail here, naming the option
    original = body.forward
    compiled = torch.compile(original, backend=functools.partial(dualkv_backend, options=dict(options)))
    generating = [0]  # depth of generate() calls in progress

    # functools.wraps keeps the signature (generate() validates its model kwargs against the causal LM's).
    @functools.wraps(original)
    def forward(*args, **kwargs):
        if generating[0] or kwargs.get("past_key_values") is not None:
            return original(*args, **kwargs)
        # TRL switches checkpointing on in its constructor, which may come after this call: moved at each call
        # (a no-op once moved, and on transformers that checkpoint forward).
        checkpoint_inside_hooks(model)
        drop_repeated_input_grad_hooks(model)
        return compiled(*args, **kwargs)

    setattr(forward, _MARK, True)
    setattr(forward, _OPTIONS, dict(options))
    body.forward = forward
    lm = _scored_module(model)
    original_generate = getattr(lm, "generate", None)
    if callable(original_generate):
        # A PEFT model's generate() reaches this one (its base model's); TRL generates through either.
        @functools.wraps(original_generate)
        def generate(*args, **kwargs):
            generating[0] += 1
            try:
                return original_generate(*args, **kwargs)
            finally:
                generating[0] -= 1

        lm.generate = generate
    if is_vision_language(body):
        # Each distinct image of a scoring call once through the vision tower, compiled as dualkv's inner compiler.
        images_once(body, backend=DualKVConfig.from_options(options).inner)
    log.debug("dualkv: routed %s's backbone (%s) through the dualkv backend", type(model).__name__, type(body).__name__)
    return model


def enable(trainer: Any, **options: Any) -> Any:
    """Turn dualkv on for a TRL ``GRPOTrainer`` (or a trainer built like it): the policy's and the
    reference model's scoring forward. ``options`` are ``DualKVConfig`` fields (``inner``,
    ``min_rho``, ``attention_backend``, ...). Returns ``trainer``."""
    model = getattr(trainer, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"trainer must be a TRL GRPOTrainer (an object with a torch.nn.Module .model), got {type(trainer).__name__}"
        )
    if getattr(trainer, _TRAINER_MARK, False):
        raise ValueError(f"trainer: dualkv is already enabled on this {type(trainer).__name__}")
    DualKVConfig.from_options(options)
    ref = getattr(trainer, "ref_model", None)
    for name, m in (("model", model), ("ref_model", ref)):
        if not isinstance(m, torch.nn.Module):
            continue
        prior = _routed_options(_backbone(m).forward)
        if prior is None:
            compile_scoring_forward(m, **options)
        elif prior != options:
            raise ValueError(
                f"trainer.{name}: dualkv is already enabled on it (compile_scoring_forward) with options {prior}, "
                f"not {options}: pass the same options, or leave enable() out"
            )
        else:
            # compile_scoring_forward before the trainer was built: its wrapper is still the one called.
            log.info("dualkv: trainer.%s was already routed through dualkv with these options; left as it is", name)
    setattr(trainer, _TRAINER_MARK, True)
    log.info("dualkv: enabled on %s's scoring forward%s", type(trainer).__name__, " and its reference model's" if ref is not None else "")
    return trainer
