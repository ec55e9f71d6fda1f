"""Tests of the dispatching op ``shared_prompt_attention`` (``dualkv::attention_fwd/bwd``) on CPU.

The reference backend is checked against two oracles written here: float64
autograd through ``F.scaled_dot_product_attention`` with a dense boolean mask
built by a per-token python loop, and the float64 reference kernel. The custom
ops go through ``torch.library.opcheck``; ``torch.compile`` must compile a
function using the op once for several layouts.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from dualkv_compile.ops import attention as op_mod
from dualkv_compile.kernels import reference
from dualkv_compile.ops.attention import attention_bwd, attention_fwd, resolve_backend, shared_prompt_attention
from dualkv_compile.layout import detect
from ..kernels.segments import make_segments  # the helper shared with tests/kernels


@pytest.fixture(autouse=True, scope="module")
def _few_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(min(n, 2))
    yield
    torch.set_num_threads(n)


def loop_mask(groups) -> torch.Tensor:
    """The packed stream's [T, T] mask, token by token (independent of layout.dense_mask)."""
    owners = []  # per token: (own segment start, prefix start, prefix end)
    off = 0
    for P, Rs in groups:
        prompt = off
        owners += [(prompt, prompt, prompt)] * P
        off += P
        for R in Rs:
            owners += [(off, prompt, prompt + P)] * R
            off += R
    T = len(owners)
    m = torch.zeros(T, T, dtype=torch.bool)
    for q, (s, ps, pe) in enumerate(owners):
        m[q, s : q + 1] = True
        m[q, ps:pe] = True
    return m


