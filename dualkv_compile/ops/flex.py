"""FlexAttention backend: the packed stream's prefix-forest mask as a BlockMask.

The mask's math lives in ``kernels/flex`` (the segment table, the torch and Triton block-table builders, the
``mask_mod``s; ``BLOCK``, ``segment_table`` and ``block_tables`` re-exported here). This module: the opaque custom
op ``dualkv::flex_block_tables`` with its fake implementation (small Triton kernels on CUDA, eager torch ops on
CPU), ``block_mask`` (a packed stream's ``BlockMask``, built from the ``Segments`` tensors with no device sync),
the compiled flex callable (dynamic shapes, made once per process and cached), and the backend protocol
(``supports``, ``forward``, ``backward``) plus ``attention``.

Guarantees: ``attention`` runs FlexAttention under autograd, so its own fused backward runs (under an outer
``torch.compile``, AOTAutograd derives it); the protocol's ``backward`` (the opaque ``dualkv::attention_bwd`` with
``backend="flex"``) re-enters autograd and recomputes the forward: exact, one extra forward. A softcap is a
``score_mod``; v's head dim may differ from q's (MLA); sliding and chunked windows on token depth are in the
BlockMask (blocks outside skipped, cut blocks partial, ``depth[q] < limit[kv]`` in the ``mask_mod``). Window sizes,
like every length of the layout, are data: a new layout or window recompiles nothing. Learnable sinks are applied
to FlexAttention's ``(out, lse)`` under autograd; behind the opaque op the backward is the vector-Jacobian product
of the sink-free ``(o, lse)`` with ``(w dO, (1 - w) rowsum(dO * out'))``, ``w = exp(lse - lse')``, exact
(docs/design.md, "FlexAttention"). The windowed and plain mask_mods, and asking for the lse, are separate compiled
variants of the flex callable, bounded by Dynamo's recompile limit (past it Dynamo runs FlexAttention eagerly).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Optional

import torch

from ..kernels.flex.block_tables import BLOCK, block_tables, segment_table
from ..kernels.flex.mask_mod import tree_mask_mod, windowed_mask_mod
from ..kernels.flex.triton_block_tables import triton_block_tables, triton_kernels
from ..kernels.sinks import apply_sinks
from ..layout.segments import Segments

log = logging.getLogger("dualkv_compile")

__all__ = ["supports", "forward", "backward", "attention", "block_mask", "block_tables", "block_tables_op", "segment_table", "BLOCK",
           "FORCE_TRITON_BUILDER", "compiled_flex"]

try:  # FlexAttention is a prototype API: guard the import.
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # pragma: no cover - older torch
        AuxRequest = None
    _IMPORT_ERROR: Optional[str] = None
except ImportError as e:  # pragma: no cover - depends on the torch build
    BlockMask = flex_attention = AuxRequest = None
    _IMPORT_ERROR = f"torch.nn.attention.flex_attention is unavailable ({e})"

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _supports_input(q: torch.Tensor, v: Optional[torch.Tensor] = None) -> Optional[str]:
    """None if the flex backend can run ``q`` (and ``v``; forward and backward), else why not."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if q.device.type != "cuda":
        return f"FlexAttention needs a CUDA device (its backward has no CPU kernel); q is on {q.device.type}"
    if q.dtype not in _SUPPORTED_DTYPES:
        return f"dtype {q.dtype} is not supported (float16, bfloat16 or float32)"
    for name, t in (("head dim", q), ("v head dim", v)):
        D = t.shape[-1] if t is not None else None
        if D is not None and (D < 16 or D > 256 or D % 8):
            return f"{name} {D} is not supported (a multiple of 8 in [16, 256])"
    return None

def supports(q: torch.Tensor, v: Optional[torch.Tensor] = None, *, window: int = 0, chunk: int = 0,
             sinks: bool = False) -> Optional[str]:
    """None if the flex backend can run q (and v); windows and sinks are all supported."""
    return _supports_input(q, v)


_compiled: dict[str, object] = {}


def compiled_flex():
    """``torch.compile(flex_attention, dynamic=True)``, made once per process."""
    fn = _compiled.get("flex")
    if fn is None:
        fn = _compiled["flex"] = torch.compile(flex_attention, dynamic=True)
    return fn


FORCE_TRITON_BUILDER = False  # tests: run the Triton builder on CPU tensors (under TRITON_INTERPRET=1)


# The builder runs as one opaque custom op: eager torch ops on CPU (``block_tables``),
# four small Triton kernels on CUDA (``triton_block_tables``). Opaque, it traces
# under torch.compile with dynamic shapes without Inductor having to lower the
# builder, and it never recompiles: the kernels do not specialise on lengths.
@torch.library.custom_op("dualkv::flex_block_tables", mutates_args=())
def block_tables_op(table: torch.Tensor, num_tokens: int, max_seg_len: int, window: int = 0,
                    chunk: int = 0) -> list[torch.Tensor]:
    if (table.device.type == "cuda" or FORCE_TRITON_BUILDER) and triton_kernels() is not None:
        return list(triton_block_tables(table, num_tokens, max_seg_len, window, chunk))
    return list(block_tables(table, num_tokens, window=window, chunk=chunk))


