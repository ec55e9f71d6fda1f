"""What the Gluon kernels' partitions share: the walk over a query tile's key blocks, the loader, a fix-up.

    program_tile             this program's (segment, its start and end, first query row), from TILES
    kv_rings                 the K and V rings in shared memory and their ready / empty mbarriers
    walk_start / walk_step   the tile's blocks in order (ancestors' full blocks, own full blocks,
                             ancestors' ragged blocks, diagonal blocks): ``(start, limit)`` each
    loader                   the loader partition: the tile's query rows (and dO's, for dQ) once,
                             then K and V of every block into ``STAGES``-deep rings
    zero_rows_past           zero the rows of a shared-memory block past its segment

Assumes the Triton kernels' layout tables (``common/schedule.py``): ``WALK`` built for ``BLOCK_N``,
``SEG_START`` / ``SEG_LEN`` int32; descriptors as ``fwd.py`` says. Guarantees: the loader and the
consumers that call ``walk_step`` with the same arguments see the same blocks in the same order, so
no block list crosses between partitions; a slot is refilled only after both consumer warpgroups
released it (empty barriers count 2).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

__all__ = ["program_tile", "kv_rings", "walk_start", "walk_step", "loader", "zero_rows_past"]

# A barrier of the calling partition's warps: ``thread_barrier`` up to triton 3.8, ``barrier`` from 3.9.
_partition_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
# The copy engine's global-to-shared load: ``async_copy_global_to_shared`` up to 3.8, ``async_load`` from 3.9.
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared


@builtin
def _tma_add_36(tensor_desc, coord, src, _semantic=None):
    """Triton 3.6's Gluon has the copy engine's shared-to-global reduction in its IR but no Python name
    for it; this is that name (``tma.async_atomic_add`` from 3.9 on): add ``src`` into the block at
    ``coord``, one bulk operation, completed with the stores (``tma.store_wait``)."""
    from triton._C.libtriton import ir

    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


_tma_add = tma.async_atomic_add if hasattr(tma, "async_atomic_add") else _tma_add_36


# --------------------------------------------------------------------------- the program's tile and rings


@gluon.jit
def program_tile(TILES, num_tiles, SEG_START, SEG_LEN, BLOCK_M: gl.constexpr):
    """``(seg, seg_start, seg_end, m0)`` of program t = program_id(1); seg is -1 for the grid's padding
    (the caller returns then, before any partition starts)."""
    t = gl.program_id(1)
    seg = gl.load(TILES + t)
    tile = gl.load(TILES + num_tiles + t)
    segc = gl.maximum(seg, 0)
    seg_start = gl.load(SEG_START + segc)
    seg_end = seg_start + gl.load(SEG_LEN + segc)
    return seg, seg_start, seg_end, seg_start + tile * BLOCK_M


@gluon.jit
def kv_rings(k_desc, v_desc, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """The K and V rings, ``STAGES`` blocks each, with initialised ready (one arrive: the loader's
    expect) and empty (two arrives: one per consumer warpgroup) mbarriers per slot. The dK/dV kernel
    makes its q and dO rings with it too (the descriptors' block shapes)."""
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2)
        mbarrier.init(v_empty.index(s), count=2)
    return k_smem, v_smem, k_ready, v_ready, k_empty, v_empty


# --------------------------------------------------------------------------- the walk


