"""The small functions the rewritten graph calls to move values between layouts, and the meta keys that mark them.

Each takes the token axes of its value as plain ints, so the rewrite can call
it on any value: ``[..., B@b_dim, ..., S@s_dim, ...]`` in the original layout,
the same rank with the batch axis of size 1 and the sequence axis of size T
in the packed one. All are ordinary torch ops (traceable by Dynamo,
differentiable: ``unpack_tokens``' backward sums the gradients of a shared
token over the rows that read it).

They live here, below the graph passes, because two layers name them:
``rewrite.pack_graph`` (and the fusions after it) emits them, and
``analysis.padding_reads`` recognises them (with the node meta of
``graph.meta``: picked and weighted reads) in the packed graph it reads.
"""

from __future__ import annotations

import torch

from .pack import gather_valid

__all__ = [
    "pack_tokens", "gather_columns", "unpack_tokens", "previous_tokens", "gather_previous",
    "gather_unpacked", "unpack_merged", "token_weights", "weighted_histc",
]


def pack_tokens(x: torch.Tensor, pack_index: torch.Tensor, b_dim: int, s_dim: int) -> torch.Tensor:
    """Original ``[.., B, .., S, ..]`` -> packed ``[.., 1, .., T, ..]``."""
    y = x.movedim((b_dim, s_dim), (0, 1))
    y = y.reshape(-1, *y.shape[2:]).index_select(0, pack_index).unsqueeze(0)
    return y.movedim((0, 1), (b_dim, s_dim))


def gather_columns(x: torch.Tensor, col_index: torch.Tensor, s_dim: int) -> torch.Tensor:
    """A value that depends on the column only: ``[.., S, ..]`` -> ``[.., T, ..]``."""
    return x.index_select(s_dim, col_index)


def unpack_tokens(
    x: torch.Tensor,
    unpack_index: torch.Tensor,
    valid: torch.Tensor,
    input_ids: torch.Tensor,
    b_dim: int,
    s_dim: int,
    shift: int = 0,
    truncate: bool = False,
) -> torch.Tensor:
    """Packed ``[.., 1, .., T, ..]`` -> original ``[.., B, .., S, ..]``, zeros at padding.

    ``B`` and ``S`` are read off the batch's ``input_ids`` (or another
    ``[B, S, ...]`` input of the graph) so the traced graph follows its
    sizes, static or symbolic.

    ``shift=1``: the value of ``x[:, 1:]``-style next-token values, ``S - 1``
    columns, column c holding the token at c + 1 (zero where c or c + 1 is
    padding). ``truncate``: the ``x[:, :-1]`` view, ``S - 1`` columns.
    """
    B, S = input_ids.shape[0], input_ids.shape[1]
    y = x.movedim((b_dim, s_dim), (0, 1)).squeeze(0)
    if shift:
        index = unpack_index.view(B, S)[:, 1:].reshape(-1)
        keep = (valid.view(B, S)[:, 1:] & valid.view(B, S)[:, :-1]).reshape(-1)
        columns = S - 1
    else:
        index, keep, columns = unpack_index, valid, S
    y = gather_valid(y, index, keep)
    y = y.reshape(B, columns, *y.shape[1:])
    if truncate:
        y = y[:, : S - 1]
    return y.movedim((0, 1), (b_dim, s_dim))


def previous_tokens(x: torch.Tensor, prev_index: torch.Tensor, s_dim: int) -> torch.Tensor:
    """Each packed token's predecessor's value (the last shared token for a response's first token)."""
    return x.index_select(s_dim, prev_index)


