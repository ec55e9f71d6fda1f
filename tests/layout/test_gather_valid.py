"""Tests of dualkv_compile.layout.gather_valid against ``index_select`` + ``where``.

The reference is the plain form (today's CUDA path) and, for the gradient, a
per-row sum in increasing position order written here as a Python loop: the
CPU form must give the same values exactly and the same sums (the order is the
one its backward promises), on one thread and on two, each summed in a wider
dtype and rounded once: float64 for float32, float32 for bf16 and fp16.
"""

from __future__ import annotations

import pytest
import torch

from dualkv_compile.layout import gather_valid


def reference(x, index, keep, dim=0):
    y = x.index_select(dim, index)
    shape = [1] * y.dim()
    shape[dim] = -1
    return torch.where(keep.view(shape), y, y.new_zeros(()))


def ordered_grad(x_shape, dim, index, keep, g):
    """The gradient of ``gather_valid`` summed row by row in increasing position order, in a dtype wider than
    ``g``'s (float64 for float32, float32 for bf16 / fp16), rounded at the end."""
    acc = {torch.float32: torch.float64, torch.float64: torch.float64}.get(g.dtype, torch.float32)
    gm = g.movedim(dim, 0).to(acc)
    out = torch.zeros(x_shape[dim], *gm.shape[1:], dtype=acc)
    for p in range(index.numel()):
        if keep[p]:
            out[index[p]] += gm[p]
    return out.to(g.dtype).movedim(0, dim)


def case(gen, rows, mult_max, pad, rest, dim, dtype):
    """x with ``rows`` rows on axis ``dim``; each row read 0..mult_max times, ``pad`` padding positions, shuffled."""
    reads = []
    for r in range(rows):
        reads += [r] * int(torch.randint(0, mult_max + 1, (), generator=gen))
    index = torch.tensor(reads + [0] * pad, dtype=torch.long)
    keep = torch.tensor([True] * len(reads) + [False] * pad, dtype=torch.bool)
    if pad and rows:  # padding positions point anywhere in range, as a layout's unpack_index may
        index[len(reads):] = torch.randint(0, rows, (pad,), generator=gen)
    perm = torch.randperm(index.numel(), generator=gen)
    index, keep = index[perm], keep[perm]
    shape = list(rest)
    shape.insert(dim, rows)
    x = torch.randn(shape, generator=gen, dtype=dtype, requires_grad=True)
    return x, index, keep


CASES = [  # rows, mult_max, pad, rest, dim
    (7, 1, 0, (5,), 0),
    (7, 4, 3, (5,), 0),
    (9, 8, 5, (3, 32), 0),  # trailing size >= 16: ATen's sorted kernel for an expanded index
    (6, 3, 2, (4, 2), 1),
    (6, 3, 2, (4, 2), 2),
    (5, 3, 4, (), 0),  # 1-D x
    (1, 6, 1, (40,), 0),
    (0, 0, 4, (3,), 0),  # empty T: every position padding
    (0, 0, 0, (3,), 0),  # and nothing read
    (4, 0, 0, (33,), 0),  # rows nobody reads
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows,mult_max,pad,rest,dim", CASES)
def test_matches_index_select_where(threads, dtype, rows, mult_max, pad, rest, dim):
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(rows * 1000 + mult_max * 100 + pad * 10 + dim)
        x, index, keep = case(gen, rows, mult_max, pad, rest, dim, dtype)
        out = gather_valid(x, index, keep, dim)
        if rows:
            torch.testing.assert_close(out, reference(x, index, keep, dim), rtol=0, atol=0)
        else:
            assert out.shape == (*rest[:dim], index.numel(), *rest[dim:]) and not out.any()
        g = torch.randn(out.shape, generator=gen, dtype=dtype)
        g[(slice(None),) * dim + (~keep,)] = float("nan")  # padding's gradient must not leak
        (grad,) = torch.autograd.grad(out, x, g)
        expected = ordered_grad(x.shape, dim, index, keep, g)
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)  # same order, same dtypes: bit for bit
        if rows:
            (grad_ref,) = torch.autograd.grad(reference(x, index, keep, dim), x, g)
            tol = 1e-5 if dtype == torch.float32 else 1e-12
            torch.testing.assert_close(grad, grad_ref, rtol=tol, atol=tol)
        (again,) = torch.autograd.grad(gather_valid(x, index, keep, dim), x, g)
        assert torch.equal(again, grad)  # deterministic
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_sums_in_float32(threads, dtype):
    """Rows read up to 64 times: the bf16 / fp16 gradient is the float32 ordered sum rounded once."""
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(1)
        x, index, keep = case(gen, 12, 64, 7, (24,), 0, dtype)
        out = gather_valid(x, index, keep)
        torch.testing.assert_close(out, reference(x, index, keep), rtol=0, atol=0)
        g = torch.randn(out.shape, generator=gen).to(dtype)
        (grad,) = torch.autograd.grad(out, x, g)
        torch.testing.assert_close(grad, ordered_grad(x.shape, 0, index, keep, g), rtol=0, atol=0)
    finally:
        torch.set_num_threads(n)


