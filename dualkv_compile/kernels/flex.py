"""FlexAttention backend: the packed stream's two-region mask as a BlockMask.

The BlockMask is built straight from the ``Segments`` tensors, never by
evaluating a mask over a ``T x T`` grid: for each 128-token query block the
key/value blocks it needs are found from the segments that meet the block,
with pure tensor ops whose sizes come from host ints (no device sync):

* a kv block that every query row of the block sees completely (inside the
  segment's prefix, or strictly below the rows in their own segment, or in the
  union of both where they touch) is a FULL block: the kernel runs it without
  evaluating ``mask_mod``;
* a kv block that some row sees in part is a partial block, masked by
  ``mask_mod``, which reads three per-token int32 tables (own segment start,
  prefix start, prefix end) at the query index;
* the last kv block of a stream whose length is not a multiple of 128 is never
  FULL (the kernels mask keys past the end themselves; we do not rely on it).

Several groups, ragged response lengths and segments shorter than a block are
all handled; a query block may meet any number of segments.

Autograd. ``attention`` (what ``shared_prompt_attention(backend="flex")``
calls) runs FlexAttention under autograd, so the backward is FlexAttention's
own fused backward kernel, and under an outer ``torch.compile`` the flex call is
traced like any other (AOTAutograd derives and Inductor fuses the backward).
The module protocol's ``backward`` (used when the opaque custom op
``dualkv::attention_bwd`` is called with ``backend="flex"``) has no saved
autograd graph to reuse: it re-enters autograd below the custom-op dispatch and
recomputes the forward, so it costs one extra forward.

Compilation. FlexAttention only runs fused kernels when compiled; the compiled
flex callable (dynamic shapes) is made once per process and cached at module
level. The block tables come from one opaque custom op,
``dualkv::flex_block_tables``: three small Triton kernels on CUDA (about 0.1 ms
at T = 64K, lengths not specialised), eager torch ops on CPU. Layout changes
(T, number of segments, lengths) recompile nothing.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Optional

import torch

from ..layout import Segments

log = logging.getLogger("dualkv_compile")

__all__ = ["supports", "forward", "backward", "attention", "block_mask", "block_tables", "block_tables_op", "segment_table", "BLOCK"]

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

BLOCK = 128  # BlockMask block size, queries and keys alike
_SENTINEL = 1 << 30  # start of the padding segment; beyond any token index

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supports(q: torch.Tensor) -> Optional[str]:
    """None if the flex backend can run ``q`` (forward and backward), else why not."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if q.device.type != "cuda":
        return f"FlexAttention needs a CUDA device (its backward has no CPU kernel); q is on {q.device.type}"
    if q.dtype not in _SUPPORTED_DTYPES:
        return f"dtype {q.dtype} is not supported (float16, bfloat16 or float32)"
    D = q.shape[-1]
    if D < 16 or D > 256 or D % 8:
        return f"head dim {D} is not supported (a multiple of 8 in [16, 256])"
    return None


# --------------------------------------------------------------------------- block tables


def segment_table(segs: Segments, num_tokens: int) -> torch.Tensor:
    """int32 ``[4, num_segments + 1]``: seg_start, seg_len, prefix_start, prefix_len, plus a sentinel.

    The sentinel column (a segment starting at 2**30, past any stream) keeps the
    table at least two columns wide and contiguous whatever the layout, so the
    traced builder sees no new size-1 or stride specialisation. (A constant,
    not ``num_tokens``: a symbolic pad value would specialise T under compile.)
    """
    table = torch.stack([segs.seg_start, segs.seg_len, segs.prefix_start, segs.prefix_len]).to(torch.int32)
    return torch.nn.functional.pad(table, (0, 1), value=_SENTINEL)


