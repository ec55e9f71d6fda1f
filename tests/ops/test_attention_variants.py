"""The op ``shared_prompt_attention`` with Gemma 2's logit softcap and MLA head dims, on CPU.

The reference and cpu_flash backends go through the custom ops' forward and
backward under float64 gradcheck (the Triton kernels, too slow for it under
the interpreter, are compared with the reference in
tests/kernels/test_triton_variants.py); ``auto`` must carry the softcap to
whatever it picks. The flex path (FlexAttention's
``score_mod``) is traced under an outer ``torch.compile`` with its CPU device
check lifted, as in test_flex.py.
"""

from __future__ import annotations

import pytest
import torch

from dualkv_compile.kernels import reference
from dualkv_compile.ops import flex
from dualkv_compile.ops.attention import attention_bwd, attention_fwd, resolve_backend, shared_prompt_attention
from ..kernels.segments import forest_segments, make_segments

pytestmark = pytest.mark.usefixtures("one_thread")


def _qkv(T, D=8, Dv=8, hq=4, hkv=2, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, h, T, D, generator=g, dtype=dtype) for h in (hq, hkv))
    return 2 * q, k, torch.randn(1, hkv, T, Dv, generator=g, dtype=dtype)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("backend", ["reference", "cpu_flash"])
@pytest.mark.parametrize("D, Dv, softcap", [(8, 8, 1.5), (12, 8, 0.0), (12, 8, 1.5)])
def test_gradcheck_through_the_op(backend, D, Dv, softcap):
    segs, T = forest_segments([3, 2, 1, 0, 2], [-1, 0, 0, -1, 3])
    q, k, v = (t.requires_grad_() for t in _qkv(T, D, Dv, hq=2, hkv=1))

    def f(q, k, v):
        return shared_prompt_attention(q, k, v, segs, scale=0.7, backend=backend, softcap=softcap)

    assert f(q, k, v).shape == (1, 2, T, Dv)
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7)


def test_auto_carries_the_softcap():
    segs, T = make_segments([(9, [4, 6]), (3, [2])])
    q, k, v = _qkv(T, 16, 16, dtype=torch.float32)
    assert resolve_backend("auto", q, v) == "cpu_flash"
    out = shared_prompt_attention(q, k, v, segs, scale=0.3, softcap=1.0)
    capped, _ = reference.reference_forward(q.double(), k.double(), v.double(), segs, 0.3, 1.0)
    plain, _ = reference.reference_forward(q.double(), k.double(), v.double(), segs, 0.3)
    assert rel(out, capped) < 1e-5 and rel(out, plain) > 1e-2
    # None and 0 mean no cap.
    assert torch.equal(shared_prompt_attention(q, k, v, segs, scale=0.3, softcap=0),
                       shared_prompt_attention(q, k, v, segs, scale=0.3))


@pytest.mark.parametrize("softcap", [-1.0, float("nan"), float("inf"), True, "50"])
def test_bad_softcap_raises(softcap):
    segs, T = make_segments([(4, [2])])
    with pytest.raises(ValueError, match="softcap"):
        shared_prompt_attention(*_qkv(T), segs, softcap=softcap)


def test_opcheck_with_softcap_and_mla_head_dims():
    segs, T = make_segments([(7, [3, 5]), (4, [2])])
    q, k, v = (t.float().requires_grad_() for t in _qkv(T, 12, 8))
    for backend in ("reference", "cpu_flash"):
        torch.library.opcheck(attention_fwd, (q, k, v, *segs, 0.35, 2.0, backend))
        out, lse = attention_fwd(q.detach(), k.detach(), v.detach(), *segs, 0.35, 2.0, backend)
        assert out.shape == (1, 4, T, 8)
        dout = torch.randn_like(out)
        torch.library.opcheck(attention_bwd, (dout, q.detach(), k.detach(), v.detach(), out, lse, *segs, 0.35, 2.0,
                                              backend, False))


def test_flex_score_mod_and_mla_under_outer_compile(monkeypatch):
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    torch._dynamo.reset()
    segs, T = forest_segments([40, 20, 1, 30, 9], [-1, 0, 1, 0, -1])
    for Dv, softcap in ((16, 1.0), (24, 0.0)):
        q, k, v = (t.float().requires_grad_() for t in _qkv(T, 16, Dv, hq=4, hkv=2, seed=Dv))
        out = torch.compile(lambda *a: flex.attention(*a, segs, 0.2, softcap), backend="aot_eager", fullgraph=True)(q, k, v)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        x64 = [t.detach().double() for t in (q, k, v)]
        ro, _ = reference.reference_forward(*x64, segs, 0.2, softcap)
        rg = reference.reference_backward(dout.double(), *x64, None, None, segs, 0.2, softcap=softcap)
        assert out.shape == (1, 4, T, Dv) and rel(out, ro) < 1e-5
        for a, b in zip(grads, rg):
            assert rel(a, b) < 1e-5


def test_flex_supports_checks_v_head_dim():
    q = torch.zeros(1, 2, 8, 16, device="cuda" if torch.cuda.is_available() else "cpu")
    if q.device.type == "cpu":
        pytest.skip("flex refuses CPU tensors before their head dims")
    assert flex.supports(q, q[..., :12]) is not None and "v head dim 12" in flex.supports(q, q[..., :12])