@gluon.jit
def walk_start(seg, seg_start, seg_end, m0, SEG_START, SEG_LEN, WALK, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Per-tile counts of the four runs and the state of both ancestor chains."""
    walk = WALK + seg * 4
    n_af = gl.load(walk)
    diag_start = seg_start + ((m0 - seg_start) // BLOCK_N) * BLOCK_N
    n_of = (diag_start - seg_start) // BLOCK_N
    n_ar = gl.load(walk + 1)
    diag_end = gl.minimum(m0 + BLOCK_M, seg_end)
    n_d = (diag_end - diag_start + BLOCK_N - 1) // BLOCK_N
    # Chains: -1 (none) only appears once no block of that run is left; clamped to 0, it loads in bounds, unused.
    fa = gl.maximum(gl.load(walk + 2), 0)
    f_start = gl.load(SEG_START + fa)
    f_end = f_start + gl.load(SEG_LEN + fa)
    ra = gl.maximum(gl.load(walk + 3), 0)
    return n_af, n_of, n_ar, n_d, diag_start, fa, f_start, f_end, ra


@gluon.jit
def walk_step(i, n_af, n_of, n_ar, seg_start, seg_end, diag_start, fa, f_start, f_end, ra,
               SEG_START, SEG_LEN, WALK, BLOCK_N: gl.constexpr):
    """Block i of the tile's walk: ``(start, limit)`` and the chains' state for block i + 1.

    Written with selects, not branches: a branch around the consumer's wgmma accumulators
    makes ptxas serialise them (see ``triton/fwd.py``).
    """
    in_af = i < n_af
    b1 = n_af + n_of
    b2 = b1 + n_ar
    in_of = (i >= n_af) & (i < b1)
    in_ar = (i >= b1) & (i < b2)
    r_start = gl.load(SEG_START + ra)
    r_end = r_start + gl.load(SEG_LEN + ra)
    r_block = r_start + ((r_end - r_start) // BLOCK_N) * BLOCK_N
    start = gl.where(in_af, f_start,
                     gl.where(in_of, seg_start + (i - n_af) * BLOCK_N,
                              gl.where(in_ar, r_block, diag_start + (i - b2) * BLOCK_N)))
    limit = gl.where(in_af, f_end, gl.where(in_ar, r_end, seg_end))
    # Full-block chain: the next block of this ancestor if it is full, else the first block of
    # the nearest ancestor further up that has a full block.
    f_next = f_start + BLOCK_N
    moved = in_af & (f_next + BLOCK_N > f_end)
    fa = gl.where(moved, gl.maximum(gl.load(WALK + fa * 4 + 2), 0), fa)
    n_start = gl.load(SEG_START + fa)
    f_start = gl.where(moved, n_start, gl.where(in_af, f_next, f_start))
    f_end = gl.where(moved, n_start + gl.load(SEG_LEN + fa), f_end)
    ra = gl.where(in_ar, gl.maximum(gl.load(WALK + ra * 4 + 3), 0), ra)
    return start, limit, fa, f_start, f_end, ra


# --------------------------------------------------------------------------- the loader partition


@gluon.jit
def loader(a_desc, b_desc, k_desc, v_desc, a_smem, b_smem, k_smem, v_smem, rows_bar, k_ready, v_ready, k_empty, v_empty,
           a_row, a_col, b_row, b_col, k_row, k_col, v_row, v_col, seg, seg_start, seg_end, m0,
           SEG_START, SEG_LEN, WALK, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
           TWO_ROW_OPERANDS: gl.constexpr):
    """The loader partition: the tile's rows of ``a`` (q; and of ``b``, dO, with ``TWO_ROW_OPERANDS``)
    once on ``rows_bar``, then K and V of every block of the walk through the rings."""
    if TWO_ROW_OPERANDS:
        mbarrier.expect(rows_bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        _tma_load(a_desc, [a_row + m0, a_col], rows_bar, a_smem)
        _tma_load(b_desc, [b_row + m0, b_col], rows_bar, b_smem)
    else:
        mbarrier.expect(rows_bar, a_desc.block_type.nbytes)
        _tma_load(a_desc, [a_row + m0, a_col], rows_bar, a_smem)
    n_af, n_of, n_ar, n_d, diag_start, fa, f_start, f_end, ra = walk_start(
        seg, seg_start, seg_end, m0, SEG_START, SEG_LEN, WALK, BLOCK_M, BLOCK_N)
    for i in range(n_af + n_of + n_ar + n_d):
        start, limit, fa, f_start, f_end, ra = walk_step(
            i, n_af, n_of, n_ar, seg_start, seg_end, diag_start, fa, f_start, f_end, ra, SEG_START, SEG_LEN, WALK,
            BLOCK_N)
        st = i % STAGES
        ph = (i // STAGES) & 1
        # A slot is free once both consumers released it (a fresh barrier passes the parity-1 wait).
        mbarrier.wait(k_empty.index(st), ph ^ 1)
        mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
        _tma_load(k_desc, [k_row + start, k_col], k_ready.index(st), k_smem.index(st))
        mbarrier.wait(v_empty.index(st), ph ^ 1)
        mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
        _tma_load(v_desc, [v_row + start, v_col], v_ready.index(st), v_smem.index(st))


# --------------------------------------------------------------------------- fix-up


@gluon.jit
def zero_rows_past(view, start, limit, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Zero the rows of a key or value block at or past ``limit`` (another segment's), in shared memory.

    Both consumers do it (the same zeros), each fenced for the tensor cores and behind a barrier
    of its own warps before its products read the block.
    """
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    v = view.load(layout)
    r = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    v = gl.where((r < limit)[:, None], v, gl.zeros_like(v))
    view.store(v)
    fence_async_shared()
    _partition_barrier()
