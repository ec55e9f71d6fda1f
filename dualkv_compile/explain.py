"""``explain()``: run a model or function once through the dualkv backend and report what happened."""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Optional, TextIO

import torch

from .backend import dualkv_backend
from .report import GraphReport, reports

__all__ = ["Explanation", "explain"]


@dataclasses.dataclass
class Explanation:
    """Graphs seen, rewritten or refused (and why), and the layout of the call."""

    graphs: list[GraphReport]
    output: Any

    @property
    def rewritten(self) -> list[GraphReport]:
        return [g for g in self.graphs if g.rewritten]

    @property
    def refused(self) -> list[GraphReport]:
        return [g for g in self.graphs if not g.rewritten]

    def __str__(self) -> str:
        lines = [f"dualkv: {len(self.graphs)} graph(s), {len(self.rewritten)} rewritten, {len(self.refused)} refused"]
        lines += [str(g) for g in self.graphs]
        return "\n".join(lines)


def explain(
    model_or_fn, *args, options: Optional[dict] = None, file: Optional[TextIO] = None, quiet: bool = False, **kwargs
) -> Explanation:
    """Compile ``model_or_fn`` with the dualkv backend, call it once on ``args``/``kwargs`` and report.

    Resets Dynamo's caches first, so every graph is compiled (and reported)
    afresh. The report is written to ``file`` (stdout by default) unless
    ``quiet``, and returned with the call's output.
    """
    torch._dynamo.reset()
    start = len(reports())
    compiled = torch.compile(model_or_fn, backend=functools.partial(dualkv_backend, options=options))
    output = compiled(*args, **kwargs)
    result = Explanation(reports()[start:], output)
    if not quiet:
        print(result, file=file if file is not None else sys.stdout)
    return result
