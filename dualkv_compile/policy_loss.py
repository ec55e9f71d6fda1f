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
log-probs (no entropy term), the lm_head, log_softmax and that gather become
one chunked op (``chunked_log_probs``, on by default): no ``[T, V]`` tensor
is kept either, at the price of recomputing the logits in the backward.

Token inputs are found by name: the tensors the function receives as (or
under the key) ``input_ids``, ``attention_mask``, ``position_ids``.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from .backend import dualkv_backend
from .config import DualKVConfig

__all__ = ["policy_loss"]


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
        return functools.wraps(f)(compiled)

    return decorate(fn) if fn is not None else decorate
