"""FlexAttention on a packed stream's ``BlockMask``: the flex backend's math, with no op or dispatch.

    supports(q, v=None, *, window=0, chunk=0, sinks=False, softcap=0.0) -> None, or why FlexAttention cannot run q
    mask_of(tables, num_tokens, windowed)  -> the BlockMask of ``block_tables``' eleven tensors
    compiled_flex()                        -> ``torch.compile(flex_attention, dynamic=True)``, made once per process
    attention(q, k, v, bm, scale, softcap=None, sinks=None)                  -> out, differentiable
    forward(q, k, v, bm, scale, softcap=0.0)                                 -> (out, lse float32)
    backward(dout, q, k, v, out, lse, bm, scale, softcap=0.0)                -> (dq, dk, dv), by recomputing

Assumes ``bm`` is a prefix-forest ``BlockMask`` (``ops.flex.block_mask`` builds it through the opaque builder op).
Guarantees: ``attention`` runs FlexAttention under autograd, so its fused backward runs; ``backward`` recomputes
the sink-free ``(o, lse)`` under autograd (one extra forward) and takes its vector-Jacobian product with
``(w dO, (1 - w) rowsum(dO * out'))``, ``w = exp(lse - lse')``, at the saved, possibly sink-aware ``out`` and
``lse``: exact (docs/design.md, "FlexAttention"). A softcap is a ``score_mod``; v's head dim may differ from q's
(MLA); windows live in the mask. The windowed and plain mask_mods, and asking for the lse, are separate compiled
variants of the flex callable, bounded by Dynamo's recompile limit (past it Dynamo runs FlexAttention eagerly).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..sinks import apply_sinks
from .block_tables import BLOCK
from .mask_mod import tree_mask_mod, windowed_mask_mod

__all__ = ["supports", "mask_of", "compiled_flex", "softcap_score_mod", "flex_call", "attention", "forward",
           "backward", "IMPORT_ERROR"]

try:  # FlexAttention is a prototype API: guard the import.
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # pragma: no cover - older torch
        AuxRequest = None
    IMPORT_ERROR: Optional[str] = None
except ImportError as e:  # pragma: no cover - depends on the torch build
    BlockMask = flex_attention = AuxRequest = None
    IMPORT_ERROR = f"torch.nn.attention.flex_attention is unavailable ({e})"

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supports(q: torch.Tensor, v: Optional[torch.Tensor] = None, *, window: int = 0, chunk: int = 0,
             sinks: bool = False, softcap: float = 0.0) -> Optional[str]:
    """None if FlexAttention can run q (and v; forward and backward), else why not; windows, sinks and a softcap
    are all supported."""
    if IMPORT_ERROR is not None:
        return IMPORT_ERROR
    if q.device.type != "cuda":
        return f"FlexAttention needs a CUDA device (its backward has no CPU kernel); q is on {q.device.type}"
    if q.dtype not in _SUPPORTED_DTYPES:
        return f"dtype {q.dtype} is not supported (float16, bfloat16 or float32)"
    for name, t in (("head dim", q), ("v head dim", v)):
        D = t.shape[-1] if t is not None else None
        if D is not None and (D < 16 or D > 256 or D % 8):
            return f"{name} {D} is not supported (a multiple of 8 in [16, 256])"
    return None


def mask_of(tables, num_tokens: int, windowed: bool) -> "BlockMask":
    """The ``BlockMask`` of ``num_tokens`` tokens from the eleven tensors ``block_tables`` returns (either
    builder); ``windowed``: the depth-limited mask_mod, else the plain one (no depth gathers in partial blocks)."""
    if IMPORT_ERROR is not None:
        raise RuntimeError(IMPORT_ERROR)
    kv_num, kv_idx, fkv_num, fkv_idx, q_num, q_idx, fq_num, fq_idx, reach, depth, limit = tables
    return BlockMask(
        seq_lengths=(num_tokens, num_tokens),
        kv_num_blocks=kv_num,
        kv_indices=kv_idx,
        full_kv_num_blocks=fkv_num,
        full_kv_indices=fkv_idx,
        q_num_blocks=q_num,
        q_indices=q_idx,
        full_q_num_blocks=fq_num,
        full_q_indices=fq_idx,
        BLOCK_SIZE=(BLOCK, BLOCK),
        mask_mod=windowed_mask_mod(reach, depth, limit) if windowed else tree_mask_mod(reach),
    )


_compiled: dict[str, object] = {}


def compiled_flex():
    """``torch.compile(flex_attention, dynamic=True)``, made once per process."""
    fn = _compiled.get("flex")
    if fn is None:
        fn = _compiled["flex"] = torch.compile(flex_attention, dynamic=True)
    return fn


def softcap_score_mod(softcap: float):
    """The ``score_mod`` of a logit softcap: ``softcap * tanh(score / softcap)`` (score already scaled)."""

    def capped(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    return capped


def flex_call(q, k, v, bm, scale: float, return_lse: bool, softcap: Optional[float] = None):
    """``(out, lse or None)`` of one FlexAttention call: the compiled callable eagerly, the plain one when traced."""
    # softcap defaults to None, not 0.0: Dynamo reads a float default as an input (a symbolic float under
    # dynamic=True), and a branch on it restarts the trace.
    fn = flex_attention if torch.compiler.is_compiling() else compiled_flex()
    kw = dict(block_mask=bm, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if softcap:
        kw["score_mod"] = softcap_score_mod(softcap)
    if not return_lse:
        return fn(q, k, v, **kw), None
    if AuxRequest is not None:
        out, aux = fn(q, k, v, **kw, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    return fn(q, k, v, **kw, return_lse=True)  # pragma: no cover


def attention(q, k, v, bm, scale: float, softcap: Optional[float] = None,
              sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Differentiable attention under ``bm``; ``sinks`` (None or ``[Hq]``) through ``kernels.sinks.apply_sinks``
    on FlexAttention's ``(out, lse)``, its gradient included (FlexAttention's fused backward takes the lse's)."""
    if sinks is None:
        out, _ = flex_call(q, k, v, bm, scale, return_lse=False, softcap=softcap)
        return out
    out, lse = flex_call(q, k, v, bm, scale, return_lse=True, softcap=softcap)
    out, _ = apply_sinks(out, lse, sinks)
    return out