def qkv(T, hq=4, hkv=2, d=16, dtype=torch.float32, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, T, d, generator=g, dtype=dtype)
    k = torch.randn(1, hkv, T, d, generator=g, dtype=dtype)
    v = torch.randn(1, hkv, T, d, generator=g, dtype=dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def sdpa_masked(q, k, v, mask, scale=None):
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


LAYOUTS = [
    [(37, [11, 5, 20])],  # one group, ragged responses
    [(9, [1, 1, 30]), (20, [7]), (6, [])],  # several groups, one-token responses, a lone row
    [(64, [64, 64])],  # block-aligned
]


@pytest.mark.parametrize("groups", LAYOUTS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_forward_backward_match_float64_oracles(groups, heads):
    segs, T = make_segments(groups)
    hq, hkv = heads
    q, k, v = qkv(T, hq, hkv, requires_grad=True, seed=T + hq)
    scale = 0.3
    out = shared_prompt_attention(q, k, v, segs, scale=scale, backend="reference")
    assert out.shape == q.shape and out.dtype == q.dtype
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    # Oracle 1: float64 masked SDPA with a loop-built mask, differentiated by autograd.
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = sdpa_masked(q64, k64, v64, loop_mask(groups), scale=scale)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    assert rel(out, ref) < 1e-6
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape
        assert rel(g, r) < 1e-5

    # Oracle 2: the float64 reference kernel (forward and its hand-written backward).
    o2, lse2 = reference.reference_forward(q64.detach(), k64.detach(), v64.detach(), segs, scale)
    assert rel(out, o2) < 1e-6
    g2 = reference.reference_backward(dout.double(), q64.detach(), k64.detach(), v64.detach(), o2, lse2, segs, scale)
    for g, r in zip(grads, g2):
        assert rel(g, r) < 1e-5


def test_default_scale_and_layout_object():
    """A SharedPromptLayout from detect() works as the layout; scale defaults to 1/sqrt(D)."""
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 1, 2], [0, 5, 6, 7, 8, 3, 4, 9], [5, 6, 7, 8, 9, 9, 9, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    layout = detect(ids, mask, pos)
    T = layout.num_tokens
    q, k, v = qkv(T, 2, 2, d=9)
    out = shared_prompt_attention(q, k, v, layout)
    ref, _ = reference.attention_with_mask(q.double(), k.double(), v.double(), layout.dense_mask(), 1 / math.sqrt(9))
    assert rel(out, ref) < 1e-6


@pytest.mark.parametrize("backend", ["reference", "cpu_flash", "triton"])
@pytest.mark.parametrize("rows", [1, 3], ids=["single_row", "identical_rows"])
def test_one_segment_layout(backend, rows):
    """One row, or identical rows: the layout is one segment, whose four tensors must not share storage."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the triton backend runs on CPU only under TRITON_INTERPRET=1")
    layout = detect(torch.tensor([[3, 1, 4, 1, 5, 9, 2]] * rows))
    segs = layout.attention_segments
    assert layout.num_segments == 1
    assert len({t.untyped_storage().data_ptr() for t in segs[:4]}) == 4
    q, k, v = qkv(layout.num_tokens, 4, 2, requires_grad=True, seed=rows)
    out = shared_prompt_attention(q, k, v, layout, scale=0.3, backend=backend)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    # One causal segment: plain causal attention over the whole stream.
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = sdpa_masked(q64, k64, v64, torch.ones(7, 7, dtype=torch.bool).tril(), scale=0.3)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    assert rel(out, ref) < 1e-5
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) < 1e-4


def test_lse_is_natural_log_over_both_regions():
    groups = [(10, [4, 6])]
    segs, T = make_segments(groups)
    q, k, v = qkv(T, 2, 1)
    out, lse = attention_fwd(q, k, v, *segs, 0.5, 0.0, "reference")
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, T)
    scores = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * 0.5
    expect = torch.logsumexp(scores.masked_fill(~loop_mask(groups), float("-inf")), dim=-1)
    assert torch.allclose(lse.double(), expect, atol=1e-5)


# --------------------------------------------------------------------------- opcheck


def _op_args(seed=0):
    segs, T = make_segments([(13, [3, 9]), (5, [2])])
    q, k, v = qkv(T, 4, 2, d=8, requires_grad=True, seed=seed)
    return segs, (q, k, v, *segs, 0.35, 0.0, "reference")


def test_opcheck_attention_fwd():
    _, args = _op_args()
    torch.library.opcheck(attention_fwd, args)


def test_opcheck_attention_bwd():
    segs, args = _op_args(seed=1)
    q, k, v = (t.detach() for t in args[:3])
    out, lse = attention_fwd(q, k, v, *segs, 0.35, 0.0, "reference")
    dout = torch.randn_like(out)
    torch.library.opcheck(attention_bwd, (dout, q, k, v, out, lse, *segs, 0.35, 0.0, "reference", False))
    torch.library.opcheck(attention_bwd, (dout, q, k, v, out, lse, *segs, 0.35, 0.0, "reference", True))


# --------------------------------------------------------------------------- torch.compile


def test_compile_once_for_two_layouts():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def f(q, k, v, segs):
        return shared_prompt_attention(q, k, v, segs, scale=0.25).square().sum()

    cf = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    # Two layouts with different T, segment counts and maxima (none equal to a head count).
    for groups in ([(20, [7, 9, 3, 5, 11, 2, 4])], [(33, [12, 5]), (8, [3, 3, 6, 1, 2, 9, 9, 4, 1])]):
        segs, T = make_segments(groups)
        q, k, v = qkv(T, 4, 2, d=16, requires_grad=True, seed=T)
        loss = cf(q, k, v, segs)
        grads = torch.autograd.grad(loss, (q, k, v))
        q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
        loss2 = f(q2, k2, v2, segs)
        grads2 = torch.autograd.grad(loss2, (q2, k2, v2))
        assert torch.allclose(loss, loss2, rtol=1e-5)
        for a, b in zip(grads, grads2):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    assert counter.frame_count == 1


# --------------------------------------------------------------------------- the eager path


@pytest.mark.parametrize("backend", ["reference", "cpu_flash", "triton", "gluon"])
def test_eager_call_matches_the_custom_op_bitwise(backend):
    """Eagerly the op runs as ``EagerAttention`` (no custom-op wrapper); the same kernels, so the same bits.
    The GPU backends run on a GPU that takes them (bf16, head dim 64), else skip."""
    gpu = backend in ("triton", "gluon")
    device, dtype, d = ("cuda", torch.bfloat16, 64) if gpu else ("cpu", torch.float32, 16)
    if gpu and not torch.cuda.is_available():
        pytest.skip(f"backend={backend!r} runs on a CUDA GPU here")
    segs, T = make_segments([(9, [1, 1, 30]), (20, [7])], device=device)
    q, k, v = (t.to(device, dtype).requires_grad_() for t in qkv(T, 4, 2, d=d, seed=3))
    why = op_mod.unsupported_reason(backend, q, v)
    if why:
        pytest.skip(why)
    dout = torch.randn(1, 4, T, d, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    out = shared_prompt_attention(q, k, v, segs, scale=0.3, backend=backend)
    assert type(out.grad_fn).__name__ == "EagerAttentionBackward"
    grads = torch.autograd.grad(out, (q, k, v), dout)
    out2, _ = attention_fwd(q, k, v, *segs, 0.3, 0.0, backend)
    assert "EagerAttention" not in type(out2.grad_fn).__name__
    grads2 = torch.autograd.grad(out2, (q, k, v), dout)
    assert torch.equal(out, out2)
    for a, b in zip(grads, grads2):
        assert a.is_contiguous() and torch.equal(a, b)


def test_traced_calls_keep_the_custom_op():
    """make_fx (a dispatch mode) and functorch transforms see ``dualkv::attention_fwd``, never the eager Function."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dualkv_compile.ops import eager_attention

    segs, T = make_segments([(6, [3, 2])])
    q, k, v = qkv(T, 2, 1, d=8, seed=5)
    gm = make_fx(lambda q, k, v: shared_prompt_attention(q, k, v, segs, scale=0.5, backend="reference"))(q, k, v)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "dualkv.attention_fwd.default" in targets, targets

    seen = []

    def probe(q):  # under a functorch transform the custom op runs, as before this path existed
        seen.append(eager_attention.applies(q, k, v))
        return q.sum()

    torch.func.grad(probe)(q)
    assert seen == [False]


def test_eager_path_applies_only_to_plain_tensors_outside_modes():
    from torch.utils._python_dispatch import TorchDispatchMode

    from dualkv_compile.ops import eager_attention

    q, k, v = qkv(8)
    assert eager_attention.applies(q, k, v)
    assert eager_attention.applies(torch.nn.Parameter(q), k, v)

    class Sub(torch.Tensor):
        pass

    assert not eager_attention.applies(q.as_subclass(Sub), k, v)

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        assert not eager_attention.applies(q, k, v)
    with torch.device("cpu"):  # a torch-function mode
        assert not eager_attention.applies(q, k, v)
    assert eager_attention.applies(q, k, v)


# --------------------------------------------------------------------------- backend selection and errors


def test_auto_on_cpu_is_cpu_flash_or_reference():
    q, _, _ = qkv(8)
    assert resolve_backend("auto", q.float()) == "cpu_flash"
    assert resolve_backend("auto", q.double()) == "reference"  # float64 is the oracle's precision


@pytest.mark.parametrize("backend", ["flex", "triton"])
def test_gpu_backends_refuse_cpu(backend):
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 lets the triton backend run on CPU")
    segs, T = make_segments([(8, [4])])
    q, k, v = qkv(T)
    with pytest.raises(ValueError, match=f"backend='{backend}'"):
        shared_prompt_attention(q, k, v, segs, backend=backend)


@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 8), (torch.float64, 8), (torch.float32, 16)])
def test_triton_on_cpu_without_interpreter_names_the_device_first(monkeypatch, dtype, head_dim):
    """Not interpreted, a CPU input fails on its device, whatever its dtype and head dim."""
    pytest.importorskip("triton")
    from dualkv_compile.kernels.triton import fwd as triton_fwd  # noqa: F401 - compiled as the session set it, before the flag changes

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.zeros(1, 2, 4, head_dim, dtype=dtype)
    with pytest.raises(ValueError, match=r"backend='triton'.*needs a CUDA tensor.*TRITON_INTERPRET=1.*on cpu") as e:
        resolve_backend("triton", q)
    assert "head dim" not in str(e.value) and "dtype" not in str(e.value)


