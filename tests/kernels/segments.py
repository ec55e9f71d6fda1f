"""Shared by the kernel tests: Segments of packed streams written by hand, and random prefix forests."""

from __future__ import annotations

import random


from dualkv_compile.layout import Segments, tree_segments


def make_segments(groups, device="cpu") -> tuple[Segments, int]:
    """Segments of a two-level stream of ``groups`` = [(P, [R_0, R_1, ...]), ...]; returns (segs, T).

    Each group is a prompt of P tokens (a root, omitted when P = 0) and its
    responses (children of the prompt, or roots when P = 0; empty ones omitted).
    """
    lens, parents = [], []
    for P, Rs in groups:
        root = -1
        if P:
            root = len(lens)
            lens.append(P)
            parents.append(-1)
        for R in Rs:
            if R:
                lens.append(R)
                parents.append(root)
    return tree_segments(lens, parents, device), sum(lens)


def random_forest(rng: random.Random, max_depth: int = 3, max_len: int = 40, max_children: int = 4, max_roots: int = 3):
    """A random prefix forest in pre-order: ``(seg_len, parent)`` host lists.

    Depth 1 to ``max_depth`` (a root alone is depth 1); node lengths 1 to
    ``max_len`` with one-token nodes made likely; any number of children.
    """
    lens, parents = [], []

    def grow(parent: int, depth: int):
        me = len(lens)
        lens.append(1 if rng.random() < 0.15 else rng.randint(1, max_len))
        parents.append(parent)
        if depth < max_depth:
            for _ in range(rng.randint(0, max_children)):
                grow(me, depth + 1)

    for _ in range(rng.randint(1, max_roots)):
        grow(-1, 1)
    return lens, parents


def small_forest(seed: int, max_tokens: int, max_len: int):
    """A random forest (``random_forest``, depth up to 3, up to 3 roots) of more than one node and at most
    ``max_tokens`` tokens, nodes up to ``max_len``: ``(seg_len, parent)``, the same for the same seed."""
    rng = random.Random(seed)
    while True:
        lens, parents = random_forest(rng, max_depth=3, max_len=max_len, max_children=3, max_roots=3)
        if sum(lens) <= max_tokens and len(lens) > 1:
            return lens, parents


def forest_segments(seg_len, parent, device="cpu") -> tuple[Segments, int]:
    return tree_segments(seg_len, parent, device), sum(seg_len)