def test_padding_reads_no_value():
    """A row read only at padding positions: zeros in the output even where it holds NaN."""
    x = torch.tensor([[1.0, 2.0], [float("nan"), float("inf")]], requires_grad=True)
    index, keep = torch.tensor([0, 1, 0]), torch.tensor([True, False, True])
    out = gather_valid(x, index, keep)
    assert torch.equal(out, torch.tensor([[1.0, 2.0], [0.0, 0.0], [1.0, 2.0]]))
    out.sum().backward()
    assert torch.equal(x.grad, torch.tensor([[2.0, 2.0], [0.0, 0.0]]))


@pytest.mark.parametrize(
    "dynamic,threads,dtype",
    [(False, 2, torch.float32), (True, 2, torch.float32), (False, 1, torch.bfloat16), (True, 2, torch.bfloat16)],
)
def test_compiled_matches_eager(dynamic, threads, dtype):
    """Through Inductor (at two threads its CPU scatter is ATen's kernel, at one its own loop), static and
    symbolic shapes: the values of the plain form, the gradient of the eager ordered sum."""
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch._dynamo.reset()
        gen = torch.Generator().manual_seed(0)
        fn = torch.compile(lambda x, i, k: gather_valid(x.movedim(0, 1), i, k, dim=1) * 2, dynamic=dynamic)
        for rows, pad in ((9, 3), (12, 5)):
            x, index, keep = case(gen, rows, 4, pad, (2, 24), 0, dtype)
            xc = x.detach().clone().requires_grad_()
            out = fn(xc, index, keep)
            ref = reference(x.movedim(0, 1), index, keep, dim=1) * 2
            torch.testing.assert_close(out, ref, rtol=0, atol=0)
            g = torch.randn(out.shape, generator=gen).to(dtype)
            out.backward(g)
            expected = ordered_grad(x.movedim(0, 1).shape, 1, index, keep, g * 2).movedim(1, 0)
            torch.testing.assert_close(xc.grad, expected, rtol=1e-6, atol=1e-6)
    finally:
        torch.set_num_threads(n)
        torch._dynamo.reset()


