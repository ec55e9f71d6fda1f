"""A Hugging Face attention implementation over torch's variable-length flash attention: the strongest baseline.

    import benchmarks.ops.varlen_attention  # registers it
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="torch_varlen")

What veRL and TRL run when FlashAttention is installed (``flash_attention_2``): the rows' valid tokens as
sequences of one varlen call, each causal within itself, no ``[T, T]`` mask, nothing computed at padding. No
FlashAttention-2 wheel exists for the GPU machine, so this calls ``torch.nn.attention.varlen.varlen_attn`` (CUDA
only) or FlashAttention-4 (``DUALKV_VARLEN_KERNEL``: by default FA4 where it is installed and runs); on a CPU it
loops over the sequences with causal SDPA (the same math, for tests).

Sequences come from, in this order: FlashAttention's ``cu_seq_lens_q`` and ``max_length_q`` keyword arguments
for one row (passed through the model's call, as veRL passes them; no host sync), one row (``B == 1``) whose
``position_ids`` restart at 0 (veRL's remove padding: every sequence back to back), or a ``[B, S]`` 0/1 attention mask (each row's valid tokens one sequence,
padding anywhere contiguous), or neither (each row one causal sequence). Anything else raises ``ValueError``
naming what was given. The mask function registered beside it is transformers' own for FlashAttention (``None``
or the 2-D mask), so no ``[B, 1, S, S]`` mask is built.
"""

from __future__ import annotations

import inspect
import os
from typing import Optional

import torch

NAME = "torch_varlen"
# The CUDA kernel: "torch" (``varlen_attn``), "fa4" (FlashAttention-4's ``flash_attn.cute.flash_attn_varlen_func``,
# installed from carried wheels: ``benchmarks/batches/fa4_wheels.sh``) or "auto" (the default: FA4 where it imports and the GPU
# is a Hopper or newer, else torch's; the strongest baseline is the fastest kernel that runs: on an H100 FA4 runs at
# 1.05-1.10 of cuDNN's efficiency, torch 2.11's varlen_attn at 0.57-0.59, benchmarks/results/fa4_rows/h100-2026-11-27),
# chosen by the environment so that every benchmark using this baseline can run any without a flag of its own. The
# CPU loop ignores it.
KERNELS = ("auto", "torch", "fa4")
CHOICE = os.environ.get("DUALKV_VARLEN_KERNEL", "auto")
if CHOICE not in KERNELS:
    raise ValueError(f"DUALKV_VARLEN_KERNEL: expected one of {', '.join(KERNELS)}, got {CHOICE!r}")


def _resolve(choice: str) -> str:
    """"fa4" or "torch": ``choice``, or for "auto" FA4 where ``flash_attn.cute`` imports and the current GPU is a
    Hopper or newer (FA4's kernels), else torch's."""
    if choice != "auto":
        return choice
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return "torch"
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or installed for another CUDA: torch's kernel
        return "torch"
    return "fa4"


# Resolved once, at import: a module constant to Dynamo (the attention reads it while traced; a CUDA query or an
# import inside the traced function would not be).
KERNEL = _resolve(CHOICE)


def kernel() -> str:
    """The CUDA kernel this process runs, "fa4" or "torch" (``DUALKV_VARLEN_KERNEL``, resolved at import)."""
    return KERNEL


def kernel_name() -> str:
    """The CUDA kernel this module runs (``kernel()``), as the benchmarks' reports name it."""
    return "FlashAttention-4" if kernel() == "fa4" else "torch varlen flash attention"


def _sequences(query: torch.Tensor, attention_mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
               cu_seqlens: Optional[torch.Tensor] = None, longest: Optional[int] = None):
    """``(token index [T] or None for every token, cu_seqlens [n + 1] int32, longest)``: the valid tokens of
    ``[B, S]`` in row-major order."""
    B, S = query.shape[0], query.shape[2]
    device = query.device
    if B == 1 and cu_seqlens is not None:  # given by the caller (FlashAttention's kwargs): no host sync here
        return None, cu_seqlens.to(torch.int32), int(longest)
    if B == 1 and attention_mask is None and position_ids is not None:
        pos = position_ids.reshape(-1)
        starts = torch.nonzero(pos == 0).flatten()
        if starts.numel() == 0 or int(starts[0]) != 0:
            raise ValueError("torch_varlen: position_ids of the one row must start each sequence at 0")
        cu = torch.cat([starts, torch.tensor([S], device=device)]).to(torch.int32)
        return None, cu, int((cu[1:] - cu[:-1]).max())
    if attention_mask is None:
        valid = torch.ones(B, S, dtype=torch.bool, device=device)
    elif attention_mask.dim() == 2 and attention_mask.shape == (B, S):
        valid = attention_mask.bool()
    else:
        raise ValueError(f"torch_varlen: expected no mask or a [B, S] = [{B}, {S}] 0/1 mask, got {tuple(attention_mask.shape)}")
    lens = valid.sum(1)
    index = torch.nonzero(valid.reshape(-1)).flatten()
    cu = torch.cat([torch.zeros(1, dtype=torch.long, device=device), lens.cumsum(0)]).to(torch.int32)
    return index, cu, int(lens.max())


