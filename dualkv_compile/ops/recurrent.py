"""``dualkv::gated_delta_rule`` and ``dualkv::gated_delta_rule_bwd``: a GDN layer's recurrent core as one opaque op.

Assumes: ``impl`` names (``"module.attr"``) a function with the signature and return of transformers'
``torch_chunk_gated_delta_rule`` (q, k ``[B, T, Hk, Dk]``, v ``[B, T, Hv, Dv]``, g and beta ``[B, T, Hv]``;
returns the output ``[B, T, Hv, Dv]`` in q's dtype and the final state ``[B, Hv, Dk, Dv]`` in float32, or None);
a decorated function (``functools.wraps``) is unwrapped to the function it wraps.

Guarantees: the forward op calls that function eagerly, so its output is the eager model's; the backward op is the
autograd of the same function (``torch.func.vjp`` of it, the forward recomputed inside: nothing but the op's
inputs is saved), so its gradients are the eager model's. Both ops return contiguous tensors and their fake
implementations say so: no stride of theirs can differ between a fake and a real run (the torch bug behind
issue 51: ``aten.softplus_backward``'s decomposition, which fake tensors run, lays out its result like ``self``
where eager lays it out like ``grad_output``; fed the GDN fallback's transposed gradients, AOTAutograd's backward
graph then holds a ``view`` that fails eagerly). Without the final state, the op returns an empty tensor there.
Dynamo puts the op in the graph and AOTAutograd does not trace into it (``integrations.hf_hybrids`` routes
transformers' function to it); the packed rewrite can replace it by a forest scan (docs/design.md, semantics 16).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Optional

import torch

__all__ = ["gated_delta_rule", "gated_delta_rule_fwd", "gated_delta_rule_bwd", "resolve_impl"]


@functools.lru_cache(maxsize=None)
def resolve_impl(impl: str):
    """The function ``impl`` (``"package.module.attr"``) names, unwrapped (``inspect.unwrap``)."""
    module, _, name = impl.rpartition(".")
    return inspect.unwrap(getattr(importlib.import_module(module), name))


def _shapes(q, k, v):
    batch, _, _, dk = k.shape
    hv, dv = v.shape[-2:]
    return (batch, q.shape[1], hv, dv), (batch, hv, dk, dv)


def _checked(x: torch.Tensor, shape, dtype, what: str, impl: str) -> torch.Tensor:
    if tuple(x.shape) != tuple(shape) or x.dtype != dtype:
        raise RuntimeError(f"dualkv::gated_delta_rule: {impl} returned {what} {tuple(x.shape)} {x.dtype}, expected "
                           f"{tuple(shape)} {dtype} (the op's fake implementation assumes transformers' contract)")
    return x.contiguous()


@torch.library.custom_op("dualkv::gated_delta_rule", mutates_args=())
def gated_delta_rule_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: Optional[torch.Tensor], chunk_size: int, output_final_state: bool, use_qk_l2norm: bool, impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, state = resolve_impl(impl)(q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state,
                                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm)
    out_shape, state_shape = _shapes(q, k, v)
    out = _checked(out, out_shape, q.dtype, "an output", impl)
    if not output_final_state:
        return out, q.new_empty(0, dtype=torch.float32)
    return out, _checked(state, state_shape, torch.float32, "a final state", impl)


@gated_delta_rule_fwd.register_fake
def _(q, k, v, g, beta, initial_state, chunk_size, output_final_state, use_qk_l2norm, impl):
    out_shape, state_shape = _shapes(q, k, v)
    return q.new_empty(out_shape), q.new_empty(state_shape if output_final_state else (0,), dtype=torch.float32)


@torch.library.custom_op("dualkv::gated_delta_rule_bwd", mutates_args=())
def gated_delta_rule_bwd(
    grad_out: torch.Tensor, grad_state: torch.Tensor,
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: Optional[torch.Tensor], chunk_size: int, output_final_state: bool, use_qk_l2norm: bool, impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k, v, g, beta and the initial state (empty without one): the function's autograd."""
    fn = resolve_impl(impl)
    primals = (q, k, v, g, beta) + (() if initial_state is None else (initial_state,))

    def run(*xs):
        out, state = fn(*xs[:5], chunk_size=chunk_size, initial_state=xs[5] if len(xs) > 5 else None,
                        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm)
        return (out, state) if output_final_state else (out,)

    _, pullback = torch.func.vjp(run, *primals)
    grads = pullback((grad_out, grad_state) if output_final_state else (grad_out,))
    grads = tuple(gr.contiguous() for gr in grads)
    return grads if initial_state is not None else grads + (q.new_empty(0),)


@gated_delta_rule_bwd.register_fake
def _(grad_out, grad_state, q, k, v, g, beta, initial_state, chunk_size, output_final_state, use_qk_l2norm, impl):
    like = (q, k, v, g, beta) + ((initial_state,) if initial_state is not None else ())
    grads = tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in like)
    return grads if initial_state is not None else grads + (q.new_empty(0),)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, chunk_size, output_final_state, use_qk_l2norm, impl = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state)
    ctx.args = (chunk_size, output_final_state, use_qk_l2norm, impl)


def _backward(ctx, grad_out, grad_state):
    q, k, v, g, beta, initial_state = ctx.saved_tensors
    chunk_size, output_final_state, use_qk_l2norm, impl = ctx.args
    if grad_out is None:
        grad_out = torch.zeros(_shapes(q, k, v)[0], dtype=q.dtype, device=q.device)
    if grad_state is None or not output_final_state:
        grad_state = torch.zeros(_shapes(q, k, v)[1] if output_final_state else (0,), dtype=torch.float32, device=q.device)
    *grads, d_init = gated_delta_rule_bwd(grad_out, grad_state, q, k, v, g, beta, initial_state, chunk_size,
                                          output_final_state, use_qk_l2norm, impl)
    return (*grads, d_init if initial_state is not None else None, None, None, None, None)


gated_delta_rule_fwd.register_autograd(_backward, setup_context=_setup_context)


def gated_delta_rule(q, k, v, g, beta, *, impl: str, chunk_size: int = 64, initial_state=None,
                     output_final_state: bool = False, use_qk_l2norm: bool = False):
    """The differentiable op: ``(output, final state or None)``, as ``impl`` returns them."""
    out, state = gated_delta_rule_fwd(q, k, v, g, beta, initial_state, int(chunk_size), bool(output_final_state),
                                      bool(use_qk_l2norm), impl)
    return out, (state if output_final_state else None)
