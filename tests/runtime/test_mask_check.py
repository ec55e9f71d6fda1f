"""The one mask check: a graph's attention masks against the causal, padding-aware pattern of a layout."""

from __future__ import annotations

import torch

import dualkv_compile
from dualkv_compile.runtime.mask_check import mask_mismatch, pure_mask

# Two rows sharing a 3-token prompt; row 1 is right-padded by one column.
IDS = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 4, 0]])
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])


def _causal_with_key_padding(pad_self: bool) -> torch.Tensor:
    """``[B, 1, S, S]`` bool written out by hand; ``pad_self``: the padding query attends to itself too."""
    B, S = MASK.shape
    m = torch.zeros(B, 1, S, S, dtype=torch.bool)
    for b in range(B):
        for q in range(S):
            for k in range(q + 1):
                m[b, 0, q, k] = bool(MASK[b, k])
    if pad_self:
        m[1, 0, 4, 4] = True
    return m


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def test_the_causal_mask_with_key_padding_passes_both_ways():
    layout = dualkv_compile.detect(IDS, MASK)
    for m in (_causal_with_key_padding(False), _additive(_causal_with_key_padding(False))):
        assert mask_mismatch([m], ["sdpa"], layout, pin_padding=False) is None
        assert mask_mismatch([m], ["sdpa"], layout, pin_padding=True) is None


def test_pin_padding_rejects_a_padding_query_that_attends_to_itself():
    """Rows of padding queries are unspecified for the batch's own mask; a carried layout needs them pinned."""
    layout = dualkv_compile.detect(IDS, MASK)
    m = _causal_with_key_padding(pad_self=True)
    assert mask_mismatch([m], ["sdpa"], layout, pin_padding=False) is None
    why = mask_mismatch([m], ["sdpa"], layout, pin_padding=True)
    assert why is not None and why.startswith("sdpa: the attention mask is not causal within each sequence")


def test_sliding_window_and_bias_are_rejected():
    layout = dualkv_compile.detect(IDS, MASK)
    window = _causal_with_key_padding(False)
    window[:, :, 4, 0] = False  # the last query no longer sees the first key
    for pin in (False, True):
        assert "not causal within each sequence" in mask_mismatch([window], ["a"], layout, pin_padding=pin)
    bias = _additive(_causal_with_key_padding(False))
    bias[0, 0, 2, 1] = -0.5
    assert "not a pure mask" in mask_mismatch([bias], ["a"], layout, pin_padding=False)


def test_pure_mask_names_a_wrong_shape():
    assert "expected [B, heads, S, S]" in pure_mask("a", torch.ones(2, 5, 5, dtype=torch.bool), 2, 5)
    assert pure_mask("a", torch.ones(1, 1, 5, 5, dtype=torch.bool), 2, 5).shape == (1, 1, 5, 5)
