"""``dualkv::linear_log_prob`` and ``dualkv::linear_log_prob_bwd``: the chunked lm_head -> log-softmax -> gather op.

The math is ``kernels/linear_log_prob.py`` (its docstring states the formula,
memory and numerics). Here: the two ``torch.library`` custom ops with fake
implementations (they trace under ``torch.compile`` with dynamic shapes and
stay opaque to Inductor), the backward registered as the forward's autograd
formula, and ``linear_log_prob``, the differentiable entry point.
"""

from __future__ import annotations

import torch

from ..kernels.linear_log_prob import DEFAULT_CHUNK_BYTES, backward, check_inputs, dtypes, forward, no_autocast

__all__ = ["linear_log_prob", "linear_log_prob_fwd", "linear_log_prob_bwd"]


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


