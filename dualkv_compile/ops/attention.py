"""``shared_prompt_attention``: the one attention op of the packed stream.

Two ``torch.library`` custom ops, ``dualkv::attention_fwd`` and ``dualkv::attention_bwd``, with fake
implementations (they trace under ``torch.compile`` with dynamic shapes), the backward registered as the
forward's autograd formula. ``backend`` names the implementation, resolved before tracing (``resolve_backend``)
so that the compiled graph holds a concrete choice: "reference" (dense, the oracle; any device), "cpu_flash"
(CPU), "flex", "triton" and "gluon" (CUDA; Gluon on Hopper, sm_90), or "auto" (CPU: cpu_flash, reference for
float64; CUDA: the first of gluon, triton, flex that supports the input, flex before triton with a window); a
backend that cannot run the input is refused (``ValueError``). The name resolved runs, but for one choice made
per call (``backend_for_call``: Gluon's operands without a descriptor view run on Triton).

Tensors: q ``[1, Hq, T, D]``, k ``[1, Hkv, T, D]``, v ``[1, Hkv, T, Dv]`` (SDPA's layout with batch 1), Hq a
multiple of Hkv; Dv may differ from D (MLA). The op returns the output ``[1, Hq, T, Dv]`` in q's dtype; ``lse``
(float32, float64 for float64 inputs, ``[1, Hq, T]``) is saved for the backward. ``softcap`` (0.0: none) caps
the scaled score s to ``softcap * tanh(s / softcap)`` before the mask (all but Gluon); ``window`` and ``chunk``
(0: none) narrow the mask on token depth (``layout.segments.dense_mask``; docs/design.md, semantics 15); ``sinks``
(None or ``[Hq]``, gpt-oss's) go around the backend's ``(out, lse)`` (``kernels.sinks``), with their gradient.

Each backend is a module with ``supports(q, v=None, *, window=0, chunk=0, sinks=False, softcap=0.0)`` (None, or
why), ``forward(q, k, v, segs, scale, softcap=0.0, window=0, chunk=0) -> (out, lse)`` and ``backward(dout, q, k, v,
out, lse, segs, scale, deterministic, softcap=0.0, window=0, chunk=0) -> (dq, dk, dv)``; ``backward`` takes P from
the saved ``lse`` and Delta from the saved ``out``, or ``supports`` refuses sinks. Called eagerly the op runs the same
functions under a plain ``autograd.Function`` (``eager_attention``); ``backend="flex"`` calls ``flex.attention``
under autograd, so FlexAttention's fused backward runs (why both: docs/design.md, "The attention op").
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Optional

import torch

from ..layout import Segments, SharedPromptLayout
from ..kernels import reference
from ..kernels.reference import check_qkv
from ..kernels.sinks import check_sinks
from ..layout.segments import check_window
from . import eager_attention
from .backend_calls import backward_with_stats as _backward_impl, forward_with_sinks as _forward

log = logging.getLogger("dualkv_compile")

__all__ = ["shared_prompt_attention", "BACKENDS", "resolve_backend", "unsupported_reason", "backend_for_call"]

BACKENDS = ("auto", "reference", "cpu_flash", "flex", "triton", "gluon")


def _impl(backend: str):
    if backend == "cpu_flash":
        from ..kernels import cpu_flash

        return cpu_flash
    if backend == "reference":
        return reference
    if backend == "flex":
        from . import flex

        return flex
    if backend == "triton":
        try:
            from ..kernels.triton import attention as triton_attention
        except ImportError as e:
            raise ValueError(f"backend='triton' is unavailable: {e}") from e

        return triton_attention
    if backend == "gluon":
        try:
            from ..kernels.gluon import attention as gluon_attention
        except ImportError as e:
            raise ValueError(f"backend='gluon' is unavailable: {e}") from e

        return gluon_attention
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def resolve_backend(backend: str, q: torch.Tensor, v: Optional[torch.Tensor] = None, *, window: int = 0, chunk: int = 0,
                    sinks: bool = False, softcap: float = 0.0) -> str:
    """The concrete backend for ``backend`` on q's device, dtype and head dims (and v's) with these windows, sinks
    and softcap; ``ValueError`` if it cannot run (a softcap under "auto": Triton, as Gluon has none)."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    feats = dict(window=window, chunk=chunk, sinks=sinks, softcap=softcap)
    if backend == "auto":
        if q.device.type != "cuda":
            from ..kernels import cpu_flash

            # float64 stays on the reference, the oracle (cpu_flash runs float64 too, when asked for by name).
            return "cpu_flash" if q.dtype != torch.float64 and cpu_flash.supports(q, v, **feats) is None else "reference"
        # Windows too: the Triton kernels' windows pass the oracle on a GPU as on the interpreter and run faster
        # than flex's (docs/design.md, "The attention op"); flex where neither Gluon nor Triton runs.
        order = ("gluon", "triton", "flex")
        for name in order:
            why = unsupported_reason(name, q, v, **feats)
            if why is None:
                return name
            log.debug("backend='auto' skips %s: %s", name, why)
        return "reference"
    if backend == "reference":
        return backend
    why = unsupported_reason(backend, q, v, **feats)
    if why is not None:
        raise ValueError(f"backend={backend!r} cannot run this input: {why}")
    return backend


