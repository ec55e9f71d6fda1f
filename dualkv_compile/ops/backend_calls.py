"""One attention backend's forward and backward with the op's extras: windows passed on, sinks applied around it.

Shared by the custom ops (``ops.attention``) and the eager path (``ops.eager_attention``), so both run the
same arithmetic. Windows go to the backend only when set (a backend without them keeps its old signature);
sinks are ``kernels.sinks`` around the backend's ``(out, lse)``, and the backward hands the backend the
sink-aware stats (see that module for why this is exact).
"""

from __future__ import annotations

from ..kernels.sinks import apply_sinks, sink_grad

__all__ = ["forward_with_sinks", "backward_with_stats"]


def forward_with_sinks(impl, q, k, v, segs, scale, softcap, window, chunk, sinks, lse_dt):
    """``(out, lse)`` of one backend, contiguous, with the sinks applied (the lse then includes them)."""
    kw = dict(window=window, chunk=chunk) if window or chunk else {}
    out, lse = impl.forward(q, k, v, segs, scale, softcap=softcap, **kw)
    lse = lse.to(lse_dt)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    return out.contiguous(), lse.to(lse_dt).contiguous()


def backward_with_stats(impl, dout, q, k, v, out, lse, segs, scale, deterministic, softcap, window, chunk, sinks):
    """``(dq, dk, dv, dsinks)``: the backend's backward at the saved (sink-aware) stats; dsinks empty without sinks."""
    kw = dict(window=window, chunk=chunk) if window or chunk else {}
    dq, dk, dv = impl.backward(dout, q, k, v, out, lse, segs, scale, deterministic=deterministic, softcap=softcap, **kw)
    dsinks = sink_grad(dout, out, lse, sinks) if sinks is not None else q.new_empty((0,))
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dsinks
