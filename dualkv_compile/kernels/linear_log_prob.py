"""``linear_log_prob``: next-token log-probs straight from the hidden states, never the full log-softmax.

The math of ``dualkv::linear_log_prob`` and ``_bwd`` (registered in ``ops/linear_log_prob.py``). For ``hidden
[N, H]``, ``weight [V, H]``, ``rows [T]`` and ``index [T, K]`` (int64):

    out[t, k] = log_softmax(post(linear(hidden[rows[t]], weight)))[index[t, k]]

``post`` is the scalar chain a policy loss puts between the lm_head and the log-softmax, in the graph's order and
dtypes: one multiply or divide by ``scale`` (``divide``; 1.0 is the identity), optionally a cast to float32
(``upcast``: the log-softmax and ``out`` are then float32, else in the logits' dtype), the scalar op before the
cast (``scale_first``: it rounds in the logits' dtype, as the graph does) or after it.

Memory: rows run in chunks of ``C`` tokens, ``C`` the rows of one ``[C, V]`` buffer in the compute dtype (float32,
float64 for float64 logits) that fit in ``chunk_bytes`` (at least 1): a few such buffers, never a ``[T, V]``
tensor. The forward saves its inputs and the per-token logsumexp, not the logits; the backward recomputes each
chunk's logits (one extra lm_head matmul). Gradients flow to ``hidden`` and ``weight``, accumulated across
chunks in float32 (float64 for float64 inputs) and cast to the inputs' dtypes at the end.
Assumed, not checked (a host sync): every ``rows`` entry is in ``[0, N)`` and every ``index`` entry in ``[0, V)``.
Numerics: the logits, the scalar op and the cast round as the unfused ops; the log-softmax and its gradient are
computed in the compute dtype as PyTorch's kernels compute them; tokens reading one row add their hidden-state
gradients in float32; on CPU each chunk's bf16/fp16 weight-gradient product is rounded to its dtype before it is
added (CUDA accumulates it in float32). ``linear_log_prob_entropy.py``: the same op with every row's entropy.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Optional

import torch
import torch.nn.functional as F

log = logging.getLogger("dualkv_compile")

__all__ = ["forward", "backward", "check_inputs", "dtypes", "no_autocast", "chunk_log_probs", "chunk_log_prob_grad", "linear_log_prob_reference", "DEFAULT_CHUNK_BYTES", "chunk_rows"]

DEFAULT_CHUNK_BYTES = 1 << 30


def _compute_dtype(softmax_dtype: torch.dtype) -> torch.dtype:
    """The dtype the softmax is computed (and the logsumexp kept) in: float64 stays, anything else is float32."""
    return torch.float64 if softmax_dtype == torch.float64 else torch.float32


def dtypes(hidden_dtype: torch.dtype, upcast: bool) -> tuple[torch.dtype, torch.dtype]:
    """(dtype of the log-softmax input and of ``out``, compute dtype)."""
    softmax_dtype = torch.float32 if upcast else hidden_dtype
    return softmax_dtype, _compute_dtype(softmax_dtype)


def chunk_rows(vocab: int, compute_dtype: torch.dtype, chunk_bytes: int) -> int:
    """Tokens per chunk: the rows of one ``[C, vocab]`` ``compute_dtype`` buffer within ``chunk_bytes``, at least 1."""
    row = max(vocab, 1) * compute_dtype.itemsize
    return max(1, chunk_bytes // row)


def check_inputs(hidden, weight, rows, index, scale, chunk_bytes) -> None:
    """Validate the arguments of ``linear_log_prob``; ``ValueError`` names the bad one."""
    for name, t, rank, what in (
        ("hidden", hidden, 2, "[N, H]"), ("weight", weight, 2, "[V, H]"),
        ("rows", rows, 1, "[T]"), ("index", index, 2, "[T, K]"),
    ):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor {what}, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must have shape {what}, got {list(t.shape)}")
    if not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden must be a floating-point tensor, got dtype {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight must have hidden's dtype {hidden.dtype} (the lm_head's matmul), got {weight.dtype}")
    for name, t in (("rows", rows), ("index", index)):
        if t.dtype != torch.int64:
            raise ValueError(f"{name} must be an int64 tensor, got dtype {t.dtype}")
    for name, t in (("weight", weight), ("rows", rows), ("index", index)):
        if t.device != hidden.device:
            raise ValueError(f"{name} must be on hidden's device {hidden.device}, got {t.device}")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must have shape [V, H] with H = hidden.shape[1] = {hidden.shape[1]}, got {list(weight.shape)}")
    if index.shape[0] != rows.shape[0]:
        raise ValueError(f"index must have one row per entry of rows ({rows.shape[0]}), got shape {list(index.shape)}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) or scale == 0:
        raise ValueError(f"scale must be a finite nonzero number, got {scale!r}")
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")


# Which fp32-output GEMMs of bf16/fp16 inputs (``out_dtype=``, CUDA only) failed here: (op, device type).
_NO_FP32_OUTPUT_GEMM: set[tuple[str, str]] = set()


def _fp32_output_gemm(name: str, a: torch.Tensor, acc_dtype: torch.dtype, gemm) -> Optional[torch.Tensor]:
    """``gemm()`` where ``a`` is a bf16/fp16 CUDA tensor and that GEMM works here, else None (the caller rounds)."""
    key = (name, a.device.type)
    if a.dtype == acc_dtype or not a.is_cuda or key in _NO_FP32_OUTPUT_GEMM:
        return None
    try:
        return gemm()
    except (TypeError, RuntimeError) as e:
        _NO_FP32_OUTPUT_GEMM.add(key)
        log.debug("linear_log_prob: no fp32-output %s on %s (%s); rounding each chunk's product", name, a.device.type, e)
        return None


def _mm(a: torch.Tensor, b: torch.Tensor, acc_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` in ``acc_dtype``: exact for same-dtype inputs, else the fp32-output GEMM or the rounded product."""
    out = _fp32_output_gemm("mm", a, acc_dtype, lambda: torch.mm(a, b, out_dtype=acc_dtype))
    return (a @ b).to(acc_dtype) if out is None else out


