"""The eager autograd path of ``shared_prompt_attention``: the same kernels, without the custom op's host cost.

``dualkv::attention_fwd`` is what graphs hold; called eagerly with grad enabled, a custom op goes through
``torch.library``'s generated autograd wrapper, whose host time per call can exceed short kernels' device time
(docs/design.md, "The attention op"). ``EagerAttention`` is a plain ``torch.autograd.Function`` over the same
backend functions (``backend.forward`` / ``backend.backward``) with the same contract as the custom ops' pair:
contiguous outputs, ``lse`` in ``lse_dtype(q)`` saved for the backward, the backward's ``deterministic`` read
from ``torch.are_deterministic_algorithms_enabled()`` when it runs.

``applies(q, k, v)`` says when it may stand in: plain tensors (no subclass, so no fake, functional or wrapped
tensor), outside ``torch.compile`` and export, with no dispatch mode (``make_fx``), torch-function mode or
functorch transform active. Anything else takes the custom op.
"""

from __future__ import annotations

import torch

from ..layout import Segments
from .backend_calls import backward_with_stats, forward_with_sinks

__all__ = ["EagerAttention", "applies"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when the eager Function may run in place of the custom op (see the module docstring)."""
    if torch.compiler.is_compiling():
        return False
    if type(q) not in _PLAIN or type(k) not in _PLAIN or type(v) not in _PLAIN:
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    return torch._C._functorch.peek_interpreter_stack() is None


class EagerAttention(torch.autograd.Function):
    """``out`` of the op's forward (with windows and sinks); its backward is the op's backward. ``pick(**operands)``
    gives the backend module that runs each (``ops.attention.backend_for_call``, as the custom ops ask it)."""

    @staticmethod
    def forward(ctx, q, k, v, segs: Segments, scale: float, softcap: float, pick, lse_dtype: torch.dtype,
                window: int = 0, chunk: int = 0, sinks=None):
        out, lse = forward_with_sinks(pick(q=q, k=k, v=v), q, k, v, segs, scale, softcap, window, chunk, sinks,
                                      lse_dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.segs, ctx.scale, ctx.softcap, ctx.pick, ctx.window, ctx.chunk = segs, scale, softcap, pick, window, chunk
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = backward_with_stats(
            ctx.pick(q=q, dout=dout, k=k, v=v), dout, q, k, v, out, lse, ctx.segs, ctx.scale, torch.are_deterministic_algorithms_enabled(),
            ctx.softcap, ctx.window, ctx.chunk, sinks)
        return dq, dk, dv, None, None, None, None, None, None, None, dsinks if sinks is not None else None
