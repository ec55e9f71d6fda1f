"""Hybrid layers' recurrent cores as opaque ops: ``dualkv::gated_delta_rule`` (GDN), ``dualkv::mamba2_chunk_scan``
and ``dualkv::mamba_selective_scan`` (Mamba v1).

The scans have the GDN op's contract below for transformers' ``mamba2_chunk_scan`` (x ``[B, T, H, P]``, dt
``[B, T, H]``, A ``[H]``, B, C ``[B, T, G, N]``, D, dt_bias ``[H]``; returns float32, or D's dtype where wider)
and ``mamba_selective_scan`` (x, dt, z ``[B, D, T]``, A ``[D, N]``, B, C ``[B, N, T]``, D, delta_bias ``[D]``;
returns x's dtype promoted with D's and z's), each from a zero state and without its final state. GDN's:

Assumes: ``impl`` names (``"module.attr"``) a function with the signature and return of transformers'
``torch_chunk_gated_delta_rule`` (q, k ``[B, T, Hk, Dk]``, v ``[B, T, Hv, Dv]``, g and beta ``[B, T, Hv]``;
returns the output ``[B, T, Hv, Dv]`` in q's dtype and the final state ``[B, Hv, Dk, Dv]`` in float32, or None),
or flash-linear-attention's ``chunk_gated_delta_rule`` (the same call; ``chunk_size`` is passed only to a function
that names it, as the hub wrapper does); a transformers name is its hub wrapper, unwrapped to the fallback.

Guarantees: the forward op calls that function eagerly, so its output is the eager model's; the backward op is the
autograd of the same function (``autograd_vjp`` of it, the forward recomputed inside: nothing but the op's
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

from ..kernels.recurrent.mamba1 import mamba1_out_dtype as _mamba1_dtype

__all__ = ["gated_delta_rule", "gated_delta_rule_fwd", "gated_delta_rule_bwd", "mamba2_chunk_scan",
           "mamba2_chunk_scan_fwd", "mamba2_chunk_scan_bwd", "mamba2_out_dtype", "mamba_selective_scan",
           "mamba_selective_scan_fwd", "mamba_selective_scan_bwd", "mamba1_out_dtype", "resolve_impl",
           "gdn_call", "is_varlen_kernel", "named_keywords", "autograd_vjp", "vjp_with_optional", "grads_like", "recompute_autograd"]


@functools.lru_cache(maxsize=None)
def resolve_impl(impl: str):
    """The function ``impl`` (``"package.module.attr"``) names. A transformers name is its hub wrapper, unwrapped
    (``inspect.unwrap``) to the torch fallback it wraps; a kernel library's (flash-linear-attention's) is called
    as transformers' wrapper calls it, its own dispatch kept."""
    module, _, name = impl.rpartition(".")
    fn = getattr(importlib.import_module(module), name)
    return inspect.unwrap(fn) if module.startswith("transformers.") else fn


@functools.lru_cache(maxsize=None)
def named_keywords(fn) -> frozenset:
    """The keywords ``fn`` names (not its ``**kwargs``): the ones transformers' hub wrapper passes it."""
    params = inspect.signature(fn).parameters
    return frozenset(n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def _recording():
    """Autograd recording inside an op's kernel: the dispatcher runs a custom op below autograd (its autograd keys
    in the thread's exclude set), where torch ops would record nothing; this lifts that exclusion for the block."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name in ("AutogradFunctionality", "ADInplaceOrView", "AutogradOther", "AutogradNestedTensor"):
        if hasattr(keys, name):
            exclude = exclude.remove(getattr(keys, name))
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def autograd_vjp(run, primals, cotangents) -> tuple:
    """The gradients of ``run(*primals)`` (a tensor or a tuple of them) against ``cotangents``, one per primal,
    zeros where it does not reach; contiguous. Through ``torch.autograd.grad`` on detached copies, not
    ``torch.func.vjp``: a kernel library's ``autograd.Function`` with an old-style ``forward(ctx, ...)``
    (flash-linear-attention's) is refused by functorch."""
    with _recording(), torch.enable_grad():
        xs = [p.detach().requires_grad_(p.is_floating_point()) for p in primals]
        outs = run(*xs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, c) for o, c in zip(outs, cotangents) if o is not None and o.requires_grad]
        wrt = [x for x in xs if x.requires_grad]
        grads = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [c for _, c in pairs], allow_unused=True)
                     if pairs and wrt else [None] * len(wrt))
    result = []
    for x in xs:
        gr = next(grads) if x.requires_grad else None
        result.append(torch.zeros_like(x, memory_format=torch.contiguous_format) if gr is None else gr.contiguous())
    return tuple(result)


