"""Shared hand-written cases and checks of the layout tests (``test_layout_*.py``).

The veRL-style batch (``VERL_*``) and the mixed batch of two groups and a lone
sequence (``MIXED_*``) with their expected sequences, nodes and segments, and the
helpers that read a layout in the notation of those expectations:
    sequences  (row, start, end, leaf)
    nodes      (parent, offset, length, packed_start, source, count)
    segments   (seg_start, seg_len, parent, prefix_len, subtree_end)
Nothing expected here is computed with the code under test.
"""

from __future__ import annotations

import torch

from dualkv_compile.layout import Segments, SharedPromptLayout


def seqs_of(layout: SharedPromptLayout):
    return [(s.row, s.start, s.end, s.leaf) for s in layout.sequences]


def nodes_of(layout: SharedPromptLayout):
    return [(n.parent, n.offset, n.length, n.packed_start, n.source, n.count) for n in layout.nodes]


def check_segments(layout: SharedPromptLayout, expected: list[tuple[int, int, int, int, int]]):
    assert layout.segments() == expected
    segs = layout.attention_segments
    assert isinstance(segs, Segments)
    for t in segs[:5]:
        assert t.dtype == torch.int32 and t.device == layout.device
    got = list(zip(*(t.tolist() for t in segs[:5])))
    assert got == expected
    assert segs.max_seg_len == max((s[1] for s in expected), default=0)
    assert segs.max_prefix_len == max((s[3] for s in expected), default=0)
    assert layout.num_segments == len(expected)
    assert isinstance(segs.max_seg_len, int) and isinstance(segs.max_prefix_len, int)


def T(rows):
    return torch.tensor(rows, dtype=torch.long)


# veRL / TRL: prompts left-padded to a common width, responses right-padded.
# Prompt [5, 6, 7] in columns 1..3 (column 0 is padding); responses of
# lengths 3, 1 and 0 in columns 4..6.
VERL_IDS = T([[0, 5, 6, 7, 10, 11, 12], [0, 5, 6, 7, 20, 0, 0], [0, 5, 6, 7, 0, 0, 0]])
VERL_MASK = T([[0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0, 0]])
# The prompt (read from row 0, flat 1), row 0's response (flat 4), row 1's (flat 7 + 4);
# row 2 is the prompt alone: it ends at the prompt's node.
VERL_NODES = [(-1, 0, 3, 0, 1, 3), (0, 3, 3, 3, 4, 1), (0, 3, 1, 6, 11, 1)]
VERL_SEQS = [(0, 1, 7, 1), (1, 1, 5, 2), (2, 1, 4, 0)]
VERL_SEGS = [(0, 3, -1, 0, 7), (3, 3, 0, 3, 6), (6, 1, 0, 3, 7)]


# Two groups of different sizes and a sequence of its own. Row 2 starts with
# the same token as rows 0 and 1: the five rows share that one token (a root
# of one token), the two groups branch below it; row 5 shares nothing.
MIXED_IDS = T(
    [
        [1, 2, 3, 4, 5, 0],
        [1, 2, 3, 7, 0, 0],
        [1, 9, 9, 9, 4, 4],
        [1, 9, 9, 9, 5, 0],
        [1, 9, 9, 9, 6, 6],
        [8, 8, 8, 8, 0, 0],
    ]
)
MIXED_MASK = T(
    [
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 0, 0],
    ]
)
