"""Tests of ``dualkv::linear_log_prob`` (chunked lm_head -> log_softmax -> gather) against the unfused reference.

Values and the gradients of hidden and weight on random inputs: rows read
several times (as ``prev_index`` reads a group's last shared token), one and
several gathered ids per token, chunks that do not divide T, one-row
chunks, each placement of the scalar op around the cast, and no cast. Also
``torch.library.opcheck``, argument validation, and one compile for two T
under ``torch.compile(dynamic=True)``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dualkv_compile.kernels.linear_log_prob import chunk_rows, linear_log_prob_reference
from dualkv_compile.ops.linear_log_prob import linear_log_prob, linear_log_prob_bwd, linear_log_prob_fwd

N, H, V = 9, 8, 37


@pytest.fixture(autouse=True, scope="module")
def _few_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def inputs(T=11, K=1, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) / 2).to(dtype).requires_grad_()
    rows = torch.randint(0, N, (T,), generator=g)
    rows[1:5] = 3  # one row read by several tokens
    index = torch.randint(0, V, (T, K), generator=g)
    weights = torch.randn(T, K, generator=g, dtype=torch.float64)  # the upstream gradient
    return hidden, weight, rows, index, weights


def value_and_grads(fn, hidden, weight, rows, index, weights, **post):
    out = fn(hidden, weight, rows, index, **post)
    d_hidden, d_weight = torch.autograd.grad((out.double() * weights).sum(), (hidden, weight))
    return out, d_hidden, d_weight


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# (scale, divide, scale_first, upcast): the scalar op before and after the cast, divide and multiply, no cast, no scale.
POSTS = [
    (0.7, True, True, True),
    (0.7, True, False, True),
    (1.3, False, True, True),
    (1.3, False, False, True),
    (0.7, True, True, False),
    (2.0, False, True, False),
    (1.0, False, True, True),
    (1.0, False, True, False),
]


def _post(p):
    return dict(zip(("scale", "divide", "scale_first", "upcast"), p))


# float64 without the cast only: the cast makes a float64 input a float32 computation (covered by float32).
CASES = [(torch.float64, p) for p in POSTS if not p[3]] + [(torch.float32, p) for p in POSTS]


@pytest.mark.parametrize("dtype, post", CASES, ids=str)
@pytest.mark.parametrize("K", [1, 3])
def test_matches_reference(dtype, post, K):
    post = _post(post)
    args = inputs(T=11, K=K, dtype=dtype)
    want = value_and_grads(linear_log_prob_reference, *args, **post)
    # Chunks of 4 rows (11 tokens: 4 + 4 + 3) and of 1 row.
    for rows_per_chunk in (4, 1):
        got = value_and_grads(linear_log_prob, *args, **post, chunk_bytes=rows_per_chunk * V * 4 + 3)
        assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape
        tol = 1e-6 if dtype == torch.float64 else 1e-5
        for name, a, b in zip(("value", "d_hidden", "d_weight"), got, want):
            assert rel(a, b) <= tol, (name, rel(a, b))
            assert a.dtype == b.dtype, name


@pytest.mark.parametrize("post", POSTS[:6], ids=str)
def test_bfloat16_close_to_float32(post):
    post = _post(post)
    hidden, weight, rows, index, weights = inputs(T=13, K=2, dtype=torch.bfloat16, seed=1)
    got = value_and_grads(linear_log_prob, hidden, weight, rows, index, weights, **post, chunk_bytes=5 * V * 4)
    assert got[0].dtype == (torch.float32 if post["upcast"] else torch.bfloat16)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    h32, w32 = (t.detach().float().requires_grad_() for t in (hidden, weight))
    want = value_and_grads(linear_log_prob_reference, h32, w32, rows, index, weights, **post)
    for name, a, b in zip(("value", "d_hidden", "d_weight"), got, want):
        assert rel(a, b) <= 1e-2, (name, rel(a, b))


def test_rounds_like_the_unfused_graph_in_bfloat16():
    """The scalar op before the cast rounds in bf16, after it in fp32: the op follows the graph, not a cleaner order."""
    hidden, weight, rows, index, _ = inputs(T=12, K=1, dtype=torch.bfloat16, seed=2)
    for scale_first in (True, False):
        post = dict(scale=0.7, divide=True, scale_first=scale_first, upcast=True)
        got = linear_log_prob(hidden, weight, rows, index, **post, chunk_bytes=5 * V * 4)
        want = linear_log_prob_reference(hidden, weight, rows, index, **post)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_grad_of_one_input_only():
    hidden, weight, rows, index, weights = inputs(T=7, K=2)
    weight.requires_grad_(False)
    out = linear_log_prob(hidden, weight, rows, index, scale=0.5, divide=True, upcast=False)
    (d_hidden,) = torch.autograd.grad((out * weights).sum(), hidden)
    ref = linear_log_prob_reference(hidden, weight, rows, index, scale=0.5, divide=True, upcast=False)
    (want,) = torch.autograd.grad((ref * weights).sum(), hidden)
    assert rel(d_hidden, want) <= 1e-10


def test_autocast_does_not_reach_inside():
    """The op computes in its inputs' dtypes (what its fake implementation promises), autocast or not."""
    hidden, weight, rows, index, weights = inputs(T=7, K=2, dtype=torch.float32)
    post = dict(scale=0.7, divide=True, upcast=False)
    want = value_and_grads(linear_log_prob, hidden, weight, rows, index, weights, **post)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = value_and_grads(linear_log_prob, hidden, weight, rows, index, weights, **post)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_chunk_rows():
    assert chunk_rows(1000, torch.float32, 4000 * 7 + 5) == 7
    assert chunk_rows(1000, torch.float64, 4000 * 7) == 3
    assert chunk_rows(151936, torch.float32, 1) == 1
    assert chunk_rows(151936, torch.float32, 1 << 30) == 1766