def block_tables(table: torch.Tensor, num_tokens: int, block: int = BLOCK) -> tuple[torch.Tensor, ...]:
    """The BlockMask index tensors and the per-token tables of the mask_mod.

    ``table`` is ``segment_table(segs, num_tokens)``.

    Returns ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
    q_num_blocks, q_indices, full_q_num_blocks, full_q_indices, own_start,
    pre_start, pre_end)``: the first eight with shapes ``[1, 1, NB]`` and
    ``[1, 1, NB, NB]`` (int32, NB = ceil(T / block)), the last three int32 ``[T]``.
    Pure tensor ops; every size comes from ``num_tokens``, ``block`` and the
    number of segments, so nothing waits on the device.
    """
    device = table.device
    T = num_tokens
    nseg = table.shape[1]  # segments + the sentinel, which no token belongs to
    NB = (T + block - 1) // block
    t = table.long()
    s = t[0]
    e = s + t[1]  # segment end (exclusive)
    p = t[2]
    pe = p + t[3]  # prefix end (exclusive)

    # Per token: its segment (segments are in stream order and cover the stream).
    tok = torch.arange(T, device=device)
    seg_of = (torch.searchsorted(s, tok, right=True) - 1).clamp_(0, nseg - 1)
    own_start = s[seg_of].int()
    pre_start = p[seg_of].int()
    pre_end = pe[seg_of].int()

    # Per query block: the contiguous run of segments [first, last] it meets.
    blk = torch.arange(NB, device=device)
    q_lo = blk * block
    q_hi = torch.clamp(q_lo + block, max=T) - 1  # last valid row
    first = seg_of[q_lo]
    last = seg_of[q_hi]
    count = last - first + 1
    incl = torch.cumsum(count, 0)
    excl = incl - count

    # (query block, segment) pairs, in block order. Their number is at most
    # NB + nseg - 1; we size for NB + nseg and mark the tail invalid.
    U = NB + nseg
    k = torch.arange(U, device=device)
    pair_blk = torch.searchsorted(incl, k, right=True)  # == NB past the last pair
    valid = pair_blk < NB
    pb = pair_blk.clamp(max=NB - 1)
    j = (first[pb] + k - excl[pb]).clamp_(0, nseg - 1)
    sj, ej, pj, pej = s[j], e[j], p[j], pe[j]
    rows_lo = torch.maximum(sj, q_lo[pb])[:, None]  # first row of segment j in the block
    rows_hi = (torch.minimum(ej, q_hi[pb] + 1) - 1)[:, None]  # last row
    sj, pj, pej = sj[:, None], pj[:, None], pej[:, None]

    k0 = (blk * block)[None, :]  # kv block's first key
    k1 = torch.clamp(k0 + block, max=T) - 1  # and last key
    complete = (k0 + block) <= T
    has_prefix = pej > pj
    # Some row of segment j in the block sees some key of the kv block.
    needed = ((k0 < pej) & (k1 >= pj) & has_prefix) | ((k1 >= sj) & (k0 <= rows_hi))
    # Every row of segment j in the block sees every key of the kv block:
    # inside the prefix, inside [segment start, first row], or inside their
    # union [prefix start, first row] when the prefix ends where the segment starts.
    in_prefix = (k0 >= pj) & (k1 < pej)
    in_own = (k0 >= sj) & (k1 <= rows_lo)
    in_union = (pej == sj) & (k0 >= pj) & (k1 <= rows_lo)
    full = (in_prefix | in_own | in_union) & complete

    row = torch.where(valid, pair_blk, NB)[:, None].expand(U, NB)
    need_count = torch.zeros(NB + 1, NB, dtype=torch.int32, device=device)
    need_count.scatter_add_(0, row, (needed & valid[:, None]).int())
    full_count = torch.zeros(NB + 1, NB, dtype=torch.int32, device=device)
    full_count.scatter_add_(0, row, (full & valid[:, None]).int())
    is_full = full_count[:NB] == count[:, None]
    is_partial = (need_count[:NB] > 0) & ~is_full

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Contiguous: the flex kernels read these tables assuming a unit last
        # stride (an argsort of a transposed matrix keeps the transposed strides).
        d = dense.to(torch.int32).contiguous()
        num = d.sum(-1, dtype=torch.int32)
        idx = torch.argsort(d, dim=-1, descending=True, stable=True).to(torch.int32).contiguous()
        return num[None, None], idx[None, None]

    kv_num, kv_idx = ordered(is_partial)
    fkv_num, fkv_idx = ordered(is_full)
    q_num, q_idx = ordered(is_partial.t())
    fq_num, fq_idx = ordered(is_full.t())
    return kv_num, kv_idx, fkv_num, fkv_idx, q_num, q_idx, fq_num, fq_idx, own_start, pre_start, pre_end