def vjp_with_optional(run, tensors, grad_out) -> tuple:
    """The gradients of ``run(*tensors)`` (a None entry passed as None) for each tensor, an empty tensor for a
    None one: the backward ops' return, whose schema has no optional tensors in a tuple. Contiguous."""
    present = [i for i, t in enumerate(tensors) if t is not None]

    def call(*xs):
        full = list(tensors)
        for i, x in zip(present, xs):
            full[i] = x
        return run(*full)

    grads = dict(zip(present, autograd_vjp(call, [tensors[i] for i in present], (grad_out,))))
    like = next(t for t in tensors if t is not None)
    return tuple(grads[i] if i in grads else like.new_empty(0) for i in range(len(tensors)))


def grads_like(tensors) -> tuple:
    """A backward op's fake result: per input, an empty tensor where it is None, else one like it (contiguous)."""
    like = next(t for t in tensors if t is not None)
    return tuple(like.new_empty(0) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in tensors)


def recompute_autograd(fwd, bwd, saved: int, grads: int) -> None:
    """Register ``fwd``'s autograd as ``bwd(grad, *inputs)``: the first ``saved`` inputs saved (tensors, some None),
    the others kept as constants; ``bwd`` returns one gradient per first ``grads`` input, None for a None one."""
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:saved])
        ctx.args = inputs[saved:]

    def backward(ctx, grad_out):
        tensors = ctx.saved_tensors
        out = bwd(grad_out.contiguous(), *tensors, *ctx.args)
        return tuple(g if t is not None else None for g, t in zip(out, tensors[:grads])) + (None,) * (
            len(tensors) + len(ctx.args) - grads)

    fwd.register_autograd(backward, setup_context=setup_context)


def _shapes(q, k, v):
    batch, _, _, dk = k.shape
    hv, dv = v.shape[-2:]
    return (batch, q.shape[1], hv, dv), (batch, hv, dk, dv)


def _checked(x: torch.Tensor, shape, dtype, what: str, impl: str) -> torch.Tensor:
    if tuple(x.shape) != tuple(shape) or x.dtype != dtype:
        raise RuntimeError(f"dualkv::gated_delta_rule: {impl} returned {what} {tuple(x.shape)} {x.dtype}, expected "
                           f"{tuple(shape)} {dtype} (the op's fake implementation assumes transformers' contract)")
    return x.contiguous()


def is_varlen_kernel(impl: str) -> bool:
    """Whether a gated delta rule's ``impl`` is a kernel library's (flash-linear-attention's ``chunk_gated_delta_rule``
    contract: varlen ``cu_seqlens``, an initial state per sequence), not a transformers torch fallback."""
    return not impl.startswith("transformers.")


def gdn_call(impl: str, q, k, v, g, beta, chunk_size: int, initial_state, output_final_state: bool,
             use_qk_l2norm: bool):
    """``impl`` called as transformers' hub wrapper calls it: ``chunk_size`` only where the function names it
    (flash-linear-attention's takes its own default, as under the wrapper)."""
    fn = resolve_impl(impl)
    extra = {"chunk_size": chunk_size} if "chunk_size" in named_keywords(fn) else {}
    return fn(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=use_qk_l2norm, **extra)


@torch.library.custom_op("dualkv::gated_delta_rule", mutates_args=())
def gated_delta_rule_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: Optional[torch.Tensor], chunk_size: int, output_final_state: bool, use_qk_l2norm: bool, impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, state = gdn_call(impl, q, k, v, g, beta, chunk_size, initial_state, output_final_state, use_qk_l2norm)
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
    primals = (q, k, v, g, beta) + (() if initial_state is None else (initial_state,))

    def run(*xs):
        out, state = gdn_call(impl, *xs[:5], chunk_size, xs[5] if len(xs) > 5 else None, output_final_state,
                              use_qk_l2norm)
        return (out, state) if output_final_state else out

    grads = autograd_vjp(run, primals, (grad_out, grad_state))
    return grads if initial_state is not None else grads + (q.new_empty(0),)


@gated_delta_rule_bwd.register_fake
def _(grad_out, grad_state, q, k, v, g, beta, initial_state, chunk_size, output_final_state, use_qk_l2norm, impl):
    return grads_like((q, k, v, g, beta, initial_state))


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


def mamba2_out_dtype(D: Optional[torch.Tensor]) -> torch.dtype:
    """The dtype transformers' ``mamba2_chunk_scan`` returns: float32 (it upcasts x), D's where D's is wider."""
    return torch.float32 if D is None else torch.promote_types(torch.float32, D.dtype)


