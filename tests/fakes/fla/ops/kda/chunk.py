"""flash-linear-attention's ``chunk_kda`` contract: the gated delta rule with a decay per key channel (g
``[B, T, HV, K]``), as ``gated_delta_rule.chunk`` otherwise (its math, its Function, its checks)."""

import torch

from ..gated_delta_rule.chunk import _Function


@torch.compiler.disable
def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, cu_seqlens=None, **kwargs):
    if use_gate_in_kernel:
        raise NotImplementedError("the stand-in takes the decay in log space only")
    if g.shape != v.shape[:3] + k.shape[3:]:
        raise ValueError("g must be [B, T, HV, K]")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError("The batch size is expected to be 1 when using `cu_seqlens`.")
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    o, ht = _Function.apply(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                            use_qk_l2norm_in_kernel)
    return o, (ht if output_final_state else None)
