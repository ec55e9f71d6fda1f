"""The recurrent layers of hybrid models as the graphs call them, unpacked and on the packed forest.

``causal_conv1d(x, weight, bias)``: the short depthwise causal convolution of GDN, Mamba and LFM2 layers as one
call (``normalize.causal_conv`` writes it for transformers' ``conv1d(x, w, b, padding=K-1, groups=C)[..., :T]``):
the same two ops, so the unpacked program is unchanged. ``forest_causal_conv1d(x, weight, bias, prev_index)`` is
its packed form: the K-1 inputs before a token are read back along its path through the forest (``prev_index``,
``rewrite.packed_inputs``: a root's first token maps to itself, where the path ends and zeros follow), in torch
ops the packed graph's compiler traces.

``dualkv::forest_gated_delta_rule``: the packed form of ``dualkv::gated_delta_rule`` (``ops.recurrent``), each
segment's scan from its parent's final state: for a layer whose ``impl`` is a varlen kernel
(flash-linear-attention's, ``ops.recurrent.is_varlen_kernel``) that kernel, a launch per depth level
(``kernels.recurrent.gated_delta_varlen``), else the torch reference (``kernels.recurrent.forest_gated_delta_rule``,
the chunked form where the layer's is chunked). Opaque: its levels are built on the host. The backward is the
forward's autograd (the forward recomputed inside; nothing but the inputs saved), the children's state gradients
summed into their parent's final state. Exact against transformers' torch fallback and the varlen kernel run on
each sequence alone (tests/kernels/test_forest_recurrence, tests/kernels/test_gated_delta_varlen).
``dualkv::forest_mamba2_scan``: the packed form of ``dualkv::mamba2_chunk_scan`` the same way
(``kernels.recurrent.forest_mamba2_scan``), returned in the dtype transformers' scan returns;
``dualkv::forest_selective_scan`` likewise for ``dualkv::mamba_selective_scan`` (Mamba v1).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..kernels.recurrent import forest_gated_delta_rule as _forest_gdn
from ..kernels.recurrent import forest_mamba2_scan as _forest_mamba2
from ..kernels.recurrent.mamba1 import forest_selective_scan as _forest_mamba1
from ..kernels.recurrent.causal_conv import causal_conv1d_along_paths
from ..kernels.recurrent.gated_delta_varlen import forest_gated_delta_rule_varlen as _forest_gdn_varlen
from ..layout.segments import Segments
from .recurrent import autograd_vjp, grads_like, is_varlen_kernel, mamba1_out_dtype, mamba2_out_dtype
from .recurrent import recompute_autograd, resolve_impl, vjp_with_optional

__all__ = ["causal_conv1d", "forest_causal_conv1d", "forest_gated_delta_rule", "forest_mamba2_scan",
           "forest_selective_scan"]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.conv1d(x, weight, bias, padding=K-1, groups=C)[..., :T]`` for x ``[B, C, T]``, weight ``[C, 1, K]``."""
    K = weight.shape[-1]
    return F.conv1d(x, weight, bias, padding=K - 1, groups=x.shape[1])[..., : x.shape[-1]]


def forest_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         prev_index: torch.Tensor) -> torch.Tensor:
    """``causal_conv1d`` of each root-to-leaf sequence of the packed ``x [1, C, T]``, once per packed token."""
    return causal_conv1d_along_paths(x, weight.reshape(weight.shape[0], weight.shape[-1]), bias, prev_index)


def _segs(seg_start, seg_len, parent, prefix_len, subtree_end) -> Segments:
    return Segments(seg_start, seg_len, parent, prefix_len, subtree_end, 0, 0)


def _run(q, k, v, g, beta, segs, chunk_size: int, use_qk_l2norm: bool, impl: str):
    if is_varlen_kernel(impl):  # the layer's own kernel, a launch per depth level
        return _forest_gdn_varlen(resolve_impl(impl), q, k, v, g, beta, segs, use_qk_l2norm=use_qk_l2norm)
    return _forest_gdn(q, k, v, g, beta, segs, use_qk_l2norm=use_qk_l2norm,
                       chunk_size=None if chunk_size <= 0 else chunk_size)