def gather_previous(x: torch.Tensor, prev_index: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``previous_tokens(x, prev_index, 1).gather(-1, index)`` for ``x`` of shape ``[1, T, V]``, ``index`` ``[1, T, K]``.

    The next-token log-probs of a packed stream: each token's value read from
    its predecessor's row. One advanced index reads just the ``T * K``
    entries, where ``previous_tokens`` first copies all of ``x`` (the
    ``[T, V]`` log-probs over the vocabulary: gigabytes at a real vocab) and
    its backward adds a second ``[T, V]`` buffer.
    """
    return x[0][prev_index.unsqueeze(-1), index[0]].unsqueeze(0)


def gather_unpacked(x: torch.Tensor, unpack_index: torch.Tensor, valid: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``unpack(x).gather(-1, index)`` without building ``unpack(x)``: the entries an original-layout index picks.

    ``x`` is a packed ``[1, T, V]`` (token axes b, s) or ``[T, V]`` (the merged axis of a one-row batch squeezed,
    veRL's ``logits.squeeze(0)``) value of each token; ``index`` is in the original layout, ``[B, S, K]`` or
    ``[B * S, K]`` (labels computed outside the graph: veRL's ``input_ids_rmpad_rolled``). Entry ``[p, k]``
    reads row ``unpack_index[p]`` at column ``index[p, k]``; zeros at padding positions, as ``unpack`` gives.
    One advanced index reads the ``B * S * K`` entries; the backward adds each into its packed row, so the rows
    of a shared token sum the gradients of every position that reads it (one value, several labels).
    """
    k = index.shape[-1]
    picked = x.reshape(-1, x.shape[-1])[unpack_index.unsqueeze(-1), index.reshape(-1, k)]
    picked = torch.where(valid.unsqueeze(-1), picked, picked.new_zeros(()))
    return picked.reshape(index.shape)


def unpack_merged(
    x: torch.Tensor,
    unpack_index: torch.Tensor,
    valid: torch.Tensor,
    input_ids: torch.Tensor,
    bs_dim: int,
    shift: int = 0,
    truncate: bool = False,
) -> torch.Tensor:
    """Packed ``[.., T, ..]`` -> original ``[.., B*C, ..]``, zeros at padding: ``unpack_tokens`` with the
    batch and sequence axes merged, as ``x.reshape(-1, H)`` leaves them (C = S, or S - 1 columns with
    ``shift``/``truncate``: TRL's fused lm_head flattens ``last_hidden_state[:, :-1]``)."""
    y = unpack_tokens(x.unsqueeze(bs_dim), unpack_index, valid, input_ids, bs_dim, bs_dim + 1, shift, truncate)
    return y.flatten(bs_dim, bs_dim + 1)



def token_weights(
    num_tokens: int,
    unpack_index: torch.Tensor,
    valid: torch.Tensor,
    input_ids: torch.Tensor,
    shift: int = 0,
    truncate: bool = False,
) -> torch.Tensor:
    """int64 ``[T]``: how many positions of the original layout ``unpack_tokens`` (same ``shift``/``truncate``)
    fills from each packed token. A sum over the token axes of the unpacked value is the sum of the packed
    one weighted by these (docs/design.md, semantics 12); positions ``unpack`` zeroes count for nothing.

    ``index_add`` of integers: exact in any order, and deterministic on CUDA under
    ``torch.use_deterministic_algorithms``."""
    B, S = input_ids.shape[0], input_ids.shape[1]
    index, keep = unpack_index.view(B, S), valid.view(B, S)
    if shift:
        index, keep = index[:, 1:], keep[:, 1:] & keep[:, :-1]
    elif truncate:
        index, keep = index[:, : S - 1], keep[:, : S - 1]
    counts = torch.zeros(num_tokens, dtype=torch.long, device=unpack_index.device)
    return counts.index_add(0, index.reshape(-1), keep.reshape(-1).long())


def weighted_histc(x: torch.Tensor, weights: torch.Tensor, bins: int, lo: float, hi: float) -> torch.Tensor:
    """``torch.histc(x, bins, lo, hi)`` with each entry counted ``weights`` times (``weights`` broadcast to ``x``).

    The bin of an entry is ``floor((x - lo) * bins / (hi - lo))``, ``hi`` itself in the last bin, entries
    outside ``[lo, hi]`` (and NaN) in none: the formula of torch's CUDA kernel. For integer entries with
    ``hi - lo == bins`` (expert ids: ``histc(ids, E, 0, E)``) it is exact and agrees with the CPU kernel.
    Requires ``lo < hi`` (the analysis refuses a range taken from the data)."""
    w = weights.expand_as(x).reshape(-1)
    x = x.reshape(-1)
    inside = (x >= lo) & (x <= hi)
    pos = ((x - lo) * bins / (hi - lo)).nan_to_num(0.0).clamp(0, bins - 1).long()
    counts = torch.zeros(bins, dtype=x.dtype, device=x.device)
    return counts.index_add(0, pos, torch.where(inside, w.to(x.dtype), torch.zeros((), dtype=x.dtype, device=x.device)))