def forward(q, k, v, bm, scale: float, softcap: float = 0.0):
    """``(out, lse)``, lse float32 ``[1, Hq, T]`` in natural log, without autograd."""
    with torch.no_grad():
        out, lse = flex_call(q, k, v, bm, scale, return_lse=True, softcap=softcap)
    return out, lse.float()


@contextlib.contextmanager
def _autograd_reentered():
    """Record autograd inside a custom op's kernel, where the dispatcher has excluded it."""
    DK = torch._C.DispatchKey
    with (
        torch._C._SetExcludeDispatchKeyGuard(DK.AutogradFunctionality, False),
        torch._C._SetExcludeDispatchKeyGuard(DK.ADInplaceOrView, False),
        torch.enable_grad(),
    ):
        yield


def backward(dout, q, k, v, out, lse, bm, scale: float, softcap: float = 0.0):
    """``(dq, dk, dv)`` of the attention whose saved stats are ``out``, ``lse``, by recomputing (module docstring).

    FlexAttention's backward is reachable only through autograd, and an opaque op keeps no autograd graph between
    its forward and backward. FlexAttention's Triton backward uses no atomics, so it is deterministic.
    """
    with _autograd_reentered():
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        o, lse_now = flex_call(qg, kg, vg, bm, scale, return_lse=True, softcap=softcap)
        gap = lse_now.detach().float() - lse.float()  # log w: 0 without sinks, < 0 with them
        w = torch.exp(gap)
        delta = (dout.float() * out.float()).sum(-1)  # rowsum(dO * out'), out' the saved output
        d_o = (dout.float() * w[..., None]).to(o.dtype)
        d_lse = (-torch.expm1(gap) * delta).to(lse_now.dtype)  # (1 - w) rowsum(dO * out'), no cancellation near w = 1
        dq, dk, dv = torch.autograd.grad((o, lse_now), (qg, kg, vg), (d_o, d_lse))
    return dq, dk, dv
