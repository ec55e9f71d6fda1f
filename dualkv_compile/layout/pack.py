"""``pack`` and ``unpack``: move ``[B, S, ...]`` values to and from the packed ``[T, ...]`` stream of a layout.

Both are differentiable index maps: ``pack`` reads each node of the prefix
forest from its first sequence; ``unpack`` writes zeros at padding and its
backward sums the gradient of a shared token over every sequence that reads it.

``gather_valid`` (the gather under ``unpack`` and ``packed_ops.unpack_tokens``)
takes one of two equivalent forms by device. Both give the same values, and
the backward of both sums each row's gradients over the positions that read
it, padding positions contributing nothing. On CPU the sum runs in increasing
position order, deterministically, on every thread count, in a wider dtype than
the value's (float64 for float32, float32 for bf16 and fp16), rounded once at
the end; on CUDA it is ``index_select``'s backward, atomic adds in no fixed
order, in the same wider dtype, rounded once at the end. The CPU form is a
pair of ``torch.library`` ops, ``dualkv::gather_rows`` and its backward
``dualkv::gather_rows_bwd`` (fake implementations: they trace with symbolic
sizes and stay opaque to AOTAutograd and Inductor), which widen one column
chunk of the gradient at a time rather than a copy of all of it.
"""

from __future__ import annotations

import torch

from .shared_prompt import SharedPromptLayout

__all__ = ["pack", "unpack", "gather_valid", "gather_valid_indexed", "gather_rows", "gather_rows_bwd", "SUM_CHUNK_BYTES"]


# The dtype a gather's backward sums in, for each dtype it is given (both forms of ``gather_valid``). Complex
# values (a complex rotary's per-token values, should one be packed) sum their real and imaginary parts as wide.
_WIDER = {
    torch.float32: torch.float64, torch.bfloat16: torch.float32, torch.float16: torch.float32,
    torch.complex64: torch.complex128, torch.complex32: torch.complex64,
}


def pack(x: torch.Tensor, layout: SharedPromptLayout) -> torch.Tensor:
    """``[B, S, *rest]`` -> ``[T, *rest]``: each node of the prefix forest once, in pre-order."""
    B, S = layout.batch_size, layout.seq_len
    if x.dim() < 2 or x.shape[0] != B or x.shape[1] != S:
        raise ValueError(f"x must have shape [B, S, ...] with B={B}, S={S}, got {list(x.shape)}")
    return x.reshape(B * S, *x.shape[2:]).index_select(0, layout.pack_index)


def unpack(x: torch.Tensor, layout: SharedPromptLayout) -> torch.Tensor:
    """``[T, *rest]`` -> ``[B, S, *rest]``; zeros at padding; gradients of shared tokens summed over sequences."""
    T = layout.num_tokens
    if x.dim() < 1 or x.shape[0] != T:
        raise ValueError(f"x must have shape [T, ...] with T={T}, got {list(x.shape)}")
    if T == 0:  # every row empty: index_select cannot read from an empty axis
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    out = gather_valid(x, layout.unpack_index, layout.valid)
    return out.reshape(layout.batch_size, layout.seq_len, *x.shape[1:])