def _make_mask_mod(own_start: torch.Tensor, pre_start: torch.Tensor, pre_end: torch.Tensor):
    def two_region(b, h, q_idx, kv_idx):
        own = (kv_idx <= q_idx) & (kv_idx >= own_start[q_idx])
        prefix = (kv_idx >= pre_start[q_idx]) & (kv_idx < pre_end[q_idx])
        return own | prefix

    return two_region


_compiled: dict[str, object] = {}


def _compiled_flex():
    fn = _compiled.get("flex")
    if fn is None:
        fn = _compiled["flex"] = torch.compile(flex_attention, dynamic=True)
    return fn


# The builder runs as one opaque custom op: eager torch ops on CPU (``block_tables``),
# three small Triton kernels on CUDA (``_triton_block_tables``). Opaque, it traces
# under torch.compile with dynamic shapes without Inductor having to lower the
# builder, and it never recompiles: the kernels do not specialise on lengths.
@torch.library.custom_op("dualkv::flex_block_tables", mutates_args=())
def block_tables_op(table: torch.Tensor, num_tokens: int, max_seg_len: int) -> list[torch.Tensor]:
    if (table.device.type == "cuda" or _FORCE_TRITON) and _triton_kernels() is not None:
        return list(_triton_block_tables(table, num_tokens, max_seg_len))
    return list(block_tables(table, num_tokens))


_FORCE_TRITON = False  # tests: run the Triton builder on CPU tensors (under TRITON_INTERPRET=1)


@block_tables_op.register_fake
def _(table, num_tokens, max_seg_len):
    nb = (num_tokens + BLOCK - 1) // BLOCK
    i32 = dict(dtype=torch.int32)
    nums = [table.new_empty((1, 1, nb), **i32) for _ in range(4)]
    idxs = [table.new_empty((1, 1, nb, nb), **i32) for _ in range(4)]
    toks = [table.new_empty((num_tokens,), **i32) for _ in range(3)]
    return [nums[0], idxs[0], nums[1], idxs[1], nums[2], idxs[2], nums[3], idxs[3], *toks]


def block_mask(segs: Segments, num_tokens: int, *, builder: str = "op") -> "BlockMask":
    """The two-region ``BlockMask`` of a packed stream of ``num_tokens`` tokens (no device sync).

    ``builder="op"`` (default) runs ``dualkv::flex_block_tables`` (Triton on
    CUDA); ``builder="torch"`` runs ``block_tables`` with eager torch ops.
    """
    if _IMPORT_ERROR is not None:
        raise RuntimeError(_IMPORT_ERROR)
    if builder not in ("op", "torch"):
        raise ValueError(f"builder must be 'op' or 'torch', got {builder!r}")
    table = segment_table(segs, num_tokens)
    if builder == "op":
        tables = block_tables_op(table, num_tokens, segs.max_seg_len)
    else:
        tables = block_tables(table, num_tokens)
    kv_num, kv_idx, fkv_num, fkv_idx, q_num, q_idx, fq_num, fq_idx, own_start, pre_start, pre_end = tables
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
        mask_mod=_make_mask_mod(own_start, pre_start, pre_end),
    )


# --------------------------------------------------------------------------- Triton builder

_KERNELS: dict[str, object] = {}


