"""``shared_batch``: the caller says which batch the model runs on, so every graph of a split model packs on it.

    with dualkv_compile.shared_batch(input_ids, attention_mask, position_ids):
        loss = loss_fn(compiled_model, batch)       # forward under the block; backward may follow outside it

Why: FSDP2's ``fully_shard`` on each decoder layer (how veRL and TRL shard) runs its hooks outside Dynamo,
so the model reaches dualkv as one graph per piece. The piece that embeds the token ids sees them as a
positional argument once the root module is sharded too, so no graph is found to hold ``input_ids``; the
first layer's graph then detects the layout from its hidden states and mask on every call (hashing them, one
host sync), and the lm_head's graph, handed the hidden states through FSDP's autograd functions, may not
recognise them as laid out on it and run unpacked. Here the layout is detected once, from the caller's
tensors, and made the layout current in the thread for the graphs called inside the block, trusted: a graph
takes it without tracing its inputs back to a packed graph. Each graph still checks, per call, that the copies
its layout drops of each carried input equal the kept ones bitwise, and checks its attention masks against it.

Assumes: every ``[B, S, ...]`` tensor the graphs called inside the block receive is laid out as this batch
(``B`` rows, ``S`` columns); a graph whose batch is another shape carries nothing. Sharing needs the same
columns when ``B > 1`` (a column-only value, rotary tables from ``arange(S)``, may be read on the packed
stream); one row of several sequences (``B == 1``, restarting position ids, veRL's remove padding) shares
across columns.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from .layout import SharedPromptLayout, carried, detect

__all__ = ["shared_batch"]


@contextmanager
def shared_batch(
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    *,
    group_size: Optional[int] = None,
    min_shared: int = 1,
) -> Iterator[SharedPromptLayout]:
    """Detect the layout of the batch (``detect``'s arguments; ``ValueError`` names a bad one) and make it the
    trusted current layout while the block runs; yields it. The previous current layout is restored after."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [B, S] tensor, got {getattr(input_ids, 'shape', type(input_ids).__name__)}")
    layout = detect(input_ids, attention_mask, position_ids, group_size=group_size, min_shared=min_shared,
                    same_columns=input_ids.shape[0] > 1)
    before = carried.current()
    carried.publish(layout, -1, "dualkv_compile.shared_batch", trusted=True)
    try:
        yield layout
    finally:
        carried.restore(before)