def gather_valid(x: torch.Tensor, index: torch.Tensor, keep: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``x.index_select(dim, index)`` with zeros where ``keep`` is False (padding positions).

    ``index`` and ``keep`` are 1-D of one length; ``index`` must be in range
    wherever ``keep`` is True (at padding it is not read on CPU).
    Differentiable: the backward sums the gradients of entries read more than
    once (a shared token read by every row of its group).
    """
    if x.device.type == "cpu":
        return _gather_valid_cpu(x, index, keep, dim)
    return gather_valid_indexed(x, index, keep, dim)


def gather_valid_indexed(x: torch.Tensor, index: torch.Tensor, keep: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``gather_valid``'s CUDA form, on any device: ``index_select``, then zeros at padding. Its backward is
    ``index_select``'s, an ``index_add``, run in the wider dtype of ``_WIDER`` and rounded once at the cast back.

    Why wider: a float32 ``index_add`` of a prompt token read by 2,048 rows rounds after each of its 2,048 atomic
    adds, many times the uncompiled model's float32 error (docs/benchmarks.md, "Behind the code"); in bf16 it
    would round to 8 bits each time. The casts are exact in the forward. Under Inductor both casts fuse into the gather and
    scatter kernels, so the wider copy that remains is the ``[T, ...]`` accumulator, not the ``[N, ...]`` gradient.
    """
    wide = x.to(_WIDER[x.dtype]) if x.dtype in _WIDER else x
    y = wide.index_select(dim, index)
    shape = [1] * y.dim()
    shape[dim] = -1
    return torch.where(keep.view(shape), y, y.new_zeros(())).to(x.dtype)


# Bytes of one column chunk of the backward's wide copy of the gradient (``N`` rows x some columns); a chunk has
# at least 16 columns, the fewest ATen's sorted ``scatter_add`` kernel takes (it sorts the index once per chunk).
# Read at each call (a test may set it small to run several chunks and a ragged last one).
SUM_CHUNK_BYTES = 4 << 20


def _gather_valid_cpu(x: torch.Tensor, index: torch.Tensor, keep: torch.Tensor, dim: int) -> torch.Tensor:
    """``gather_valid`` on CPU: ``dualkv::gather_rows`` on ``x`` with ``dim`` moved first and the trailing axes
    flattened; padding positions read an extra zero row after the last (so the forward needs no mask, and
    their gradients land in that row, which the backward drops).

    Why an opaque op pair: the backward must sum each row's gradients in position order in the wider dtype
    of ``_WIDER`` and round once (a float32 running sum of a prompt read by 2,048 rows is many times the
    uncompiled model's error), deterministically on every thread count. ``index_select``'s backward
    (``index_add``) is, under Inductor at two or more threads, a parallel loop of atomic adds in no fixed
    order. A ``gather`` of a float64 copy (whose ``scatter_add`` backward Inductor hands to ATen) has that
    order but casts the whole ``[N, ...]`` gradient to float64 first, and gathers ``[N, ...]`` in float64 in
    the forward, a large share of a CPU step (docs/benchmarks.md, "Behind the code"). Here the
    forward gathers in the value's dtype, and the backward, ``dualkv::gather_rows_bwd``, widens one column
    chunk of the gradient at a time (``SUM_CHUNK_BYTES``) and ``scatter_add_``s it into a wide
    ``[T + 1, chunk]`` buffer. ATen's kernel for an index expanded from one axis sorts the index stably and
    sums each row's positions in order, rows in parallel; for a chunk narrower than it takes (or a
    non-float dtype) the generic kernel loops over the positions in order for each column. Either way each
    row's gradient is the in-order sum in the wider dtype, rounded once at the cast back: the same bits on
    one thread or many, eager or compiled (both ops have fake implementations, so they
    trace with symbolic sizes and stay opaque to AOTAutograd and Inductor).
    """
    y = x.movedim(dim, 0)
    rows, rest = y.shape[0], y.shape[1:]
    flat = y.flatten(1) if y.dim() > 1 else y.unsqueeze(1)  # flatten, not reshape(rows, -1): rows may be 0
    out = gather_rows(flat, index.masked_fill(~keep, rows))
    return out.reshape(index.shape[0], *rest).movedim(0, dim)


@torch.library.custom_op("dualkv::gather_rows", mutates_args=())
def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``[T, F]``, ``[N]`` with values in ``[0, T]`` -> ``[N, F]``: row ``idx[n]`` of ``x``, zeros where it is ``T``."""
    return torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, idx)


@gather_rows.register_fake
def _(x, idx):
    return x.new_empty(idx.shape[0], x.shape[1])


@torch.library.custom_op("dualkv::gather_rows_bwd", mutates_args=())
def gather_rows_bwd(grad: torch.Tensor, idx: torch.Tensor, rows: int) -> torch.Tensor:
    """``gather_rows``' backward: ``[N, F]`` -> ``[rows, F]``, row ``t`` the sum over the positions ``n`` with
    ``idx[n] == t``, in increasing ``n``, in the wider dtype of ``_WIDER``, rounded once; ``idx == rows`` dropped."""
    n, f = grad.shape
    wide = _WIDER.get(grad.dtype, grad.dtype)
    out = grad.new_empty(rows, f)
    step = max(16, SUM_CHUNK_BYTES // max(1, n * wide.itemsize))
    for c in range(0, f, step):
        w = min(step, f - c)
        acc = torch.zeros(rows + 1, w, dtype=wide)  # contiguous, as ATen's sorted kernel requires
        acc.scatter_add_(0, idx.unsqueeze(1).expand(n, w), grad[:, c : c + w].to(wide).contiguous())
        out[:, c : c + w] = acc[:rows]
    return out


@gather_rows_bwd.register_fake
def _(grad, idx, rows):
    return grad.new_empty(rows, grad.shape[1])


def _gather_rows_setup(ctx, inputs, output):
    x, idx = inputs
    ctx.save_for_backward(idx)
    ctx.rows = x.shape[0]


def _gather_rows_backward(ctx, grad):
    (idx,) = ctx.saved_tensors
    return gather_rows_bwd(grad, idx, ctx.rows), None


def _gather_rows_bwd_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _gather_rows_bwd_backward(ctx, grad):  # a double backward: the sum's derivative is the gather again
    (idx,) = ctx.saved_tensors
    return gather_rows(grad, idx), None, None


gather_rows.register_autograd(_gather_rows_backward, setup_context=_gather_rows_setup)
gather_rows_bwd.register_autograd(_gather_rows_bwd_backward, setup_context=_gather_rows_bwd_setup)