def test_triton_reasons_in_order_dtype_then_head_dim():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter to get past the device check on CPU")
    with pytest.raises(ValueError, match=r"dtype torch.int32") as e:
        resolve_backend("triton", torch.zeros(1, 2, 4, 8, dtype=torch.int32))
    assert "head dim" not in str(e.value)
    with pytest.raises(ValueError, match=r"head dim 8"):
        resolve_backend("triton", torch.zeros(1, 2, 4, 8))


@pytest.mark.parametrize("backend", ["cuda", "", None, "Reference"])
def test_unknown_backend(backend):
    segs, T = make_segments([(8, [4])])
    q, k, v = qkv(T)
    with pytest.raises(ValueError, match="backend must be one of"):
        shared_prompt_attention(q, k, v, segs, backend=backend)


def _bad(T):
    """(description, kwargs overrides, word the error must name)."""
    q, k, v = qkv(T, 4, 2, d=8)
    return [
        ("q 3-D", dict(q=q[0]), "q"),
        ("q batch 2", dict(q=q.expand(2, -1, -1, -1)), "q"),
        ("k wrong T", dict(k=k[:, :, :-1]), "k"),
        ("v wrong heads", dict(v=v[:, :1]), "v"),  # v may have its own head dim (MLA), not its own heads
        ("k head dim", dict(k=k[..., :4], v=v[..., :4]), "head dim"),
        ("heads not multiple", dict(q=torch.randn(1, 3, T, 8)), "heads"),
        ("dtype mix", dict(k=k.double()), "dtype"),
        ("not a tensor", dict(v=v.tolist()), "v"),
        ("int q", dict(q=q.long(), k=k.long(), v=v.long()), "q"),
        ("scale", dict(scale=-1.0), "scale"),
        ("scale nan", dict(scale=float("nan")), "scale"),
        ("layout", dict(layout=(1, 2)), "layout"),
    ]