@pytest.mark.parametrize(
    "change, name",
    [
        (lambda a: {**a, "hidden": a["hidden"][0]}, "hidden"),
        (lambda a: {**a, "hidden": a["hidden"].long()}, "hidden"),
        (lambda a: {**a, "weight": a["weight"].float()}, "weight"),
        (lambda a: {**a, "weight": a["weight"][:, :3]}, "weight"),
        (lambda a: {**a, "rows": a["rows"].int()}, "rows"),
        (lambda a: {**a, "rows": a["rows"][None]}, "rows"),
        (lambda a: {**a, "index": a["index"][:, 0]}, "index"),
        (lambda a: {**a, "index": a["index"][:-1]}, "index"),
        (lambda a: {**a, "index": a["index"].int()}, "index"),
        (lambda a: {**a, "scale": 0.0}, "scale"),
        (lambda a: {**a, "scale": float("inf")}, "scale"),
        (lambda a: {**a, "chunk_bytes": 0}, "chunk_bytes"),
        (lambda a: {**a, "chunk_bytes": 1.5}, "chunk_bytes"),
    ],
)
def test_bad_inputs_raise(change, name):
    hidden, weight, rows, index, _ = inputs(T=6, K=2)
    args = change({"hidden": hidden.detach(), "weight": weight.detach(), "rows": rows, "index": index, "scale": 1.0, "chunk_bytes": 1 << 20})
    with pytest.raises(ValueError, match=f"^{name} "):
        linear_log_prob(args.pop("hidden"), args.pop("weight"), args.pop("rows"), args.pop("index"), **args)


def test_opcheck():
    hidden, weight, rows, index, weights = inputs(T=7, K=2)
    post = (0.7, True, True, True, 3 * V * 4)
    torch.library.opcheck(linear_log_prob_fwd, (hidden, weight, rows, index, *post))
    out, lse = linear_log_prob_fwd(hidden.detach(), weight.detach(), rows, index, *post)
    grad = weights.float()
    for need in ((True, True), (True, False), (False, True)):
        torch.library.opcheck(linear_log_prob_bwd, (grad, hidden.detach(), weight.detach(), rows, index, lse, *post, *need))


def test_compile_once_for_two_token_counts():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def loss(hidden, weight, rows, index, weights):
        out = linear_log_prob(hidden, weight, rows, index, scale=0.7, divide=True, chunk_bytes=4 * V * 4)
        return (out * weights).sum()

    compiled = torch.compile(loss, backend=counter, fullgraph=True, dynamic=True)
    for T, K in itertools.product((11, 17), (2,)):
        hidden, weight, rows, index, weights = inputs(T=T, K=K, dtype=torch.float32, seed=T)
        got = compiled(hidden, weight, rows, index, weights.float())
        got_grads = torch.autograd.grad(got, (hidden, weight))
        want = (linear_log_prob_reference(hidden, weight, rows, index, scale=0.7, divide=True) * weights).sum()
        want_grads = torch.autograd.grad(want, (hidden, weight))
        assert rel(got, want) <= 1e-5
        for a, b in zip(got_grads, want_grads):
            assert rel(a, b) <= 1e-5
    assert counter.frame_count == 1


@pytest.mark.parametrize("post", POSTS, ids=str)
@pytest.mark.parametrize("K", [1, 3])
def test_out_of_place_chunk_math_equals_in_place(post, K):
    """The chunk functions as CUDA compiles them (out of place, a select for K = 1) equal the in-place eager ones."""
    from dualkv_compile.kernels.linear_log_prob import chunk_log_probs, chunk_log_prob_grad

    scale, divide, scale_first, upcast = post
    g = torch.Generator().manual_seed(1)
    y = torch.randn(7, V, generator=g).bfloat16()
    index = torch.randint(0, V, (7, K), generator=g)
    up = torch.randn(7, K, generator=g)
    cd, out_dtype = torch.float32, (torch.float32 if upcast else torch.bfloat16)
    fwd = [chunk_log_probs(y.clone(), index, scale, divide, scale_first, upcast, cd, out_dtype, inplace) for inplace in (True, False)]
    for a, b in zip(*fwd):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    lse = fwd[0][1]
    grads = [chunk_log_prob_grad(y.clone(), up, lse, index, scale, divide, scale_first, upcast, cd, inplace) for inplace in (True, False)]
    assert grads[0].dtype == grads[1].dtype == torch.bfloat16
    torch.testing.assert_close(grads[0].float(), grads[1].float(), rtol=0, atol=0)