@pytest.mark.parametrize("threads", [1, 2])
def test_float32_sum_of_many_copies_is_rounded_once(threads):
    """One row read by 4,096 positions (a prompt token under 4,096 responses): its float32 gradient is the
    float64 sum rounded once, where a float32 running sum drifts by thousands of ulps (issue 35, defect 5)."""
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.zeros(2, 8, requires_grad=True)
        index, keep = torch.zeros(4096, dtype=torch.long), torch.ones(4096, dtype=torch.bool)
        g = torch.full((4096, 8), 0.1) + torch.linspace(0, 1e-3, 8)
        (grad,) = torch.autograd.grad(gather_valid(x, index, keep), x, g)
        truth = g.double().sum(0)
        assert torch.equal(grad[0], truth.float())
        running = torch.zeros(8)
        for row in g:  # what a float32 scatter_add in position order computes
            running += row
        assert (running.double() - truth).abs().max() > 1000 * (grad[0].double() - truth).abs().max().clamp_min(1e-12)
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("dtype, wide", [(torch.float32, torch.float64), (torch.bfloat16, torch.float32)])
def test_indexed_form_sums_many_copies_in_a_wider_dtype(dtype, wide):
    """``gather_valid_indexed`` (the CUDA form, run here on the CPU): a row read by 4,096 positions gets the sum of
    their gradients in the wider dtype rounded once, as the CPU form does. Before the fix its ``index_add`` summed in
    the value's dtype: in float32 the result drifted (45x plain's error on an H100, issue 35, defect 5). The bf16
    case held before too on the CPU, whose eager ``index_add`` accumulates bf16 in float32; CUDA's atomics do not."""
    from dualkv_compile.layout.pack import gather_valid_indexed

    x = torch.zeros(2, 8, dtype=dtype, requires_grad=True)
    index, keep = torch.zeros(4096, dtype=torch.long), torch.ones(4096, dtype=torch.bool)
    g = (torch.full((4096, 8), 0.1) + torch.linspace(0, 1e-3, 8)).to(dtype)
    (grad,) = torch.autograd.grad(gather_valid_indexed(x, index, keep), x, g)
    assert grad.dtype == dtype
    assert torch.equal(grad[0], g.to(torch.float64).sum(0).to(wide).to(dtype))
    assert torch.equal(grad[1], torch.zeros(8, dtype=dtype))


@pytest.mark.parametrize("form", ["cpu", "indexed"])
def test_complex64_sum_of_many_copies_is_rounded_once(form):
    """A complex64 row read by 4,096 positions (a complex rotary value shared by 4,096 responses): its gradient is
    the complex128 sum rounded once, in both forms, as float32's is the float64 sum (before: a complex64 running
    sum, off by hundreds of ulps)."""
    from dualkv_compile.layout.pack import gather_valid_indexed

    gather = gather_valid if form == "cpu" else gather_valid_indexed
    x = torch.zeros(2, 8, dtype=torch.complex64, requires_grad=True)
    index, keep = torch.zeros(4096, dtype=torch.long), torch.ones(4096, dtype=torch.bool)
    g = torch.complex(torch.full((4096, 8), 0.1) + torch.linspace(0, 1e-3, 8), torch.full((4096, 8), -0.3))
    (grad,) = torch.autograd.grad(gather(x, index, keep), x, g)
    assert grad.dtype == torch.complex64
    assert torch.equal(grad[0], g.to(torch.complex128).sum(0).to(torch.complex64))
    assert torch.equal(grad[1], torch.zeros(8, dtype=torch.complex64))


# The CPU form's ops, dualkv::gather_rows and dualkv::gather_rows_bwd (issue 35, defect 6): the backward widens one
# column chunk of the gradient at a time. SUM_CHUNK_BYTES = 1 makes every chunk the 16-column minimum, so 40 columns
# run as 16 + 16 + a ragged 8 (ATen's sorted kernel for the first two, its generic in-order loop for the last).

import importlib  # noqa: E402

from dualkv_compile.layout.pack import gather_rows, gather_rows_bwd  # noqa: E402

pack_module = importlib.import_module("dualkv_compile.layout.pack")


