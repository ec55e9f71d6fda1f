"""Placeholder backend: compiles the graph unchanged with Inductor (replaced by the pass in issue 4)."""
from __future__ import annotations


def dualkv_backend(gm, example_inputs, **kwargs):
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)
