"""One group's step over micro-batches: the prompt's forward and backward once, its responses in micro-batches.

    losses = prefix_once_step(model, prompt, micro_batches, loss_fn)   # then optimizer.step()

Assumes a Hugging Face causal LM whose layers are all full attention with a key/value cache (``DynamicCache``:
Llama, Qwen2/3 and their MoE kin), in train mode, and a group split into micro-batches of responses of one prompt
``[P]``. Each micro-batch is a dict with ``responses`` and ``response_mask`` ``[B, R]`` (right-padded) plus what
``loss_fn(logits, batch)`` reads; ``logits [B, R, V]`` are the ones that predict each response token, and the
function returns that micro-batch's term of the step's loss (weighted as the caller's gradient accumulation would).

Guarantees: the parameter gradients accumulated are those of ``sum(loss_fn(...))`` over the unsplit rows
``[prompt | response]`` (docs/design.md, semantics 1, 4 and 18). How: the prompt's first ``P - 1`` tokens run
once, their per-layer keys and values kept; each micro-batch runs ``[prompt[-1] | responses]`` against them as
leaves that take gradients (the last prompt token, a token a row, predicts the first response token), its
backward accumulating into the parameters and the leaves; then the prefix's backward runs once from the summed
key/value gradients.
Memory: the prefix's activations plus one micro-batch's. Anything else (another cache kind, a window) raises.
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable, NamedTuple, Sequence

import torch

log = logging.getLogger("dualkv_compile")

__all__ = ["PrefixOnceStats", "prefix_once_step"]


class PrefixOnceStats(NamedTuple):
    """What a step computed: prefix tokens once, the response tokens (padding included) of each micro-batch."""

    prefix_tokens: int
    micro_batches: int
    response_tokens: int


LAST: list = []  # the last step's PrefixOnceStats (last_stats())


def last_stats():
    """The last ``prefix_once_step``'s ``PrefixOnceStats``, None before any."""
    return LAST[-1] if LAST else None


def _check(model, prompt: torch.Tensor, micro_batches: Sequence[dict]) -> None:
    config = getattr(model, "config", None)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if config is None or kinds != {"full_attention"} or getattr(config, "sliding_window", None) and getattr(
            config, "use_sliding_window", True):
        raise ValueError(f"prefix_once_step: model: expected a causal LM of full-attention layers only, got layer "
                         f"types {sorted(kinds)} (sliding window {getattr(config, 'sliding_window', None)})")
    if prompt.dim() != 1 or prompt.numel() < 1 or prompt.dtype != torch.long:
        raise ValueError(f"prefix_once_step: prompt: expected a 1-D int64 tensor of at least one token, got "
                         f"{tuple(prompt.shape)} {prompt.dtype}")
    if not micro_batches:
        raise ValueError("prefix_once_step: micro_batches: expected at least one micro-batch, got none")
    for i, mb in enumerate(micro_batches):
        r, m = mb.get("responses"), mb.get("response_mask")
        if not isinstance(r, torch.Tensor) or r.dim() != 2 or not isinstance(m, torch.Tensor) or m.shape != r.shape:
            raise ValueError(f"prefix_once_step: micro_batches[{i}]: expected 'responses' and 'response_mask' "
                             f"[B, R] of one shape, got {getattr(r, 'shape', r)} and {getattr(m, 'shape', m)}")


def _cache_keyword(model) -> str:
    """``cache`` (newer transformers) or ``past_key_values``: the name the model's forward takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def prefix_once_step(model, prompt: torch.Tensor, micro_batches: Sequence[dict],
                     loss_fn: Callable[[torch.Tensor, dict], torch.Tensor]) -> list[torch.Tensor]:
    """Forward and backward of one group's step (module docstring); returns each micro-batch's loss, detached.
    Gradients accumulate into the parameters' ``.grad`` as ``loss.backward()`` would."""
    from transformers import DynamicCache

    _check(model, prompt, micro_batches)
    keyword = _cache_keyword(model)
    device, P = prompt.device, prompt.numel()
    prefix_kv = []
    if P > 1:
        out = model(input_ids=prompt[None, :-1], use_cache=True, logits_to_keep=1)
        cache = getattr(out, "past_key_values", None)
        cache = getattr(out, "cache", None) if cache is None else cache
        prefix_kv = [(layer.keys, layer.values) for layer in cache.layers]
    leaves = [tuple(t.detach().requires_grad_(t.requires_grad) for t in kv) for kv in prefix_kv]
    losses, response_tokens = [], 0
    for mb in micro_batches:
        responses, mask = mb["responses"].to(device), mb["response_mask"].to(device)
        B, R = responses.shape
        ids = torch.cat([prompt[-1:].expand(B, 1), responses], dim=1)
        attention = torch.cat([torch.ones(B, P, dtype=mask.dtype, device=device), mask], dim=1)
        position_ids = torch.arange(P - 1, P + R, device=device).expand(B, R + 1)
        kwargs = {}
        if leaves:  # the prefix's keys and values, one copy viewed by every row (their gradients sum)
            kwargs[keyword] = DynamicCache(ddp_cache_data=[(k.expand(B, *k.shape[1:]), v.expand(B, *v.shape[1:]))
                                                           for k, v in leaves])
        out = model(input_ids=ids, attention_mask=attention, position_ids=position_ids, use_cache=bool(leaves),
                    **kwargs)
        loss = loss_fn(out.logits[:, :R], mb)
        loss.backward()
        losses.append(loss.detach())
        response_tokens += B * R
    grads = [(t, leaf.grad) for kv, lv in zip(prefix_kv, leaves) for t, leaf in zip(kv, lv)
             if leaf.grad is not None]
    if grads:  # the prefix's backward, once, from what every micro-batch's rows read of it
        torch.autograd.backward([t for t, _ in grads], [g for _, g in grads])
    LAST[:] = [PrefixOnceStats(P - 1, len(micro_batches), response_tokens)]
    log.info("dualkv: prefix_once_step: %d prefix tokens once, %d micro-batches, %d response tokens", P - 1,
             len(micro_batches), response_tokens)
    return losses