def _triton_kernels():
    """The three jitted kernels, defined on first use (None when Triton is missing)."""
    if "k" in _KERNELS:
        return _KERNELS["k"]
    try:
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover
        _KERNELS["k"] = None
        return None

    @triton.jit(do_not_specialize=["T"])
    def tokens_kernel(seg_ptr, stride_seg, seg_id_ptr, own_ptr, pre_s_ptr, pre_e_ptr, T, CHUNK: tl.constexpr):
        # Program (segment j, chunk c): the per-token tables of the segment's tokens in chunk c.
        j = tl.program_id(0)
        c = tl.program_id(1)
        s = tl.load(seg_ptr + j)
        n = tl.load(seg_ptr + stride_seg + j)
        p = tl.load(seg_ptr + 2 * stride_seg + j)
        pe = p + tl.load(seg_ptr + 3 * stride_seg + j)
        within = c * CHUNK + tl.arange(0, CHUNK)
        t = s + within
        m = (within < n) & (t < T)
        zero = within * 0
        tl.store(seg_id_ptr + t, (zero + j).to(tl.int32), mask=m)
        tl.store(own_ptr + t, (zero + s).to(tl.int32), mask=m)
        tl.store(pre_s_ptr + t, (zero + p).to(tl.int32), mask=m)
        tl.store(pre_e_ptr + t, (zero + pe).to(tl.int32), mask=m)

    @triton.jit(do_not_specialize=["T", "NB"])
    def rows_kernel(seg_ptr, stride_seg, seg_id_ptr, flags_ptr, num_ptr, idx_ptr, fnum_ptr, fidx_ptr, T, NB,
                    BLOCK: tl.constexpr, CHUNK: tl.constexpr):
        # One program per query block: classify every kv block, compact the row.
        qb = tl.program_id(0)
        q_lo = qb * BLOCK
        q_hi = tl.minimum(q_lo + BLOCK, T) - 1
        first = tl.load(seg_id_ptr + q_lo)
        last = tl.load(seg_id_ptr + q_hi)
        n_part = first * 0
        n_full = first * 0
        row = qb.to(tl.int64) * NB
        for c in range(0, NB, CHUNK):
            kb = c + tl.arange(0, CHUNK)
            inb = kb < NB
            k0 = kb * BLOCK
            k1 = tl.minimum(k0 + BLOCK, T) - 1
            complete = (k0 + BLOCK) <= T
            need = kb < 0
            full = kb >= 0
            for j in range(first, last + 1):
                s = tl.load(seg_ptr + j)
                e = s + tl.load(seg_ptr + stride_seg + j)
                p = tl.load(seg_ptr + 2 * stride_seg + j)
                pe = p + tl.load(seg_ptr + 3 * stride_seg + j)
                rows_lo = tl.maximum(s, q_lo)
                rows_hi = tl.minimum(e, q_hi + 1) - 1
                need_j = ((k0 < pe) & (k1 >= p) & (pe > p)) | ((k1 >= s) & (k0 <= rows_hi))
                full_j = ((k0 >= p) & (k1 < pe)) | ((k0 >= s) & (k1 <= rows_lo)) | ((pe == s) & (k0 >= p) & (k1 <= rows_lo))
                need = need | need_j
                full = full & full_j
            # (!= 0: re-derive the booleans; the interpreter carries them as int32 through the loop)
            full = (full.to(tl.int32) != 0) & complete & inb
            part = (need.to(tl.int32) != 0) & (full.to(tl.int32) == 0) & inb
            tl.store(flags_ptr + row + kb, tl.where(full, 2, tl.where(part, 1, 0)).to(tl.int8), mask=inb)
            pi = part.to(tl.int32)
            fi = full.to(tl.int32)
            pc = tl.cumsum(pi, 0)
            fc = tl.cumsum(fi, 0)
            tl.store(idx_ptr + row + n_part + pc - 1, kb, mask=part)
            tl.store(fidx_ptr + row + n_full + fc - 1, kb, mask=full)
            n_part += tl.sum(pi, 0)
            n_full += tl.sum(fi, 0)
        tl.store(num_ptr + qb, n_part)
        tl.store(fnum_ptr + qb, n_full)

    @triton.jit(do_not_specialize=["NB"])
    def cols_kernel(flags_ptr, num_ptr, idx_ptr, fnum_ptr, fidx_ptr, NB, CHUNK: tl.constexpr):
        # One program per kv block: compact its column of the flags (the backward's tables).
        kb = tl.program_id(0)
        col = kb.to(tl.int64) * NB
        n_part = kb * 0
        n_full = kb * 0
        for c in range(0, NB, CHUNK):
            qb = c + tl.arange(0, CHUNK)
            inb = qb < NB
            f = tl.load(flags_ptr + qb.to(tl.int64) * NB + kb, mask=inb, other=0)
            part = f == 1
            full = f == 2
            pi = part.to(tl.int32)
            fi = full.to(tl.int32)
            pc = tl.cumsum(pi, 0)
            fc = tl.cumsum(fi, 0)
            tl.store(idx_ptr + col + n_part + pc - 1, qb, mask=part)
            tl.store(fidx_ptr + col + n_full + fc - 1, qb, mask=full)
            n_part += tl.sum(pi, 0)
            n_full += tl.sum(fi, 0)
        tl.store(num_ptr + kb, n_part)
        tl.store(fnum_ptr + kb, n_full)

    _KERNELS["k"] = (tokens_kernel, rows_kernel, cols_kernel)
    return _KERNELS["k"]