@pytest.mark.parametrize("chunk_bytes", [1, 16 * 9 * 8, 1 << 30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_backward_chunks_sum_like_one_chunk(monkeypatch, chunk_bytes, dtype):
    """Any chunking gives the ordered sum of the wider dtype, bit for bit; rows read up to 40 times."""
    monkeypatch.setattr(pack_module, "SUM_CHUNK_BYTES", chunk_bytes)
    gen = torch.Generator().manual_seed(3)
    x, index, keep = case(gen, 9, 40, 6, (5, 8), 1, dtype)  # 40 trailing columns after the movedim
    out = gather_valid(x, index, keep, 1)
    torch.testing.assert_close(out, reference(x, index, keep, 1), rtol=0, atol=0)
    g = torch.randn(out.shape, generator=gen).to(dtype)
    (grad,) = torch.autograd.grad(out, x, g)
    torch.testing.assert_close(grad, ordered_grad(x.shape, 1, index, keep, g), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("threads,dtype", [(2, torch.float32), (1, torch.float32), (2, torch.bfloat16)])
def test_ops_compiled_dynamic(monkeypatch, backend, threads, dtype):
    """Under torch.compile(dynamic=True) both ops stay opaque and trace once for every size: values exact, gradients
    the eager ordered sum bit for bit, with several column chunks and a ragged last one."""
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.setattr(pack_module, "SUM_CHUNK_BYTES", 1)
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        gen = torch.Generator().manual_seed(4)
        fn = torch.compile(lambda x, i, k: gather_valid(x.movedim(0, 1), i, k, dim=1) * 2, backend=counter, dynamic=True)
        for rows, pad in ((9, 3), (12, 5), (7, 2)):
            x, index, keep = case(gen, rows, 6, pad, (40,), 0, dtype)
            xc = x.detach().clone().requires_grad_()
            out = fn(xc.unflatten(1, (5, 8)), index, keep)
            ref = reference(x.unflatten(1, (5, 8)).movedim(0, 1), index, keep, dim=1) * 2
            torch.testing.assert_close(out, ref, rtol=0, atol=0)
            g = torch.randn(out.shape, generator=gen).to(dtype)
            out.backward(g)
            expected = ordered_grad((5, rows, 8), 1, index, keep, g * 2).movedim(1, 0).flatten(1)
            torch.testing.assert_close(xc.grad, expected, rtol=0, atol=0)
        assert counter.frame_count == 1  # symbolic sizes: no recompile
        targets = {str(node.target) for gm in counter.graphs for node in gm.graph.nodes}
        assert "dualkv.gather_rows.default" in targets, targets
        assert not any("gather" in t or "scatter" in t for t in targets - {"dualkv.gather_rows.default"}), targets
    finally:
        torch.set_num_threads(n)
        torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("rows,positions,pad", [(0, 4, 4), (0, 0, 0), (5, 0, 0), (3, 6, 6)])
def test_ops_compiled_empty(backend, rows, positions, pad):
    """T = 0 (every position padding, or none), N = 0 (nothing read), or only padding: zeros out, zeros back."""
    torch._dynamo.reset()
    try:
        x = torch.randn(rows, 20, requires_grad=True)
        index = torch.randint(0, max(rows, 1), (positions,))
        keep = torch.zeros(positions, dtype=torch.bool)
        keep[: positions - pad] = True
        fn = torch.compile(lambda x, i, k: gather_valid(x, i, k), backend=backend, dynamic=True)
        out = fn(x, index, keep)
        torch.testing.assert_close(out, reference(x, index, keep) if rows else torch.zeros(positions, 20), rtol=0, atol=0)
        g = torch.randn(out.shape)
        (grad,) = torch.autograd.grad(out, x, g)
        torch.testing.assert_close(grad, ordered_grad(x.shape, 0, index, keep, g), rtol=0, atol=0)
    finally:
        torch._dynamo.reset()


def test_opcheck_and_double_backward(monkeypatch):
    """torch.library.opcheck (schema, fake implementations, autograd registration, AOT with dynamic shapes) on both
    ops, and the double backward (the backward's own derivative is the gather) against gradgradcheck."""
    monkeypatch.setattr(pack_module, "SUM_CHUNK_BYTES", 1)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 40, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([0, 6, 3, 0, 5, 6, 0, 2])
    torch.library.opcheck(gather_rows, (x, idx))
    g = torch.randn(8, 40, generator=gen, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(gather_rows_bwd, (g, idx, 6))
    torch.library.opcheck(gather_rows_bwd, (g[:0], idx[:0], 0))
    assert torch.autograd.gradgradcheck(lambda x: gather_rows(x, idx), (x,))
