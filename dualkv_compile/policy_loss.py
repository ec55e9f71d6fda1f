"""``@policy_loss``: compile a policy-loss function with the dualkv backend.

The decorated function takes the model and the batch and returns the loss,
as GRPO/DAPO trainers write it: a forward over ``[prompt | response]`` rows,
``log_softmax`` (often after a temperature), the gather of the next tokens,
ratios against old log-probs, clipping, masking and aggregation. With the
loss in the same graph as the model, the rewrite keeps every per-token op on
the packed stream, turns the shift-by-one and the gather of next-token ids
into one gather that reads, for each response's first token, the logits of
its group's last shared token, and unpacks only per-token scalars: no
``[B, S, V]`` tensor is built. Where nothing else reads the logits or the
log-probs but an entropy term (``-(logp.exp() * logp).sum(-1)`` or veRL's
``entropy_from_logits``; see ``rewrite.fuse_linear_log_prob``), the lm_head,
log_softmax, that gather and the entropy become one chunked op
(``chunked_log_probs``, on by default): no ``[T, V]`` tensor is kept either,
at the price of recomputing the logits in the backward.

Token inputs are found by name: the tensors the function receives as (or
under the key) ``input_ids``, ``attention_mask``, ``position_ids``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import torch

from .backend import dualkv_backend
from .config import DualKVConfig

__all__ = ["policy_loss", "check_token_inputs"]

_TOKEN_NAMES = ("input_ids", "attention_mask", "position_ids")


def policy_loss(
    fn: Optional[Callable] = None,
    *,
    group_size: Optional[int] = None,
    min_rho: Optional[float] = None,
    fullgraph: bool = False,
    dynamic: Optional[bool] = None,
    **options,
):
    """Decorator: ``@policy_loss`` or ``@policy_loss(group_size=8, min_rho=1.5, fullgraph=True)``.

    ``options`` are further ``DualKVConfig`` fields (``inner``, ``verify``,
    ``attention_backend``, ``min_shared``, ``chunked_log_probs``,
    ``log_prob_chunk_bytes``, ``sequence_parallel``: a ProcessGroup or 1-D
    DeviceMesh to split the packed stream over, Ulysses). The result is a
    ``torch.compile``-d function with the same signature.
    """
    if group_size is not None:
        options["group_size"] = group_size
    if min_rho is not None:
        options["min_rho"] = min_rho
    DualKVConfig.from_options(options)  # bad options fail here, naming the option

    def decorate(f: Callable) -> Callable:
        if not callable(f):
            raise ValueError(f"policy_loss decorates a function, got {type(f).__name__}")
        backend = functools.partial(dualkv_backend, options=dict(options))
        compiled = torch.compile(f, backend=backend, fullgraph=fullgraph, dynamic=dynamic)
        try:
            signature = inspect.signature(f)
        except (TypeError, ValueError):  # a builtin or C callable: positional arguments cannot be named
            signature = None

        @functools.wraps(f)
        def run(*args, **kwargs):
            check_token_inputs(_named_token_inputs(signature, args, kwargs))
            return compiled(*args, **kwargs)

        return run

    return decorate(fn) if fn is not None else decorate


def _named_token_inputs(signature, args, kwargs) -> dict:
    """The tensors the call passes as (or under the key) ``input_ids``, ``attention_mask``, ``position_ids``."""
    found = {}
    try:
        values = list(signature.bind_partial(*args, **kwargs).arguments.items())
    except (AttributeError, TypeError):  # no signature, or a call that does not bind (torch.compile raises below)
        values = [(None, a) for a in args] + list(kwargs.items())
    for name, value in values:
        if isinstance(value, tuple) and name not in _TOKEN_NAMES:  # a *args parameter: its elements, unnamed
            values.extend((None, v) for v in value)
        elif name in _TOKEN_NAMES and isinstance(value, torch.Tensor):
            found.setdefault(name, value)
        elif isinstance(value, dict):
            for key in _TOKEN_NAMES:
                if isinstance(value.get(key), torch.Tensor):
                    found.setdefault(key, value[key])
    return found


def check_token_inputs(inputs: dict) -> None:
    """``ValueError`` naming the argument when the token inputs cannot be a ``[B, S]`` batch: ``input_ids`` not 2-D,
    an ``attention_mask`` that is neither ``[B, S]`` nor a 4-D ``[B, 1, S, S]`` mask, ``position_ids`` not
    ``[B, S]`` or ``[1, S]``. Checked before tracing, where a bad shape fails deep inside Dynamo or the model."""
    ids = inputs.get("input_ids")
    if ids is not None and ids.dim() != 2:
        raise ValueError(f"input_ids must be a 2-D tensor [B, S] of token ids, got shape {list(ids.shape)}")
    if ids is None:
        return
    B, S = ids.shape
    mask = inputs.get("attention_mask")
    if mask is not None:
        ok = tuple(mask.shape) == (B, S) or (mask.dim() == 4 and mask.shape[0] == B and tuple(mask.shape[-2:]) == (S, S))
        if not ok:
            raise ValueError(
                f"attention_mask must have the shape of input_ids [B, S] = {[B, S]} (or be a 4-D [B, 1, S, S] mask), "
                f"got {list(mask.shape)}"
            )
    pos = inputs.get("position_ids")
    if pos is not None and not (pos.dim() == 2 and pos.shape[1] == S and pos.shape[0] in (1, B)):
        raise ValueError(f"position_ids must have shape [B, S] = {[B, S]} or [1, S], got {list(pos.shape)}")
