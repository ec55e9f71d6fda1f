"""Per call: whether a graph's recurrent layers may run on this call's layout (docs/design.md, semantics 16).

Assumes ``layers`` are the plan's recurrent layers on the packed stream, ``(kind, why)`` with ``why`` the reason
the padding before a row's tokens is not neutral to the layer (None: proven neutral, ``analysis.padding_neutral``,
through the attention mask). Guarantees: None only where the packed forms compute what the original program
does: every row holds at most one sequence (the original runs a recurrence through a whole row, so sequences
packed into one row would share state there and nowhere in the forest); where a row has padding before its
sequence, every layer's padding is neutral and the attention mask is zero at every padding position (the proof
multiplied by it). Else the reason, naming the layer kind. One host read of the mask, only for a left-padded call.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..layout import SharedPromptLayout

__all__ = ["recurrence_mismatch"]


def recurrence_mismatch(layers, layout: SharedPromptLayout, mask: Optional[torch.Tensor]) -> Optional[str]:
    """None if ``layout`` suits the recurrent ``layers`` (module docstring), else why not."""
    if not layers:
        return None
    kinds = ", ".join(dict.fromkeys(k for k, _ in layers))
    rows = [s.row for s in layout.sequences if s.length > 0]
    if len(rows) != len(set(rows)):
        shared = sorted({r for r in rows if rows.count(r) > 1})
        return (f"rows {shared[:4]} hold several sequences, which the original program's recurrent layers ({kinds}) "
                "run through as one: the forest would keep them apart")
    if not any(s.start > 0 and s.length > 0 for s in layout.sequences):
        return None
    blocked = next((f"{kind}: {why}" for kind, why in layers if why), None)
    if blocked is not None:
        return f"padding before a row's tokens reaches the original program's recurrent layer ({blocked})"
    if mask is None:
        return f"padding before a row's tokens, and no attention mask to zero it for the recurrent layers ({kinds})"
    flat = mask.reshape(-1)
    if flat.numel() != layout.valid.numel() or bool((flat[~layout.valid.to(flat.device)] != 0).any()):
        return (f"the attention mask is not zero at every padding position of the layout: the recurrent layers "
                f"({kinds}) would read the padding")
    return None