@pytest.mark.parametrize("case", range(12))
def test_bad_arguments_raise_value_error_naming_them(case):
    segs, T = make_segments([(8, [4, 3])])
    q, k, v = qkv(T, 4, 2, d=8)
    desc, over, word = _bad(T)[case]
    args = dict(q=q, k=k, v=v, layout=segs, scale=None)
    args.update(over)
    with pytest.raises(ValueError, match=word):
        shared_prompt_attention(**args)


def test_layout_token_count_must_match_q():
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5]])
    layout = detect(ids)  # T = 5
    q, k, v = qkv(layout.num_tokens + 1)
    with pytest.raises(ValueError, match="q must have shape"):
        shared_prompt_attention(q, k, v, layout)


def test_segments_dtype_and_device_checked():
    segs, T = make_segments([(8, [4])])
    q, k, v = qkv(T)
    bad = segs._replace(seg_len=segs.seg_len.long())
    with pytest.raises(ValueError, match="layout.seg_len"):
        shared_prompt_attention(q, k, v, bad)
    bad = segs._replace(prefix_len=segs.prefix_len[:1])
    with pytest.raises(ValueError, match="layout.prefix_len"):
        shared_prompt_attention(q, k, v, bad)


def test_backend_names_are_exported():
    assert set(op_mod.BACKENDS) == {"auto", "reference", "cpu_flash", "flex", "triton", "gluon"}
