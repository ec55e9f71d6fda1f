"""The backend that runs is the one named: Gluon refuses what its kernels do not run (a softcap), so "auto" names
Triton for it and a request for "gluon" is refused; an operand without a descriptor view is the one choice made
per call (``ops.attention.backend_for_call``). On the CPU: fake CUDA tensors (shape, dtype, device; no data) stand
in for a Hopper GPU's inputs, with the device's compute capability patched to 9.0.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dualkv_compile.kernels.gluon import attention as ga
from dualkv_compile.kernels.triton import attention as ta
from dualkv_compile.ops import attention as op


@pytest.fixture
def hopper_probe(monkeypatch):
    """A bf16 ``[1, 4, 1, 128]`` probe on a fake sm_90 GPU (the shape the compile-time resolution probes)."""
    monkeypatch.setattr(ga, "capability", lambda device: (9, 0))
    monkeypatch.setattr(ta, "capability", lambda device: (9, 0))
    with FakeTensorMode():
        q = torch.empty(1, 4, 1, 128, dtype=torch.bfloat16, device="cuda")
    why = ga.supports(q)
    if why is not None:  # e.g. a Triton without Gluon's Hopper API
        pytest.skip(why)
    return q


def test_gluon_refuses_a_softcap_and_auto_names_triton(hopper_probe):
    q = hopper_probe
    assert op.resolve_backend("auto", q, q) == "gluon"
    why = op.unsupported_reason("gluon", q, q, softcap=30.0)
    assert why is not None and "softcap" in why
    for name in ("triton", "flex", "reference"):
        assert op.unsupported_reason(name, q, q, softcap=30.0) is None, name
    assert op.resolve_backend("auto", q, q, softcap=30.0) == "triton"
    assert op.resolve_backend("auto", q, q, window=64, softcap=30.0) == "triton"  # windows and a softcap: Triton's
    assert op.resolve_backend("auto", q, q, window=64) == "triton"  # Gluon has no windows: Triton's (GPU-tested)
    with pytest.raises(ValueError, match=r"backend='gluon' cannot run this input: .*logit softcap"):
        op.resolve_backend("gluon", q, q, softcap=30.0)
    # The Gluon module runs its kernels or none: no Triton behind its back.
    with pytest.raises(ValueError, match=r"gluon attention cannot run this input: .*softcap"):
        ga.forward(q, q, q, None, 0.1, 30.0)
    with pytest.raises(ValueError, match=r"gluon attention cannot run this input: .*softcap"):
        ga.backward(q, q, q, q, q, None, None, 0.1, False, 30.0)


def test_operands_without_a_descriptor_view_run_the_triton_kernels_per_call():
    good = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    token_major = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16).transpose(1, 2)
    assert ga.operands_reason(q=good, k=token_major, v=good) is None
    assert op.backend_for_call("gluon", q=good, k=token_major, v=good) is ga
    one_token = torch.zeros(1, 2, 1, 64, dtype=torch.bfloat16)
    why = ga.operands_reason(q=one_token, k=one_token, v=one_token)
    assert why is not None and why.startswith("q ")
    assert op.backend_for_call("gluon", q=one_token, k=one_token, v=one_token) is ta
    skewed = torch.zeros(1, 2, 8, 65, dtype=torch.bfloat16)[..., 1:]  # rows not 16-byte aligned
    why = ga.operands_reason(q=good, dout=skewed, k=good, v=good)
    assert why is not None and why.startswith("dout ")
    assert op.backend_for_call("gluon", q=good, dout=skewed, k=good, v=good) is ta
    assert op.backend_for_call("triton", q=one_token, k=one_token, v=one_token) is ta  # only Gluon's choice