def _mm_accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` in float32/float64 and ``a``, ``b`` in the inputs' dtype.

    Never an fp32 matmul of upcast inputs (an order of magnitude slower on
    GPUs): same-dtype inputs use ``addmm_``; bf16/fp16 on CUDA the
    fp32-output GEMM, accumulating in place; elsewhere the product is
    rounded to the inputs' dtype, then added.
    """
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _fp32_output_gemm("addmm", a, acc.dtype, lambda: torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)) is None:
        acc.add_(a @ b)


def no_autocast(t: torch.Tensor):
    """Autocast off inside the op: it computes in its inputs' dtypes, which its fake implementation promises."""
    if torch.is_autocast_enabled(t.device.type):
        return torch.autocast(t.device.type, enabled=False)
    return contextlib.nullcontext()


def _scaled(x, scale, divide, inplace):
    if scale == 1.0:
        return x
    if inplace:  # the same kernel and rounding as out of place
        return x.div_(scale) if divide else x.mul_(scale)
    return x / scale if divide else x * scale


def _post(y, scale, divide, scale_first, upcast, inplace):
    """The scalar chain on one chunk's logits, rounded step by step as the unfused graph rounds it."""
    if scale_first:
        y = _scaled(y, scale, divide, inplace)
    if upcast:
        y = y.float()
    if not scale_first:
        y = _scaled(y, scale, divide, inplace)
    return y


# ``inplace``: the eager path works in the chunk's own [C, V] buffer (its lm_head output, which it owns);
# the compiled path (CUDA) is written out of place, which Inductor fuses without copying inputs back.


def chunk_log_probs(y, index, scale, divide, scale_first, upcast, cd: torch.dtype, out_dtype: torch.dtype, inplace: bool):
    """(out, lse) of one chunk from its raw lm_head output ``y`` [C, V]: the picked log-probs and the logsumexp."""
    y = _post(y, scale, divide, scale_first, upcast, inplace).to(cd)
    picked = y.gather(1, index)
    m = y.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row of -inf: no nan from -inf - -inf
    if inplace:
        log_sum = y.sub_(m).exp_().sum(dim=-1, keepdim=True).log_()
    else:
        log_sum = (y - m).exp().sum(dim=-1, keepdim=True).log()
    # (x - max) - log(sum), in that order, as the log_softmax kernels round it.
    return ((picked - m) - log_sum).to(out_dtype), (m + log_sum).squeeze(-1)


def chunk_log_prob_grad(y, g, lse, index, scale, divide, scale_first, upcast, cd: torch.dtype, inplace: bool):
    """The gradient of one chunk's raw lm_head output ``y`` [C, V] (its dtype) for upstream ``g`` [C, K]."""
    logits_dtype = y.dtype
    g = g.to(cd)
    # d log_softmax: scatter(g) - softmax * sum(g).
    d = _post(y, scale, divide, scale_first, upcast, inplace).to(cd)
    if inplace:
        d.sub_(lse[:, None]).exp_().mul_(-g.sum(dim=-1, keepdim=True))
        d.scatter_add_(1, index, g)
    else:
        d = (d - lse[:, None]).exp() * -g.sum(dim=-1, keepdim=True)
        if index.shape[1] == 1:
            # One id per token (the next token): a select instead of a scatter, so Inductor fuses it.
            column = torch.arange(d.shape[1], device=d.device)
            d = d + torch.where(column[None, :] == index, g, torch.zeros_like(g))
        else:
            d = d.scatter_add(1, index, g)
    return _post_grad(d, logits_dtype, scale, divide, scale_first, upcast, inplace)


def _post_grad(d, logits_dtype, scale, divide, scale_first, upcast, inplace):
    """Back through ``_post`` in reverse, each step in the dtype autograd would use; ``d`` in the compute dtype."""
    if upcast:
        if not scale_first:
            d = _scaled(d, scale, divide, inplace)
        d = d.to(logits_dtype)
        if scale_first:
            d = _scaled(d, scale, divide, inplace)
    else:
        d = _scaled(d.to(logits_dtype), scale, divide, inplace)
    return d


# On CUDA each chunk's softmax statistics and its gradient run as Inductor kernels: a few fused passes
# over the [C, V] logits instead of one eager kernel per op (about five passes over a float32 [C, V]
# buffer each way, ~15% of a 0.6B model's step at a 152K vocabulary). Elsewhere, and if compiling fails,
# the same functions run eagerly.
_COMPILED: dict = {}


def _chunk_fn(fn, device: torch.device):
    """(the function to run a chunk with, whether it may work in place)."""
    if device.type != "cuda" or _COMPILED.get(fn.__name__) is False:
        return fn, True
    if fn.__name__ not in _COMPILED:
        _COMPILED[fn.__name__] = torch.compile(fn, dynamic=True, fullgraph=True)
    compiled = _COMPILED[fn.__name__]

    def run(*args):
        try:
            return compiled(*args)
        except Exception as e:  # an Inductor failure costs speed, never the step
            log.warning("linear_log_prob: compiling %s failed (%s: %s); running it eagerly", fn.__name__, type(e).__name__, e)
            _COMPILED[fn.__name__] = False
            return fn(*args)

    return run, False


def forward(hidden, weight, rows, index, scale, divide, scale_first, upcast, chunk_bytes):
    out_dtype, cd = dtypes(hidden.dtype, upcast)
    T = rows.shape[0]
    out = torch.empty(index.shape, dtype=out_dtype, device=hidden.device)
    lse = torch.empty(T, dtype=cd, device=hidden.device)
    C = chunk_rows(weight.shape[0], cd, chunk_bytes)
    chunk_forward, inplace = _chunk_fn(chunk_log_probs, hidden.device)
    for t0 in range(0, T, C):
        t1 = min(t0 + C, T)
        y = F.linear(hidden.index_select(0, rows[t0:t1]), weight)
        out[t0:t1], lse[t0:t1] = chunk_forward(y, index[t0:t1], scale, divide, scale_first, upcast, cd, out_dtype, inplace)
        del y
    return out, lse


def backward(grad, hidden, weight, rows, index, lse, scale, divide, scale_first, upcast, chunk_bytes, need_hidden, need_weight):
    logits_dtype = hidden.dtype
    _, cd = dtypes(logits_dtype, upcast)
    acc_dtype = _compute_dtype(logits_dtype)
    T = rows.shape[0]
    d_hidden = torch.zeros(hidden.shape, dtype=acc_dtype, device=hidden.device) if need_hidden else None
    d_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_weight else None
    C = chunk_rows(weight.shape[0], cd, chunk_bytes)
    chunk_grad, inplace = _chunk_fn(chunk_log_prob_grad, hidden.device)
    for t0 in range(0, T, C):
        t1 = min(t0 + C, T)
        rows_c = rows[t0:t1]
        h = hidden.index_select(0, rows_c)
        d = chunk_grad(F.linear(h, weight), grad[t0:t1], lse[t0:t1], index[t0:t1], scale, divide, scale_first, upcast, cd, inplace)
        if need_hidden:
            d_hidden.index_add_(0, rows_c, _mm(d, weight, acc_dtype))
        if need_weight:
            _mm_accumulate(d_weight, d.t(), h)
        del d
    empty = hidden.new_empty(0)
    return (
        d_hidden.to(hidden.dtype) if need_hidden else empty,
        d_weight.to(weight.dtype) if need_weight else empty,
    )


def linear_log_prob_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    index: torch.Tensor,
    *,
    scale: float = 1.0,
    divide: bool = False,
    scale_first: bool = True,
    upcast: bool = True,
) -> torch.Tensor:
    """The unfused computation, ordinary autograd ops: the oracle of the tests (builds the full ``[N, V]``)."""
    y = F.linear(hidden, weight)

    def scaled(x):
        return x / scale if divide else x * scale

    if scale_first:
        y = scaled(y)
    if upcast:
        y = y.float()
    if not scale_first:
        y = scaled(y)
    return torch.log_softmax(y, dim=-1)[rows.unsqueeze(-1), index]
