"""flash-linear-attention's ``chunk_gated_delta_rule`` contract in plain torch, token by token.

As fla 0.6: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]`` (each q/k head serving HV // H consecutive value heads), g
(log decay) and beta ``[B, T, HV]``; ``cu_seqlens`` (batch 1) splits the tokens into sequences, ``initial_state``
``[N, HV, K, V]`` one per sequence; ``chunk_size`` only through ``**kwargs`` and only 16, 32 or 64; an
old-style ``autograd.Function`` (``forward(ctx, ...)``, which functorch refuses) behind ``torch.compiler.disable``.
Returns ``(o in q's dtype, final states in float32 (float64 for float64 inputs) or None)``.
"""

import torch


def _l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _sequence(q, k, v, g, beta, h, scale):
    """One sequence, ``[T, H, D]`` each (q, k already per value head; g ``[T, H]`` or ``[T, H, K]``), state
    ``[HV, K, V]``."""
    outs = []
    for t in range(q.shape[0]):
        h = h * (g[t].exp()[:, :, None] if g.dim() == 3 else g[t].exp()[:, None, None])  # per key channel (KDA)
        err = v[t] - torch.einsum("hkv,hk->hv", h, k[t])
        h = h + torch.einsum("hk,hv->hkv", k[t], err * beta[t][:, None])
        outs.append(torch.einsum("hkv,hk->hv", h, q[t] * scale))
    return torch.stack(outs) if outs else v[:0], h


def _forward(q, k, v, g, beta, scale, h0, cu_seqlens, use_qk_l2norm):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q, k = (x.repeat_interleave(HV // H, dim=2) for x in (q, k))
    bounds = [(b, 0, T) for b in range(B)] if cu_seqlens is None else [
        (0, int(s), int(e)) for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
    out = torch.zeros(B, T, HV, V, dtype=dtype, device=q.device)
    finals = []
    for n, (b, s, e) in enumerate(bounds):
        h = torch.zeros(HV, K, V, dtype=dtype, device=q.device) if h0 is None else h0[n].to(dtype)
        o, h = _sequence(q[b, s:e], k[b, s:e], v[b, s:e], g[b, s:e], beta[b, s:e], h, scale)
        out = out.index_put((torch.tensor([b]), torch.arange(s, e)), o) if e > s else out
        finals.append(h)
    return out, torch.stack(finals)  # float32, or float64 for float64 inputs (which fla itself does not take)


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, use_qk_l2norm):
        ctx.save_for_backward(q, k, v, g, beta, h0)
        ctx.args = (scale, cu_seqlens, use_qk_l2norm)
        o, ht = _forward(q, k, v, g, beta, scale, h0, cu_seqlens, use_qk_l2norm)
        return o.to(q.dtype), ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0 = ctx.saved_tensors
        scale, cu_seqlens, use_qk_l2norm = ctx.args
        with torch.enable_grad():
            xs = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
            s0 = None if h0 is None else h0.detach().requires_grad_()
            o, ht = _forward(*xs, scale, s0, cu_seqlens, use_qk_l2norm)
            wrt = xs + ([s0] if s0 is not None else [])
            grads = torch.autograd.grad([o, ht], wrt, [do, torch.zeros_like(ht) if dht is None else dht],
                                        allow_unused=True)
        dq, dk, dv, dg, db = grads[:5]
        return dq, dk, dv, dg, db, None, grads[5] if s0 is not None else None, None, None, None


@torch.compiler.disable
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    chunk_size = kwargs.pop("chunk_size", 64)
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk_size}.")
    if q.shape[2] != k.shape[2] or v.shape[2] % q.shape[2]:
        raise ValueError("q and k must have the same number of heads, and v a multiple of them")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError("The batch size is expected to be 1 when using `cu_seqlens`.")
    if cu_seqlens is not None and initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
        raise ValueError("one initial state per sequence")
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    o, ht = _Function.apply(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                            use_qk_l2norm_in_kernel)
    return o, (ht if output_final_state else None)