try:  # torch >= 2.10; its keywords differ between releases, so they are read once here, not while tracing
    from torch.nn.attention.varlen import varlen_attn

    _PARAMS = inspect.signature(varlen_attn).parameters
    _CAUSAL = {"is_causal": True} if "is_causal" in _PARAMS else {"window_size": (-1, 0)}
    _GQA = "enable_gqa" in _PARAMS
except ImportError:
    varlen_attn = None


def _varlen_cuda(q, k, v, cu, longest, scale, cu_k=None, longest_k=None):
    """Tokens-first ``[T, H, D]`` sequences, causal. ``cu_k``/``longest_k``: the keys' bounds where a sequence has more
    keys than queries (its queries are its last keys: FlashAttention's window (-1, 0) aligns at the bottom right)."""
    if KERNEL == "fa4":
        return _varlen_fa4(q, k, v, cu, longest, scale, cu_k, longest_k)
    if varlen_attn is None:
        raise RuntimeError(f"torch_varlen: torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn")
    extra = dict(_CAUSAL)
    if k.shape[1] != q.shape[1]:
        if _GQA:
            extra["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(q, k, v, cu, cu if cu_k is None else cu_k, longest, longest if longest_k is None else longest_k,
                       scale=scale, **extra)


def _varlen_fa4(q, k, v, cu, longest, scale, cu_k=None, longest_k=None):
    """``_varlen_cuda`` through FlashAttention-4 (GQA native; causal aligned at the bottom right, as FlashAttention's)."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as e:
        raise RuntimeError(f"DUALKV_VARLEN_KERNEL=fa4 but flash_attn.cute does not import ({e}); "
                           "install the wheels of benchmarks/batches/fa4_wheels.sh") from e
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu if cu_k is None else cu_k,
                                 max_seqlen_q=longest, max_seqlen_k=longest if longest_k is None else longest_k,
                                 softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out


def _varlen_loop(q, k, v, cu, scale):
    rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            o = torch.nn.functional.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), k[s:e].repeat_interleave(rep, 1).transpose(0, 1),
                v[s:e].repeat_interleave(rep, 1).transpose(0, 1), is_causal=True, scale=scale)
            out[s:e] = o.transpose(0, 1)
    return out


def torch_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: ``query`` ``[B, Hq, S, D]``, ``key``/``value`` ``[B, Hkv, S, D]``;
    returns ``([B, S, Hq, D], None)``, zeros at padding."""
    if dropout:
        raise ValueError("torch_varlen: attention dropout is not supported (training runs it at 0 here)")
    B, Hq, S, D = query.shape
    index, cu, longest = _sequences(query, attention_mask, kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"),
                                    kwargs.get("max_length_q"))

    def tokens(x):
        flat = x.transpose(1, 2).reshape(B * S, x.shape[1], x.shape[-1])
        return flat if index is None else flat.index_select(0, index)

    q, k, v = tokens(query), tokens(key), tokens(value)
    o = (_varlen_cuda(q, k, v, cu, longest, scaling) if q.is_cuda else _varlen_loop(q, k, v, cu, scaling)).to(query.dtype)
    if index is not None:
        o = query.new_zeros(B * S, Hq, value.shape[-1]).index_copy(0, index, o)
    return o.reshape(B, S, Hq, value.shape[-1]), None


# A vision tower's attention (Qwen2-VL's family: each image, or each window of one, a sequence seen whole): the name
# holds "flash", so transformers hands it ``cu_seq_lens_q`` and calls it once a block instead of once a window.
VISION_NAME = "flash_torch_varlen_bidirectional"


def bidirectional_varlen_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                                   cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """``query``/``key``/``value`` ``[1, H, T, D]``, the sequences ``cu_seq_lens_q``, not causal; returns
    ``([1, T, H, D], None)``: ``varlen_attn`` on CUDA, a loop of SDPA calls on a CPU."""
    if dropout:
        raise ValueError(f"{VISION_NAME}: attention dropout is not supported")
    if cu_seq_lens_q is None or query.shape[0] != 1:
        raise ValueError(f"{VISION_NAME}: expected one row [1, H, T, D] and cu_seq_lens_q, got {tuple(query.shape)}")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    if q.is_cuda:
        if varlen_attn is None:
            raise RuntimeError(f"{VISION_NAME}: torch {torch.__version__} has no varlen_attn")
        whole = {"is_causal": False} if "is_causal" in _PARAMS else {"window_size": (-1, -1)}
        longest = int(max_length_q) if max_length_q is not None else int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
        o = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, longest, longest, scale=scaling, **whole)
    else:
        bounds = cu_seq_lens_q.tolist()
        o = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), scale=scaling).transpose(0, 1)
            for s, e in zip(bounds[:-1], bounds[1:])])
    return o.to(query.dtype)[None], None


def register() -> str:
    """Register the implementations and the mask function with transformers (idempotent); returns the causal one's
    name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(VISION_NAME, bidirectional_varlen_attention)
    AttentionInterface.register(NAME, torch_varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, flash_attention_mask)
    return NAME


register()