def unsupported_reason(backend: str, q: torch.Tensor, v: Optional[torch.Tensor] = None, *, window: int = 0, chunk: int = 0,
                       sinks: bool = False, softcap: float = 0.0) -> Optional[str]:
    """None if the concrete ``backend`` can run q (and v) with these windows, sinks and softcap; else why not (its
    device first, then its dtype, then its head dims, then the features)."""
    if backend == "auto":
        return None
    try:
        return _impl(backend).supports(q, v, window=window, chunk=chunk, sinks=sinks, softcap=softcap)
    except ValueError as e:  # an unknown name, or the module is missing
        return str(e)


def backend_for_call(backend: str, **operands: torch.Tensor):
    """The module that runs one call of the concrete ``backend`` on these operands (q, k, v; the backward's q,
    dout, k, v): ``backend``'s own, except Gluon on an operand without the 2-D tensor-descriptor view its kernels
    load through (``operands_reason``: strides, alignment or a one-token stream, known per call only, so no
    resolution before tracing can name it). That call runs the Triton kernels, the same contract, logged."""
    impl = _impl(backend)
    if backend == "gluon":
        why = impl.operands_reason(**operands)
        if why is not None:
            log.debug("backend='gluon': %s; the Triton kernels run this call", why)
            return _impl("triton")
    return impl


def _segments(seg_start, seg_len, parent, prefix_len, subtree_end, max_seg_len, max_prefix_len) -> Segments:
    return Segments(seg_start, seg_len, parent, prefix_len, subtree_end, max_seg_len, max_prefix_len)


