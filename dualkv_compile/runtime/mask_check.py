"""Attention masks the original graph builds, checked against the causal, padding-aware pattern of a layout.

The rewrite drops the masks a graph builds and attends by the layout instead, so a mask that is not the
causal mask with the layout's key padding, narrowed by the attention's own sliding window and chunks
(read exactly from the graph: ``analysis.mask_windows``; on each token's depth in its sequence), must
stop the packed path (bidirectional, a bias, another batch's padding, a window other than the one read).
Masks are evaluated by a copy of the graph (``analysis.side_graphs.mask_graph``).

A check of evaluated masks sees only what its batch reaches: a window longer than every sequence of the
checked batch looks causal there. That is why windows are read from the graph, not from this check, and a
window the graph does not spell in a form read exactly is refused there when it can bind at the graph's
sequence length (``analysis.attention_match``); this check still catches a window, or any other pattern,
that its own batch reaches.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..layout import SharedPromptLayout
from ..layout.segments import window_allows

__all__ = ["mask_mismatch", "pure_mask"]


def mask_mismatch(masks, names, layout: SharedPromptLayout, *, pin_padding: bool, windows=None) -> Optional[str]:
    """None if every mask is causal within each of ``layout``'s sequences (no padding keys), else why not.

    ``windows``: per mask, the ``(window, chunk)`` its attention runs with (0: none; None: none for all),
    applied on each column's depth in its sequence.

    The one mask check of the package. Rows of valid queries must match
    exactly (rows of padding queries are left unspecified). ``pin_padding``:
    also no padding position may attend to itself, which ties the mask's
    padding to the layout's: needed where the layout was not detected from
    this call's own token ids (a carried layout; a batch whose last token the
    layout calls padding fails). One sync per mask; temporaries of ``S * S``
    elements per row of the batch.
    """
    B, S = layout.batch_size, layout.seq_len
    valid = layout.valid.view(B, S)
    seq = layout.sequence_ids().view(B, S)
    q = torch.arange(S, device=valid.device)
    causal = q[None, :] <= q[:, None]  # [Sq, Skv]
    windows = windows or [(0, 0)] * len(names)
    for name, m, (window, chunk) in zip(names, masks, windows):
        allowed = pure_mask(name, m, B, S)
        if isinstance(allowed, str):
            return allowed
        bad = torch.zeros((), dtype=torch.bool, device=valid.device)
        for b in range(B):
            a, v = allowed[min(b, allowed.shape[0] - 1)], valid[b]
            # Causal within each sequence of the row (several when sequences are packed into it).
            same = (seq[b][None, :] == seq[b][:, None]) & v[None, :]
            expected = causal & same
            if window or chunk:
                depth = (same & causal).sum(-1) - 1  # a column's index in its sequence (at valid columns)
                expected = expected & window_allows(depth[:, None], depth[None, :], window, chunk)
            bad |= ((a ^ expected) & v[:, None]).any()
            if pin_padding:
                bad |= (a.diagonal(dim1=-2, dim2=-1) & ~v).any()
        if bool(bad):
            return (
                f"{name}: the attention mask is not causal within each sequence"
                + (f" under the window read from the graph (window={window}, chunk={chunk})" if window or chunk else "")
                + " (a window not read from the graph, bidirectional or custom mask, another batch's padding, or "
                "sequences packed into a row that it does not separate)"
            )
    return None


def pure_mask(name: str, m: torch.Tensor, B: int, S: int) -> "torch.Tensor | str":
    """Attention mask ``m`` as booleans (True: may attend) of shape ``[1 or B, heads, S, S]``, else why it is not one."""
    allowed = allowed_from_mask(m)
    if allowed is None:
        return f"{name}: the attention mask carries values other than 0 and -inf/min (a bias); not a pure mask"
    if allowed.dim() != 4 or tuple(allowed.shape[-2:]) != (S, S) or allowed.shape[0] not in (1, B):
        return f"{name}: attention mask of shape {list(allowed.shape)}, expected [B, heads, S, S]"
    return allowed


def allowed_from_mask(m: torch.Tensor) -> Optional[torch.Tensor]:
    if m.dtype == torch.bool:
        return m
    neg = (m <= torch.finfo(m.dtype).min / 2) | torch.isneginf(m)
    if not bool(((m == 0) | neg).all()):
        return None
    return m == 0
