"""Shared by the kernel tests: Segments of a packed stream written by hand."""

from __future__ import annotations

import torch

from dualkv_compile.layout import Segments


def make_segments(groups, device="cpu") -> tuple[Segments, int]:
    """Segments of a packed stream of ``groups`` = [(P, [R_0, R_1, ...]), ...]; returns (segs, T)."""
    rows, off = [], 0
    for P, Rs in groups:
        prompt = off
        if P:
            rows.append((off, P, off, 0))
        off += P
        for R in Rs:
            if R:
                rows.append((off, R, prompt, P))
                off += R
    t = torch.tensor(rows, dtype=torch.int32, device=device)
    # clone: with one segment, t[:, i].contiguous() is a view and the four would share storage
    segs = Segments(*(t[:, i].clone(memory_format=torch.contiguous_format) for i in range(4)), max(r[1] for r in rows), max(r[3] for r in rows))
    return segs, off
