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


# ---- dualkv::linear_log_prob_entropy: the log-probs and every row's entropy ----


def entropy_reference(hidden, weight, rows, index, scale=1.0, divide=False, scale_first=True, upcast=True):
    """The unfused computation in ordinary autograd ops: full logits, the post chain, log_softmax, -(p * logp).sum."""
    y = torch.nn.functional.linear(hidden, weight)

    def scaled(x):
        return x / scale if divide else x * scale

    y = scaled(y) if scale_first else y
    y = y.float() if upcast else y
    y = y if scale_first else scaled(y)
    logp = torch.log_softmax(y, dim=-1)
    return logp[rows.unsqueeze(-1), index], -(logp.exp() * logp).sum(-1)


def entropy_inputs(T=11, K=1, dtype=torch.float64, seed=0):
    hidden, weight, rows, index, weights = inputs(T=T, K=K, dtype=dtype, seed=seed)
    rows = rows.clone()
    rows[rows >= N - 2] = 0  # rows N-2 and N-1 are read by no output: their entropy alone reaches them
    ent_weights = torch.randn(N, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64)
    return hidden, weight, rows, index, weights, ent_weights


def entropy_value_and_grads(fn, hidden, weight, rows, index, weights, ent_weights, uses, **post):
    """(out, entropy, d_hidden, d_weight) of a loss reading ``uses``: the log-probs, the entropy or both."""
    out, ent = fn(hidden, weight, rows, index, **post)
    loss = 0
    if uses in ("both", "log_probs"):
        loss = loss + (out.double() * weights).sum()
    if uses in ("both", "entropy"):
        loss = loss + (ent.double() * ent_weights).sum()
    return (out, ent, *torch.autograd.grad(loss, (hidden, weight)))