@block_tables_op.register_fake
def _(table, num_tokens, max_seg_len, window=0, chunk=0):
    nb = (num_tokens + BLOCK - 1) // BLOCK
    i32 = dict(dtype=torch.int32)
    nums = [table.new_empty((1, 1, nb), **i32) for _ in range(4)]
    idxs = [table.new_empty((1, 1, nb, nb), **i32) for _ in range(4)]
    per_token = [table.new_empty((num_tokens,), **i32) for _ in range(3)]  # reach, depth, limit
    return [nums[0], idxs[0], nums[1], idxs[1], nums[2], idxs[2], nums[3], idxs[3], *per_token]


def block_mask(segs: Segments, num_tokens: int, *, builder: str = "op", window: int = 0,
               chunk: int = 0) -> "BlockMask":
    """The prefix-forest ``BlockMask`` of a packed stream of ``num_tokens`` tokens (no device sync).

    ``window`` / ``chunk`` (0: none): the sliding window and chunk size on
    token depth. ``builder="op"`` (default) runs ``dualkv::flex_block_tables``
    (Triton on CUDA); ``builder="torch"`` runs ``block_tables`` with eager
    torch ops.
    """
    if _IMPORT_ERROR is not None:
        raise RuntimeError(_IMPORT_ERROR)
    if builder not in ("op", "torch"):
        raise ValueError(f"builder must be 'op' or 'torch', got {builder!r}")
    table = segment_table(segs, num_tokens)
    if builder == "op":
        tables = block_tables_op(table, num_tokens, segs.max_seg_len, window, chunk)
    else:
        tables = block_tables(table, num_tokens, window=window, chunk=chunk)
    kv_num, kv_idx, fkv_num, fkv_idx, q_num, q_idx, fq_num, fq_idx, reach, depth, limit = tables
    # Without a window the plain mask_mod: no depth gathers in the partial blocks.
    mask_mod = windowed_mask_mod(reach, depth, limit) if window or chunk else tree_mask_mod(reach)
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
        mask_mod=mask_mod,
    )


# --------------------------------------------------------------------------- attention


def softcap_score_mod(softcap: float):
    """The ``score_mod`` of a logit softcap: ``softcap * tanh(score / softcap)`` (score already scaled)."""

    def capped(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    return capped


def _flex(q, k, v, bm, scale: float, return_lse: bool, softcap: Optional[float] = None):
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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segs: Segments, scale: Optional[float] = None,
              softcap: Optional[float] = None, window: int = 0, chunk: int = 0,
              sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Differentiable prefix-forest attention through FlexAttention; returns ``[1, Hq, T, Dv]``.

    ``window`` / ``chunk`` (0: none) narrow the mask on token depth; ``sinks``
    (None or ``[Hq]``) adds each head's sink logit to every row's denominator
    (``kernels.sinks.apply_sinks`` on FlexAttention's ``(out, lse)``), its
    gradient included. The backward is FlexAttention's fused backward (no
    recomputed forward), taking the lse's gradient where sinks are set.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    bm = block_mask(segs, q.shape[2], window=window, chunk=chunk)
    if sinks is None:
        out, _ = _flex(q, k, v, bm, scale, return_lse=False, softcap=softcap)
        return out
    out, lse = _flex(q, k, v, bm, scale, return_lse=True, softcap=softcap)
    out, _ = apply_sinks(out, lse, sinks)
    return out


def forward(q, k, v, segs: Segments, scale: float, softcap: float = 0.0, window: int = 0, chunk: int = 0):
    """Module protocol: ``(out, lse)``, lse float32 ``[1, Hq, T]`` in natural log."""
    bm = block_mask(segs, q.shape[2], window=window, chunk=chunk)
    with torch.no_grad():
        out, lse = _flex(q, k, v, bm, scale, return_lse=True, softcap=softcap)
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


def backward(dout, q, k, v, out, lse, segs: Segments, scale: float, deterministic: bool = False, softcap: float = 0.0,
             window: int = 0, chunk: int = 0):
    """Module protocol: ``(dq, dk, dv)`` of the attention whose saved stats are ``out``, ``lse``, by recomputing.

    FlexAttention's backward is reachable only through autograd, and the opaque
    op keeps no autograd graph between its forward and backward, so this path
    recomputes the sink-free ``(o, lse)`` under autograd (one extra forward;
    ``attention``, the default path of ``shared_prompt_attention``, avoids
    it) and takes its vector-Jacobian product at the saved, possibly
    sink-aware ``out`` and ``lse`` (the module docstring). FlexAttention's
    Triton backward uses no atomics, so it is deterministic.
    """
    bm = block_mask(segs, q.shape[2], window=window, chunk=chunk)
    with _autograd_reentered():
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        o, lse_now = _flex(qg, kg, vg, bm, scale, return_lse=True, softcap=softcap)
        gap = lse_now.detach().float() - lse.float()  # log w: 0 without sinks, < 0 with them
        w = torch.exp(gap)
        delta = (dout.float() * out.float()).sum(-1)  # rowsum(dO * out'), out' the saved output
        d_o = (dout.float() * w[..., None]).to(o.dtype)
        d_lse = (-torch.expm1(gap) * delta).to(lse_now.dtype)  # (1 - w) rowsum(dO * out'), no cancellation near w = 1
        dq, dk, dv = torch.autograd.grad((o, lse_now), (qg, kg, vg), (d_o, d_lse))
    return dq, dk, dv
