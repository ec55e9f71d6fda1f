"""dualkv in TRL's ``GRPOTrainer``: one line after the trainer is built (or one before).

    trainer = GRPOTrainer(model=..., args=GRPOConfig(...), peft_config=..., ...)
    dualkv_compile.integrations.trl.enable(trainer)          # options: as torch.compile(..., backend="dualkv")
    trainer.train()

or, on the model before the trainer is built (TRL then patches and wraps it as usual):

    dualkv_compile.integrations.trl.compile_scoring_forward(model)
    trainer = GRPOTrainer(model=model, ...)

Why not ``GRPOConfig(torch_compile=True, torch_compile_backend="dualkv")``:
accelerate checks the backend's name against its own list ("'DUALKV' is not
a valid DynamoBackend"), and it would compile generation too. These compile
only the scoring forward.

What is compiled, and why there
    The backbone: the causal LM's ``base_model`` (``model.model`` of a
    ``Qwen3ForCausalLM``; of a PEFT model, its base model's). TRL 1.16 patches
    the causal LM's ``forward`` in ``GRPOTrainer.__init__``
    (``trl.trainer.utils.add_fused_lm_head``: the instance's ``forward`` becomes
    a method that keeps the previous one for unfused calls and, for
    ``fused_lm_head=True``, calls ``self.base_model`` itself, looked up on each
    call). A wrapper on the causal LM's ``forward`` is therefore bypassed when
    it was installed before TRL's patch, and wrapped a second time when TRL
    (or anyone) patches again; the backbone's ``forward`` is never replaced by
    TRL, and every scoring path reaches it: TRL's fused head, the causal LM's
    own ``forward`` (TRL before 1.16: ``logits_to_keep``), PEFT's wrappers.
    So the order of ``enable`` and TRL's patch does not matter, and nothing
    is wrapped twice.

What it assumes
    TRL scores completions by calling the causal LM (``model(input_ids,
    attention_mask, labels=..., fused_lm_head=True)`` in TRL >= 1.16, with
    ``logits_to_keep=...`` before), which runs its backbone through
    ``Module.__call__``; generation calls the same backbone with a KV cache
    (``past_key_values``) or inside ``generate``. Nothing replaces the
    backbone module, or its ``forward``, after ``enable``. LoRA adapters
    (TRL's ``peft_config``) live inside the backbone's linear layers, so they
    are traced with it; with PEFT's frozen embedding, the hook TRL adds for
    gradient checkpointing (``enable_input_require_grads``) breaks the graph
    after the embedding, and the graph after the break finds the layout from
    its hidden states and mask (``layout.carried``). ``lora_dropout`` > 0 in training mode draws a
    different mask for each copy of a shared prompt: the backend refuses
    that graph (it runs unpacked, ``explain()`` says so); PEFT's default is 0.

What it guarantees
    The policy's (and the reference model's) backbone runs through the dualkv
    backend on every scoring call: on the packed stream, each prompt of the
    batch once, in whatever order the trainer's rows come; its hidden states
    leave it in the trainer's layout, so TRL's fused lm_head and loss run
    unchanged on them. Generation runs the original forward, uncompiled. A
    batch with nothing to share, or a graph the backend refuses, runs the
    original program (``dualkv_compile.explain`` / ``reports()`` say which).
    Never wrapped twice: ``compile_scoring_forward`` on a model whose
    backbone is already routed raises; ``enable`` twice on one trainer
    raises; ``enable`` on a trainer whose models were routed before it was
    built leaves them as they are when the options agree, and raises when
    they differ.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch

from ..backend import dualkv_backend
from ..config import DualKVConfig
from .hf_checkpointing import checkpoint_inside_hooks

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
    how many hooks a module has: the compiled forward was recompiled at every step (about 18 s a step for a
    Qwen3-0.6B shape on an H100) until the recompile limit sent it to eager, unpacked. Returns how many went."""
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
