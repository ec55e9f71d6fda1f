"""``dualkv::linear_log_prob`` and ``dualkv::linear_log_prob_bwd``: the chunked lm_head -> log-softmax -> gather op;
``dualkv::linear_log_prob_entropy`` and ``_entropy_bwd``: the same with every row's entropy.

The math is ``kernels/linear_log_prob.py`` and ``kernels/linear_log_prob_entropy.py``
(their docstrings state the formulas, memory and numerics). Here: the
``torch.library`` custom ops with fake implementations (they trace under
``torch.compile`` with dynamic shapes and stay opaque to Inductor), each
backward registered as its forward's autograd formula, and
``linear_log_prob`` / ``linear_log_prob_entropy``, the differentiable entry
points. The entropy op is a separate op, not a flag on the plain one: the
plain op keeps its schema, outputs and code path (and the passes that read
it, e.g. sequence parallelism, see only what they were written for).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels import linear_log_prob_entropy as _entropy
from ..kernels.linear_log_prob import DEFAULT_CHUNK_BYTES, backward, check_inputs, dtypes, forward, no_autocast

__all__ = [
    "linear_log_prob", "linear_log_prob_fwd", "linear_log_prob_bwd",
    "linear_log_prob_entropy", "linear_log_prob_entropy_fwd", "linear_log_prob_entropy_bwd",
]


@torch.library.custom_op("dualkv::linear_log_prob", mutates_args=())
def linear_log_prob_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    index: torch.Tensor,
    scale: float,
    divide: bool,
    scale_first: bool,
    upcast: bool,
    chunk_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs(hidden, weight, rows, index, scale, chunk_bytes)
    with no_autocast(hidden):
        return forward(hidden, weight, rows, index, scale, divide, scale_first, upcast, chunk_bytes)


@linear_log_prob_fwd.register_fake
def _(hidden, weight, rows, index, scale, divide, scale_first, upcast, chunk_bytes):
    check_inputs(hidden, weight, rows, index, scale, chunk_bytes)
    out_dtype, cd = dtypes(hidden.dtype, upcast)
    return index.new_empty(index.shape, dtype=out_dtype), index.new_empty(rows.shape, dtype=cd)


@torch.library.custom_op("dualkv::linear_log_prob_bwd", mutates_args=())
def linear_log_prob_bwd(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    index: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    divide: bool,
    scale_first: bool,
    upcast: bool,
    chunk_bytes: int,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    with no_autocast(hidden):
        return backward(grad, hidden, weight, rows, index, lse, scale, divide, scale_first, upcast, chunk_bytes, need_hidden, need_weight)


@linear_log_prob_bwd.register_fake
def _(grad, hidden, weight, rows, index, lse, scale, divide, scale_first, upcast, chunk_bytes, need_hidden, need_weight):
    return (
        torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden else hidden.new_empty(0),
        torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else weight.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    hidden, weight, rows, index, scale, divide, scale_first, upcast, chunk_bytes = inputs
    _, lse = output
    ctx.save_for_backward(hidden, weight, rows, index, lse)
    ctx.post = (scale, divide, scale_first, upcast, chunk_bytes)


def _autograd_backward(ctx, grad, dlse):
    hidden, weight, rows, index, lse = ctx.saved_tensors
    # lse is an internal output (saved for the backward); its gradient is never needed.
    need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    d_hidden, d_weight = linear_log_prob_bwd(grad, hidden, weight, rows, index, lse, *ctx.post, need_hidden, need_weight)
    return (d_hidden if need_hidden else None), (d_weight if need_weight else None), None, None, None, None, None, None, None


linear_log_prob_fwd.register_autograd(_autograd_backward, setup_context=_setup_context)


def linear_log_prob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    index: torch.Tensor,
    *,
    scale: float = 1.0,
    divide: bool = False,
    scale_first: bool = True,
    upcast: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> torch.Tensor:
    """``log_softmax(post(linear(hidden, weight)))[rows[t], index[t, k]]`` as ``[T, K]``, chunked (module docstring).

    Differentiable in ``hidden`` and ``weight``. ``ValueError`` names a bad argument.
    """
    check_inputs(hidden, weight, rows, index, scale, chunk_bytes)
    out, _ = linear_log_prob_fwd(hidden, weight, rows, index, float(scale), bool(divide), bool(scale_first), bool(upcast), chunk_bytes)
    return out




@torch.library.custom_op("dualkv::linear_log_prob_entropy", mutates_args=())
def linear_log_prob_entropy_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    index: torch.Tensor,
    scale: float,
    divide: bool,
    scale_first: bool,
    upcast: bool,
    chunk_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_inputs(hidden, weight, rows, index, scale, chunk_bytes)
    with no_autocast(hidden):
        return _entropy.forward(hidden, weight, rows, index, scale, divide, scale_first, upcast, chunk_bytes)


@linear_log_prob_entropy_fwd.register_fake
def _(hidden, weight, rows, index, scale, divide, scale_first, upcast, chunk_bytes):
    check_inputs(hidden, weight, rows, index, scale, chunk_bytes)
    out_dtype, cd = dtypes(hidden.dtype, upcast)
    N = hidden.shape[0]
    return index.new_empty(index.shape, dtype=out_dtype), hidden.new_empty(N, dtype=cd), hidden.new_empty(N, dtype=cd)


@torch.library.custom_op("dualkv::linear_log_prob_entropy_bwd", mutates_args=())
def linear_log_prob_entropy_bwd(
    grad: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    index: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    scale: float,
    divide: bool,
    scale_first: bool,
    upcast: bool,
    chunk_bytes: int,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    with no_autocast(hidden):
        return _entropy.backward(
            grad, grad_entropy, hidden, weight, rows, index, lse, entropy, scale, divide, scale_first, upcast, chunk_bytes,
            need_hidden, need_weight,
        )


@linear_log_prob_entropy_bwd.register_fake
def _(grad, grad_entropy, hidden, weight, rows, index, lse, entropy, scale, divide, scale_first, upcast, chunk_bytes, need_hidden, need_weight):
    return (
        torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden else hidden.new_empty(0),
        torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else weight.new_empty(0),
    )


def _setup_context_entropy(ctx, inputs, output):
    hidden, weight, rows, index, *post = inputs
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, rows, index, lse, entropy)
    ctx.post = tuple(post)


def _autograd_backward_entropy(ctx, grad, grad_entropy, dlse):
    hidden, weight, rows, index, lse, entropy = ctx.saved_tensors
    need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    d_hidden, d_weight = linear_log_prob_entropy_bwd(
        grad, grad_entropy, hidden, weight, rows, index, lse, entropy, *ctx.post, need_hidden, need_weight
    )
    return (d_hidden if need_hidden else None), (d_weight if need_weight else None), None, None, None, None, None, None, None


linear_log_prob_entropy_fwd.register_autograd(_autograd_backward_entropy, setup_context=_setup_context_entropy)


def linear_log_prob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    index: torch.Tensor,
    *,
    scale: float = 1.0,
    divide: bool = False,
    scale_first: bool = True,
    upcast: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``linear_log_prob``'s ``[T, K]`` log-probs, the entropy ``[N]`` of every row of ``hidden``), chunked.

    ``entropy[n] = -(p * log p).sum()`` over ``p = softmax(post(linear(hidden[n], weight)))``, in float32
    (float64 for float64 logits without the cast). ``rows`` and ``index`` may be empty (``[0]``, ``[0, K]``):
    the entropy alone. Differentiable in ``hidden`` and ``weight`` through both outputs.
    ``ValueError`` names a bad argument.
    """
    check_inputs(hidden, weight, rows, index, scale, chunk_bytes)
    out, entropy, _ = linear_log_prob_entropy_fwd(
        hidden, weight, rows, index, float(scale), bool(divide), bool(scale_first), bool(upcast), chunk_bytes
    )
    return out, entropy
