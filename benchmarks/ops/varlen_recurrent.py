"""Remove padding for a hybrid's recurrent layers where no varlen kernel trains: the baseline's GDN and short conv.

    with varlen_recurrent.flat_forest(modeling_module):   # e.g. transformers.models.qwen3_5.modeling_qwen3_5
        model(input_ids=row, position_ids=..., cu_seq_lens_q=cu, cu_seq_lens_k=cu, ...)

A remove-padding row holds every sequence back to back; a GDN layer and its causal convolution must restart at each
sequence (transformers passes ``cu_seq_lens_q`` to both; their torch fallbacks ignore it, which is wrong across
sequence boundaries, and flash-linear-attention, which keeps them apart, does not train on every machine). Inside
the context the modeling module's ``torch_chunk_gated_delta_rule`` and ``causal_conv1d_fn`` are replaced by
functions that run dualkv's forest ops on the *flat* forest, each sequence its own root: the same torch kernels the
packed run uses on that machine, so the comparison measures the sharing, not a kernel. Both raise ``ValueError``
without ``cu_seq_lens_q`` (a row they cannot split), and leave the module as it was on exit.
"""

from __future__ import annotations

import contextlib

import torch

import dualkv_compile.ops.forest_recurrent  # noqa: F401  (registers dualkv::forest_gated_delta_rule)
from dualkv_compile.kernels.recurrent.causal_conv import causal_conv1d_along_paths
from dualkv_compile.layout.segments import Segments, previous_token_index

GDN, CONV = "torch_chunk_gated_delta_rule", "causal_conv1d_fn"


def _cu(kwargs: dict, what: str) -> torch.Tensor:
    cu = kwargs.get("cu_seq_lens_q", kwargs.get("cu_seqlens"))
    if cu is None:
        raise ValueError(f"varlen_recurrent.{what}: expected cu_seq_lens_q (the row's sequence boundaries), got none")
    return cu


def _flat(cu: torch.Tensor):
    """seg_start, seg_len, parent, prefix_len, subtree_end of each sequence as a root (``layout.segments``)."""
    cu = cu.to(torch.int32)
    n = cu.numel() - 1
    return cu[:-1], cu[1:] - cu[:-1], cu.new_full((n,), -1), cu.new_zeros(n), cu[1:]


def gated_delta_rule(impl: str):
    """transformers' ``torch_chunk_gated_delta_rule`` signature over ``dualkv::forest_gated_delta_rule``'s flat
    forest; ``impl`` the fallback's name (the op's torch reference). No initial or final state (training)."""

    def run(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        if initial_state is not None or output_final_state:
            raise ValueError("varlen_recurrent.gated_delta_rule: expected no initial_state and no final state "
                             "(a training forward)")
        if query.shape[0] != 1:
            raise ValueError(f"varlen_recurrent.gated_delta_rule: expected one row, got batch {query.shape[0]}")
        cu = _cu(dict(kwargs, cu_seqlens=cu_seqlens), "gated_delta_rule")
        out = torch.ops.dualkv.forest_gated_delta_rule(query, key, value, g, beta, *_flat(cu), int(chunk_size),
                                                       bool(use_qk_l2norm_in_kernel), impl)
        return out, None

    return run


def causal_conv1d(hidden_states, weight, bias=None, activation=None, **kwargs):
    """transformers' ``causal_conv1d_fn`` (x ``[1, C, T]``, weight ``[C, K]``) restarting at each sequence."""
    segs = Segments(*_flat(_cu(kwargs, "causal_conv1d")), 0, 0)
    prev = previous_token_index(segs, hidden_states.shape[-1])  # a root's first token maps to itself: zeros before
    return causal_conv1d_along_paths(hidden_states, weight.reshape(weight.shape[0], -1), bias, prev, activation)


@contextlib.contextmanager
def flat_forest(module):
    """``module``'s GDN and conv functions replaced (module docstring) while inside."""
    saved = {name: vars(module)[name] for name in (GDN, CONV)}
    setattr(module, GDN, gated_delta_rule(f"{module.__name__}.{GDN}"))
    setattr(module, CONV, causal_conv1d)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