@torch.library.custom_op("dualkv::forest_gated_delta_rule", mutates_args=())
def forest_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    seg_start: torch.Tensor, seg_len: torch.Tensor, parent: torch.Tensor, prefix_len: torch.Tensor,
    subtree_end: torch.Tensor, chunk_size: int, use_qk_l2norm: bool, impl: str,
) -> torch.Tensor:
    """The packed GDN core: q, k ``[1, T, Hk, Dk]``, v ``[1, T, Hv, Dv]``, g, beta ``[1, T, Hv]``; ``chunk_size``
    <= 0 steps token by token; ``impl`` the layer's (a varlen kernel's runs it, else the torch reference). Returns
    ``[1, T, Hv, Dv]`` in q's dtype, contiguous."""
    segs = _segs(seg_start, seg_len, parent, prefix_len, subtree_end)
    return _run(q, k, v, g, beta, segs, chunk_size, use_qk_l2norm, impl).contiguous()


@forest_gated_delta_rule.register_fake
def _(q, k, v, g, beta, seg_start, seg_len, parent, prefix_len, subtree_end, chunk_size, use_qk_l2norm, impl):
    return q.new_empty(tuple(v.shape[:2]) + (v.shape[2], v.shape[3]))


@torch.library.custom_op("dualkv::forest_gated_delta_rule_bwd", mutates_args=())
def forest_gated_delta_rule_bwd(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    seg_start: torch.Tensor, seg_len: torch.Tensor, parent: torch.Tensor, prefix_len: torch.Tensor,
    subtree_end: torch.Tensor, chunk_size: int, use_qk_l2norm: bool, impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k, v, g and beta: the forward's autograd, the forward recomputed."""
    segs = _segs(seg_start, seg_len, parent, prefix_len, subtree_end)

    def run(*xs):
        return _run(*xs, segs, chunk_size, use_qk_l2norm, impl)

    return autograd_vjp(run, (q, k, v, g, beta), (grad_out,))


@forest_gated_delta_rule_bwd.register_fake
def _(grad_out, q, k, v, g, beta, seg_start, seg_len, parent, prefix_len, subtree_end, chunk_size, use_qk_l2norm,
      impl):
    return grads_like((q, k, v, g, beta))


recompute_autograd(forest_gated_delta_rule, forest_gated_delta_rule_bwd, saved=10, grads=5)


def _run_mamba2(x, dt, A, B, C, D, dt_bias, segs, chunk_size: int, dt_softplus: bool, dt_min: float, dt_max: float):
    y = _forest_mamba2(x, dt, A, B, C, segs, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=(dt_min, dt_max),
                       chunk_size=None if chunk_size <= 0 else chunk_size)
    return y.to(mamba2_out_dtype(D))


@torch.library.custom_op("dualkv::forest_mamba2_scan", mutates_args=())
def forest_mamba2_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
    seg_start: torch.Tensor, seg_len: torch.Tensor, parent: torch.Tensor, prefix_len: torch.Tensor,
    subtree_end: torch.Tensor, chunk_size: int, dt_softplus: bool, dt_min: float, dt_max: float,
) -> torch.Tensor:
    """The packed Mamba-2 scan: x ``[1, T, H, P]``, dt ``[1, T, H]``, B, C ``[1, T, G, N]``, A, D, dt_bias ``[H]``;
    ``chunk_size`` <= 0 steps token by token. Returns ``[1, T, H, P]`` in ``mamba2_out_dtype(D)``, contiguous."""
    segs = _segs(seg_start, seg_len, parent, prefix_len, subtree_end)
    return _run_mamba2(x, dt, A, B, C, D, dt_bias, segs, chunk_size, dt_softplus, dt_min, dt_max).contiguous()


@forest_mamba2_scan.register_fake
def _(x, dt, A, B, C, D, dt_bias, seg_start, seg_len, parent, prefix_len, subtree_end, chunk_size, dt_softplus,
      dt_min, dt_max):
    return x.new_empty(x.shape, dtype=mamba2_out_dtype(D))