@torch.library.custom_op("dualkv::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    parent: torch.Tensor,
    prefix_len: torch.Tensor,
    subtree_end: torch.Tensor,
    max_seg_len: int,
    max_prefix_len: int,
    scale: float,
    softcap: float,
    backend: str,
    window: int = 0,
    chunk: int = 0,
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # The kernels index k and v by q's head count and v's head dim: shapes that disagree would read out of bounds.
    check_qkv(q, k, v, q.shape[2])
    segs = _segments(seg_start, seg_len, parent, prefix_len, subtree_end, max_seg_len, max_prefix_len)
    return _forward(backend_for_call(backend, q=q, k=k, v=v), q, k, v, segs, scale, softcap, window, chunk, sinks,
                    lse_dtype(q))


def lse_dtype(q: torch.Tensor) -> torch.dtype:
    """The log-sum-exp's dtype: float32, float64 for float64 inputs (a float32 lse made their backward float32-accurate)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@attention_fwd.register_fake
def _(q, k, v, seg_start, seg_len, parent, prefix_len, subtree_end, max_seg_len, max_prefix_len, scale, softcap, backend,
      window=0, chunk=0, sinks=None):
    check_qkv(q, k, v, q.shape[2])
    return q.new_empty((*q.shape[:3], v.shape[3])), q.new_empty(q.shape[:3], dtype=lse_dtype(q))


@torch.library.custom_op("dualkv::attention_bwd", mutates_args=())
def attention_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    parent: torch.Tensor,
    prefix_len: torch.Tensor,
    subtree_end: torch.Tensor,
    max_seg_len: int,
    max_prefix_len: int,
    scale: float,
    softcap: float,
    backend: str,
    deterministic: bool,
    window: int = 0,
    chunk: int = 0,
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    check_qkv(q, k, v, q.shape[2])
    segs = _segments(seg_start, seg_len, parent, prefix_len, subtree_end, max_seg_len, max_prefix_len)
    impl = backend_for_call(backend, q=q, dout=dout, k=k, v=v)
    return _backward_impl(impl, dout, q, k, v, out, lse, segs, scale, deterministic, softcap, window, chunk, sinks)


@attention_bwd.register_fake
def _(dout, q, k, v, out, lse, seg_start, seg_len, parent, prefix_len, subtree_end, max_seg_len, max_prefix_len, scale, softcap, backend,
      deterministic, window=0, chunk=0, sinks=None):
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
        q.new_empty((0,)) if sinks is None else torch.empty_like(sinks, memory_format=torch.contiguous_format),
    )


def _setup_context(ctx, inputs, output):
    (q, k, v, seg_start, seg_len, parent, prefix_len, subtree_end, max_seg_len, max_prefix_len, scale, softcap, backend,
     window, chunk, sinks) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seg_start, seg_len, parent, prefix_len, subtree_end, sinks)
    ctx.max_lens = (max_seg_len, max_prefix_len)
    ctx.scale, ctx.softcap, ctx.backend, ctx.window, ctx.chunk = scale, softcap, backend, window, chunk


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, seg_start, seg_len, parent, prefix_len, subtree_end, sinks = ctx.saved_tensors
    # lse is an internal output (saved for the backward); its gradient is never needed.
    dq, dk, dv, dsinks = attention_bwd(
        dout, q, k, v, out, lse, seg_start, seg_len, parent, prefix_len, subtree_end,
        *ctx.max_lens, ctx.scale, ctx.softcap, ctx.backend, torch.are_deterministic_algorithms_enabled(),
        ctx.window, ctx.chunk, sinks,
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, None, (
        dsinks if sinks is not None else None)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def shared_prompt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SharedPromptLayout | Segments,
    scale: Optional[float] = None,
    backend: str = "auto",
    softcap: Optional[float] = None,
    *,
    window: int = 0,
    chunk: int = 0,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention over the packed stream: each token over its ancestor nodes fully and its own node causally, one softmax.

    ``layout`` is a ``SharedPromptLayout`` or its ``attention_segments``.
    ``softcap`` (None or 0: none) caps the scaled scores to ``softcap * tanh(s / softcap)`` (Gemma 2).
    ``window`` / ``chunk`` (0: none): a sliding window of that many tokens / chunks of that many, on each
    token's depth along its sequence. ``sinks``: ``[Hq]`` logits, one more term in each head's denominators.
    Returns ``[1, Hq, T, Dv]`` (v's head dim) in q's dtype. Differentiable in q, k, v and sinks.
    Under ``torch.use_deterministic_algorithms(True)`` the backward avoids atomics.
    """
    segs = _check_inputs(q, k, v, layout)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif not _positive(scale):
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
    if softcap is None or (isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and softcap == 0):
        softcap = 0.0
    elif not _positive(softcap):
        raise ValueError(f"softcap must be a positive finite number, 0 or None, got {softcap!r}")
    check_window(window, chunk)
    why = check_sinks(sinks, q)
    if why is not None:
        raise ValueError(why)
    scale, softcap = float(scale), float(softcap)
    concrete = resolve_backend(backend, q, v, window=window, chunk=chunk, sinks=sinks is not None, softcap=softcap)
    if concrete == "flex":
        from . import flex

        return flex.attention(q, k, v, segs, scale, softcap, window=window, chunk=chunk, sinks=sinks)
    if eager_attention.applies(q, k, v) and (sinks is None or type(sinks) in (torch.Tensor, torch.nn.Parameter)):
        # the same kernels, without the custom op's eager autograd wrapper
        return eager_attention.EagerAttention.apply(q, k, v, segs, scale, softcap, functools.partial(
            backend_for_call, concrete), lse_dtype(q), window, chunk, sinks)
    out, _ = attention_fwd(q, k, v, *segs, scale, softcap, concrete, window, chunk, sinks)
    return out


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _check_inputs(q, k, v, layout) -> Segments:
    """Validate the arguments of ``shared_prompt_attention``; ``ValueError`` names the bad one."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor [1, H, T, D], got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape [1, H, T, D], got {list(t.shape)}")
    if not q.dtype.is_floating_point:
        raise ValueError(f"q must be a floating-point tensor, got dtype {q.dtype}")
    if isinstance(layout, SharedPromptLayout):
        segs = layout.attention_segments
        T = layout.num_tokens
    elif isinstance(layout, Segments):
        segs = layout
        T = q.shape[2]
    else:
        raise ValueError(f"layout must be a SharedPromptLayout or Segments, got {type(layout).__name__}")
    check_qkv(q, k, v, T)
    for name in ("seg_start", "seg_len", "parent", "prefix_len", "subtree_end"):
        t = getattr(segs, name)
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32:
            raise ValueError(f"layout.{name} must be a 1-D int32 tensor")
        if t.shape != segs.seg_start.shape:
            raise ValueError(f"layout.{name} must have one entry per segment ({segs.seg_start.shape[0]}), got {t.shape[0]}")
        if t.device != q.device:
            raise ValueError(f"layout.{name} must be on q's device {q.device}, got {t.device}")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    return segs