def _mamba2_call(impl, x, dt, A, B, C, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
    return resolve_impl(impl)(x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                              dt_limit=(dt_min, dt_max))


@torch.library.custom_op("dualkv::mamba2_chunk_scan", mutates_args=())
def mamba2_chunk_scan_fwd(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], chunk_size: int, dt_softplus: bool,
    dt_min: float, dt_max: float, impl: str,
) -> torch.Tensor:
    out = _mamba2_call(impl, x, dt, A, B, C, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
    if not isinstance(out, torch.Tensor):
        raise RuntimeError(f"dualkv::mamba2_chunk_scan: {impl} returned {type(out).__name__}, expected a tensor")
    return _checked(out, x.shape, mamba2_out_dtype(D), "an output", impl)


@mamba2_chunk_scan_fwd.register_fake
def _(x, dt, A, B, C, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max, impl):
    return x.new_empty(x.shape, dtype=mamba2_out_dtype(D))


@torch.library.custom_op("dualkv::mamba2_chunk_scan_bwd", mutates_args=())
def mamba2_chunk_scan_bwd(
    grad_out: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], chunk_size: int, dt_softplus: bool,
    dt_min: float, dt_max: float, impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of x, dt, A, B, C, D and dt_bias (empty for an absent one): the function's autograd."""
    def run(*ts):
        return _mamba2_call(impl, *ts, chunk_size, dt_softplus, dt_min, dt_max)

    return vjp_with_optional(run, (x, dt, A, B, C, D, dt_bias), grad_out)


@mamba2_chunk_scan_bwd.register_fake
def _(grad_out, x, dt, A, B, C, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max, impl):
    return grads_like((x, dt, A, B, C, D, dt_bias))


recompute_autograd(mamba2_chunk_scan_fwd, mamba2_chunk_scan_bwd, saved=7, grads=7)


def mamba2_chunk_scan(x, dt, A, B, C, *, impl: str, chunk_size: int, D=None, dt_bias=None, dt_softplus: bool = False,
                      dt_limit: tuple = (0.0, float("inf"))):
    """The differentiable op: the output ``impl`` returns from a zero state, without its final state."""
    return mamba2_chunk_scan_fwd(x, dt, A, B, C, D, dt_bias, int(chunk_size), bool(dt_softplus),
                                 float(dt_limit[0]), float(dt_limit[1]), impl)


def mamba1_out_dtype(x: torch.Tensor, D: Optional[torch.Tensor], z: Optional[torch.Tensor]) -> torch.dtype:
    """The dtype transformers' ``mamba_selective_scan`` returns (``kernels.recurrent.mamba1``)."""
    return _mamba1_dtype(x.dtype, D, z)


def _mamba1_call(impl, x, dt, A, B, C, D, z, delta_bias, delta_softplus, use_mambapy, use_associative_scan):
    return resolve_impl(impl)(x, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                              use_mambapy=use_mambapy, use_associative_scan=use_associative_scan)


@torch.library.custom_op("dualkv::mamba_selective_scan", mutates_args=())
def mamba_selective_scan_fwd(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: Optional[torch.Tensor], z: Optional[torch.Tensor], delta_bias: Optional[torch.Tensor],
    delta_softplus: bool, use_mambapy: bool, use_associative_scan: bool, impl: str,
) -> torch.Tensor:
    out = _mamba1_call(impl, x, dt, A, B, C, D, z, delta_bias, delta_softplus, use_mambapy, use_associative_scan)
    if not isinstance(out, torch.Tensor):
        raise RuntimeError(f"dualkv::mamba_selective_scan: {impl} returned {type(out).__name__}, expected a tensor")
    return _checked(out, x.shape, mamba1_out_dtype(x, D, z), "an output", impl)


@mamba_selective_scan_fwd.register_fake
def _(x, dt, A, B, C, D, z, delta_bias, delta_softplus, use_mambapy, use_associative_scan, impl):
    return x.new_empty(x.shape, dtype=mamba1_out_dtype(x, D, z))


@torch.library.custom_op("dualkv::mamba_selective_scan_bwd", mutates_args=())
def mamba_selective_scan_bwd(
    grad_out: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: Optional[torch.Tensor], z: Optional[torch.Tensor], delta_bias: Optional[torch.Tensor],
    delta_softplus: bool, use_mambapy: bool, use_associative_scan: bool, impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """The gradients of x, dt, A, B, C, D, z and delta_bias (empty for an absent one): the function's autograd."""
    def run(*ts):
        return _mamba1_call(impl, *ts, delta_softplus, use_mambapy, use_associative_scan)

    return vjp_with_optional(run, (x, dt, A, B, C, D, z, delta_bias), grad_out)


@mamba_selective_scan_bwd.register_fake
def _(grad_out, x, dt, A, B, C, D, z, delta_bias, delta_softplus, use_mambapy, use_associative_scan, impl):
    return grads_like((x, dt, A, B, C, D, z, delta_bias))


recompute_autograd(mamba_selective_scan_fwd, mamba_selective_scan_bwd, saved=8, grads=8)


def mamba_selective_scan(x, dt, A, B, C, *, impl: str, D=None, z=None, delta_bias=None, delta_softplus: bool = False,
                         use_mambapy: bool = False, use_associative_scan: bool = False):
    """The differentiable op: the output ``impl`` returns from a zero state, without its last state."""
    return mamba_selective_scan_fwd(x, dt, A, B, C, D, z, delta_bias, bool(delta_softplus), bool(use_mambapy),
                                    bool(use_associative_scan), impl)