@torch.library.custom_op("dualkv::forest_mamba2_scan_bwd", mutates_args=())
def forest_mamba2_scan_bwd(
    grad_out: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
    seg_start: torch.Tensor, seg_len: torch.Tensor, parent: torch.Tensor, prefix_len: torch.Tensor,
    subtree_end: torch.Tensor, chunk_size: int, dt_softplus: bool, dt_min: float, dt_max: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of x, dt, A, B, C, D and dt_bias (empty for an absent one): the reference's autograd."""
    segs = _segs(seg_start, seg_len, parent, prefix_len, subtree_end)

    def run(*ts):
        return _run_mamba2(*ts, segs, chunk_size, dt_softplus, dt_min, dt_max)

    return vjp_with_optional(run, (x, dt, A, B, C, D, dt_bias), grad_out)


@forest_mamba2_scan_bwd.register_fake
def _(grad_out, x, dt, A, B, C, D, dt_bias, seg_start, seg_len, parent, prefix_len, subtree_end, chunk_size,
      dt_softplus, dt_min, dt_max):
    return grads_like((x, dt, A, B, C, D, dt_bias))


recompute_autograd(forest_mamba2_scan, forest_mamba2_scan_bwd, saved=12, grads=7)


def _run_mamba1(x, dt, A, B, C, D, z, delta_bias, segs, delta_softplus: bool):
    return _forest_mamba1(x, dt, A, B, C, segs, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)


@torch.library.custom_op("dualkv::forest_selective_scan", mutates_args=())
def forest_selective_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: Optional[torch.Tensor], z: Optional[torch.Tensor], delta_bias: Optional[torch.Tensor],
    seg_start: torch.Tensor, seg_len: torch.Tensor, parent: torch.Tensor, prefix_len: torch.Tensor,
    subtree_end: torch.Tensor, delta_softplus: bool,
) -> torch.Tensor:
    """The packed Mamba (v1) selective scan: x, dt, z ``[1, Dc, T]``, A ``[Dc, N]``, B, C ``[1, N, T]``, D,
    delta_bias ``[Dc]``. Returns ``[1, Dc, T]`` in ``mamba1_out_dtype``, contiguous."""
    segs = _segs(seg_start, seg_len, parent, prefix_len, subtree_end)
    return _run_mamba1(x, dt, A, B, C, D, z, delta_bias, segs, delta_softplus).contiguous()


@forest_selective_scan.register_fake
def _(x, dt, A, B, C, D, z, delta_bias, seg_start, seg_len, parent, prefix_len, subtree_end, delta_softplus):
    return x.new_empty(x.shape, dtype=mamba1_out_dtype(x, D, z))


@torch.library.custom_op("dualkv::forest_selective_scan_bwd", mutates_args=())
def forest_selective_scan_bwd(
    grad_out: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: Optional[torch.Tensor], z: Optional[torch.Tensor], delta_bias: Optional[torch.Tensor],
    seg_start: torch.Tensor, seg_len: torch.Tensor, parent: torch.Tensor, prefix_len: torch.Tensor,
    subtree_end: torch.Tensor, delta_softplus: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """The gradients of x, dt, A, B, C, D, z and delta_bias (empty for an absent one): the reference's autograd."""
    segs = _segs(seg_start, seg_len, parent, prefix_len, subtree_end)

    def run(*ts):
        return _run_mamba1(*ts, segs, delta_softplus)

    return vjp_with_optional(run, (x, dt, A, B, C, D, z, delta_bias), grad_out)


@forest_selective_scan_bwd.register_fake
def _(grad_out, x, dt, A, B, C, D, z, delta_bias, seg_start, seg_len, parent, prefix_len, subtree_end,
      delta_softplus):
    return grads_like((x, dt, A, B, C, D, z, delta_bias))


recompute_autograd(forest_selective_scan, forest_selective_scan_bwd, saved=13, grads=8)