@pytest.mark.parametrize("dtype, post", CASES, ids=str)
@pytest.mark.parametrize("uses", ["both", "log_probs", "entropy"])
def test_entropy_matches_reference(dtype, post, uses):
    from dualkv_compile.ops.linear_log_prob import linear_log_prob_entropy

    post = _post(post)
    args = entropy_inputs(T=11, K=3 if uses == "both" else 1, dtype=dtype)
    assert not set(range(N - 2, N)) & set(args[2].tolist())
    want = entropy_value_and_grads(entropy_reference, *args, uses, **post)
    # Chunks of 4 hidden rows (9 rows: 4 + 4 + 1), of 1 row, and all in one.
    for rows_per_chunk in (4, 1, 100):
        got = entropy_value_and_grads(linear_log_prob_entropy, *args, uses, **post, chunk_bytes=rows_per_chunk * V * 8 + 3)
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        for name, a, b in zip(("value", "entropy", "d_hidden", "d_weight"), got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
            assert rel(a, b) <= tol, (name, rows_per_chunk, rel(a, b))


@pytest.mark.parametrize("post", POSTS[:4], ids=str)
def test_entropy_bfloat16_close_to_float32(post):
    from dualkv_compile.ops.linear_log_prob import linear_log_prob_entropy

    post = _post(post)
    hidden, weight, rows, index, weights, ent_weights = entropy_inputs(T=13, K=2, dtype=torch.bfloat16, seed=1)
    got = entropy_value_and_grads(linear_log_prob_entropy, hidden, weight, rows, index, weights, ent_weights, "both", **post, chunk_bytes=5 * V * 4)
    assert got[0].dtype == got[1].dtype == torch.float32
    assert got[2].dtype == got[3].dtype == torch.bfloat16
    h32, w32 = (t.detach().float().requires_grad_() for t in (hidden, weight))
    want = entropy_value_and_grads(entropy_reference, h32, w32, rows, index, weights, ent_weights, "both", **post)
    for name, a, b in zip(("value", "entropy", "d_hidden", "d_weight"), got, want):
        assert rel(a, b) <= 1e-2, (name, rel(a, b))


def test_entropy_alone_and_log_probs_as_the_plain_op():
    """No rows to pick: the entropy alone, its gradient exact; with rows, the log-probs equal the plain op's."""
    from dualkv_compile.ops.linear_log_prob import linear_log_prob_entropy

    hidden, weight, rows, index, weights, ent_weights = entropy_inputs(T=7, K=2, dtype=torch.float64)
    post = dict(scale=0.7, divide=True, upcast=False)
    none, ent = linear_log_prob_entropy(hidden, weight, rows[:0], index[:0], **post, chunk_bytes=2 * V * 8)
    assert none.shape == (0, 2)
    _, want = entropy_reference(hidden, weight, rows[:0], index[:0], **post)
    assert rel(ent, want) <= 1e-12
    got_grads = torch.autograd.grad((ent * ent_weights).sum(), (hidden, weight))
    want_grads = torch.autograd.grad((want * ent_weights).sum(), (hidden, weight))
    for a, b in zip(got_grads, want_grads):
        assert rel(a, b) <= 1e-10
    out, _ = linear_log_prob_entropy(hidden, weight, rows, index, **post, chunk_bytes=2 * V * 8)
    plain = linear_log_prob(hidden, weight, rows, index, **post, chunk_bytes=2 * V * 8)
    assert rel(out, plain) <= 1e-14


def test_entropy_grad_of_one_input_only():
    from dualkv_compile.ops.linear_log_prob import linear_log_prob_entropy

    hidden, weight, rows, index, weights, ent_weights = entropy_inputs(T=7, K=2)
    hidden.requires_grad_(False)
    out, ent = linear_log_prob_entropy(hidden, weight, rows, index, scale=2.0, upcast=False, chunk_bytes=3 * V * 8)
    (got,) = torch.autograd.grad((out * weights).sum() + (ent * ent_weights).sum(), weight)
    ref_out, ref_ent = entropy_reference(hidden, weight, rows, index, scale=2.0, upcast=False)
    (want,) = torch.autograd.grad((ref_out * weights).sum() + (ref_ent * ent_weights).sum(), weight)
    assert rel(got, want) <= 1e-10


def test_entropy_opcheck():
    from dualkv_compile.ops.linear_log_prob import linear_log_prob_entropy_bwd, linear_log_prob_entropy_fwd

    hidden, weight, rows, index, weights, ent_weights = entropy_inputs(T=7, K=2, dtype=torch.float32)
    post = (0.7, True, True, True, 3 * V * 4)
    torch.library.opcheck(linear_log_prob_entropy_fwd, (hidden, weight, rows, index, *post))
    torch.library.opcheck(linear_log_prob_entropy_fwd, (hidden, weight, rows[:0], index[:0], *post))
    out, ent, lse = linear_log_prob_entropy_fwd(hidden.detach(), weight.detach(), rows, index, *post)
    assert ent.shape == lse.shape == (N,)
    grad, grad_ent = weights.float(), ent_weights.float()
    for g, ge in ((grad, grad_ent), (grad, None), (None, grad_ent), (None, None)):
        for need in ((True, True), (True, False), (False, True)):
            args = (g, ge, hidden.detach(), weight.detach(), rows, index, lse, ent, *post, *need)
            torch.library.opcheck(linear_log_prob_entropy_bwd, args)


def test_entropy_compile_once_for_two_token_counts():
    from torch._dynamo.testing import CompileCounterWithBackend

    from dualkv_compile.ops.linear_log_prob import linear_log_prob_entropy

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def loss(hidden, weight, rows, index, weights, ent_weights):
        out, ent = linear_log_prob_entropy(hidden, weight, rows, index, scale=0.7, divide=True, chunk_bytes=4 * V * 4)
        return (out * weights).sum() + (ent * ent_weights).sum()

    compiled = torch.compile(loss, backend=counter, fullgraph=True, dynamic=True)
    for T, n in ((11, N), (17, N + 4)):
        g = torch.Generator().manual_seed(T)
        hidden = torch.randn(n, H, generator=g).requires_grad_()
        weight = (torch.randn(V, H, generator=g) / 2).requires_grad_()
        rows, index = torch.randint(0, n, (T,), generator=g), torch.randint(0, V, (T, 2), generator=g)
        weights, ent_weights = torch.randn(T, 2, generator=g), torch.randn(n, generator=g)
        got = compiled(hidden, weight, rows, index, weights, ent_weights)
        got_grads = torch.autograd.grad(got, (hidden, weight))
        ref_out, ref_ent = entropy_reference(hidden, weight, rows, index, scale=0.7, divide=True)
        want = (ref_out * weights).sum() + (ref_ent * ent_weights).sum()
        want_grads = torch.autograd.grad(want, (hidden, weight))
        assert rel(got, want) <= 1e-5
        for a, b in zip(got_grads, want_grads):
            assert rel(a, b) <= 1e-5
    assert counter.frame_count == 1


@pytest.mark.parametrize("post", POSTS, ids=str)
def test_entropy_out_of_place_chunk_math_equals_in_place(post):
    """The entropy chunk functions as CUDA compiles them (out of place) equal the in-place eager ones."""
    from dualkv_compile.kernels.linear_log_prob_entropy import chunk_entropy, chunk_entropy_grad

    scale, divide, scale_first, upcast = post
    g = torch.Generator().manual_seed(2)
    y = torch.randn(7, V, generator=g).bfloat16()
    cd = torch.float32
    fwd = [chunk_entropy(y.clone(), scale, divide, scale_first, upcast, cd, inplace) for inplace in (True, False)]
    for a, b in zip(*fwd):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _, lse, ent = fwd[0]
    g_row, g_ent = torch.randn(7, generator=g), torch.randn(7, generator=g)
    flat_index = torch.randint(0, 7 * V, (5, 2), generator=g)
    g_flat = torch.randn(5, 2, generator=g)
    for terms in ((g_row, g_ent, flat_index, g_flat), (None, g_ent, None, None), (g_row, None, flat_index, g_flat)):
        grads = [chunk_entropy_grad(y.clone(), *terms[:2], lse, ent, *terms[2:], scale, divide, scale_first, upcast, cd, inplace) for inplace in (True, False)]
        assert grads[0].dtype == grads[1].dtype == torch.bfloat16
        torch.testing.assert_close(grads[0].float(), grads[1].float(), rtol=0, atol=0)