def _triton_block_tables(table: torch.Tensor, num_tokens: int, max_seg_len: int) -> tuple[torch.Tensor, ...]:
    """``block_tables`` computed by three Triton launches (the same tables; index rows equal within their counts).

    Every output is its own allocation: a custom op's outputs may not alias.
    """
    tokens_kernel, rows_kernel, cols_kernel = _triton_kernels()
    T = num_tokens
    NB = (T + BLOCK - 1) // BLOCK
    nseg = table.shape[1] - 1  # without the sentinel
    table = table.contiguous()
    dev = table.device
    i32 = dict(dtype=torch.int32, device=dev)
    seg_id, own, pre_s, pre_e = (torch.empty(T, **i32) for _ in range(4))
    flags = torch.empty(NB, NB, dtype=torch.int8, device=dev)
    nums = [torch.empty(1, 1, NB, **i32) for _ in range(4)]
    # zeros: entries past a row's count stay valid block indices (the kernels may prefetch them)
    idxs = [torch.zeros(1, 1, NB, NB, **i32) for _ in range(4)]
    chunk = 512 if NB > 256 else 256
    tok_chunk = 1024
    grid_tok = (nseg, max(1, (max_seg_len + tok_chunk - 1) // tok_chunk))
    tokens_kernel[grid_tok](table, table.stride(0), seg_id, own, pre_s, pre_e, T, CHUNK=tok_chunk)
    rows_kernel[(NB,)](table, table.stride(0), seg_id, flags, nums[0], idxs[0], nums[1], idxs[1], T, NB,
                       BLOCK=BLOCK, CHUNK=chunk)
    cols_kernel[(NB,)](flags, nums[2], idxs[2], nums[3], idxs[3], NB, CHUNK=chunk)
    return (nums[0], idxs[0], nums[1], idxs[1], nums[2], idxs[2], nums[3], idxs[3], own, pre_s, pre_e)


# --------------------------------------------------------------------------- attention


def _flex(q, k, v, bm, scale: float, return_lse: bool):
    fn = flex_attention if torch.compiler.is_compiling() else _compiled_flex()
    gqa = q.shape[1] != k.shape[1]
    if not return_lse:
        return fn(q, k, v, block_mask=bm, scale=scale, enable_gqa=gqa), None
    if AuxRequest is not None:
        out, aux = fn(q, k, v, block_mask=bm, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    return fn(q, k, v, block_mask=bm, scale=scale, enable_gqa=gqa, return_lse=True)  # pragma: no cover


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segs: Segments, scale: Optional[float] = None) -> torch.Tensor:
    """Differentiable two-region attention through FlexAttention; returns ``[1, Hq, T, D]``.

    The backward is FlexAttention's fused backward (no recomputed forward).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    bm = block_mask(segs, q.shape[2])
    out, _ = _flex(q, k, v, bm, scale, return_lse=False)
    return out


def forward(q, k, v, segs: Segments, scale: float):
    """Module protocol: ``(out, lse)``, lse float32 ``[1, Hq, T]`` in natural log."""
    bm = block_mask(segs, q.shape[2])
    with torch.no_grad():
        out, lse = _flex(q, k, v, bm, scale, return_lse=True)
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


def backward(dout, q, k, v, out, lse, segs: Segments, scale: float, deterministic: bool = False):
    """Module protocol: ``(dq, dk, dv)`` by recomputing the forward under autograd.

    FlexAttention's backward is reachable only through autograd, and the opaque
    op keeps no autograd graph between its forward and backward, so this path
    costs one extra forward; ``attention`` (the default path of
    ``shared_prompt_attention``) avoids it. ``out`` and ``lse`` are unused.
    FlexAttention's Triton backward uses no atomics, so it is deterministic.
    """
    bm = block_mask(segs, q.shape[2])
    with _autograd_reentered():
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        o, _ = _flex(qg, kg, vg, bm, scale, return_lse=False)
        dq, dk, dv = torch.autograd.grad(o, (qg, kg, vg), dout)
    return dq, dk, dv
