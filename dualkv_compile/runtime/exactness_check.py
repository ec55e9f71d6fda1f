"""Trust on first use: run the original program beside the packed one and compare (option ``check_exact``).

On the packed calls the option selects (the first of each graph; with an int N, also every Nth), the runner
calls ``check`` with the call's arguments, its layout and the packed program's outputs. ``check`` runs the
original (unpacked) program on the same arguments and compares:

    outputs     every floating-point tensor output; those laid out ``[B, S, ...]`` (or ``[B, S - 1, ...]``,
                next-token values; or with those axes merged, ``[B * S, ...]``) at the positions the original
                program defines (non-padding; for next-token values, where the token and the one before it are
                both tokens), others whole;
    gradients   where autograd is on: the gradient of every parameter among the inputs of
                ``sum(<output, w>)`` over those outputs, ``w`` a fixed random weight at those positions, zero
                elsewhere, taken on a second run of the packed program (``rerun``): the caller's outputs keep
                their graph for the caller's backward (compiled backwards donate buffers, so one graph cannot
                be differentiated twice).
                Under sequence parallelism the packed gradients are averaged over the group first (each rank
                holds ``world`` times its share; ``ops.sp_collectives``), one all-reduce per input.

Each comparison is ``|a - b| / |b|`` (Frobenius norms) against a tolerance that follows the dtype (float64
1e-9, float32 1e-4, bfloat16 and float16 5e-2: two exact programs that sum in different orders). A
comparison over the tolerance raises ``ExactnessError`` naming the first diverging output or input, its error
and how to report it; nothing is silently corrected. The time the check took and its worst errors go to the
graph's report (``explain()``).
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from ..layout import SharedPromptLayout
from ..layout.carried import leaves

__all__ = ["ExactnessError", "check", "due", "tolerance"]

_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}

REPORT_HOW = (
    "this is a dualkv bug: please report it with the model's config, the batch's shapes, "
    "dualkv_compile.explain()'s output and torch/transformers versions; meanwhile run without the dualkv backend"
)


class ExactnessError(RuntimeError):
    """The packed program's result differs from the original program's beyond rounding."""


def tolerance(dtype: torch.dtype) -> float:
    return _TOL.get(dtype, 1e-4)


def due(setting, packed_calls: int) -> bool:
    """Whether the packed call numbered ``packed_calls`` (0-based) is checked under ``check_exact=setting``."""
    if setting is None:
        return False
    if setting == "first":
        return packed_calls == 0
    return packed_calls % int(setting) == 0


def _positions(t: torch.Tensor, layout: SharedPromptLayout) -> Optional[torch.Tensor]:
    """A bool mask of ``t``'s leading ``[B, S]`` (or ``[B, S - 1]``) axes, or of a leading axis that merges them
    (``[B * S, E]`` router logits), where the original program defines it, broadcastable to ``t``; None for a value
    without token axes there (compared whole)."""
    B, S = layout.batch_size, layout.seq_len
    valid = layout.valid.view(B, S).to(t.device)
    nxt = valid[:, 1:] & valid[:, :-1]  # next-token values: column c holds token c + 1, read from column c
    if t.dim() >= 2 and t.shape[0] == B and t.shape[1] in (S, S - 1):
        v = valid if t.shape[1] == S else nxt
        return v.reshape(B, t.shape[1], *([1] * (t.dim() - 2)))
    if t.dim() >= 1 and t.shape[0] in (B * S, B * (S - 1)) and B * S > 1:
        v = valid if t.shape[0] == B * S else nxt
        return v.reshape(t.shape[0], *([1] * (t.dim() - 1)))
    return None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        same = torch.equal(torch.nan_to_num(a, 1.0, 2.0, 3.0), torch.nan_to_num(b, 1.0, 2.0, 3.0))
        return 0.0 if same and torch.equal(torch.isnan(a), torch.isnan(b)) else float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(fallback, args, layout: SharedPromptLayout, packed_out, rerun, input_names, sequence_parallel=None) -> str:
    """Compare ``packed_out`` with ``fallback(*args)`` (module docstring); returns a one-line summary for the report.

    ``rerun()`` runs the packed program again on the same arguments (for the gradients); ``sequence_parallel``: the
    ``SPGroup`` the packed program is split over, or None."""
    start = time.perf_counter()
    ref_out = fallback(*args)
    mine = [t for t in leaves(packed_out) if isinstance(t, torch.Tensor)]
    theirs = [t for t in leaves(ref_out) if isinstance(t, torch.Tensor)]
    if len(mine) != len(theirs):
        raise ExactnessError(f"dualkv returned {len(mine)} tensors where the original program returned {len(theirs)}; {REPORT_HOW}")
    worst_out, worst_grad = 0.0, 0.0
    weights = []
    gen = torch.Generator().manual_seed(0)
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if not b.dtype.is_floating_point:
            continue
        where = _positions(b, layout)
        sel_a, sel_b = (a, b) if where is None else (a * where, b * where)
        err = _rel(sel_a.detach(), sel_b.detach())
        worst_out = max(worst_out, err)
        if err > tolerance(b.dtype):
            raise ExactnessError(
                f"output {i} (shape {list(b.shape)}, {b.dtype}) differs from the original program's by {err:.2e} "
                f"relative (tolerance {tolerance(b.dtype):.0e}); {REPORT_HOW}"
            )
        if a.requires_grad and b.requires_grad:
            w = torch.randn(b.shape, generator=gen).to(b.device, b.dtype)
            weights.append((i, w if where is None else w * where))
    grads = 0
    # Parameters only: an activation input's gradient may differ per position and still be exact (a graph that
    # packs hidden states carried from an earlier graph puts a shared token's gradient on the copy it keeps; the
    # earlier graph's unpack sums the copies either way).
    wrt = [(k, x) for k, x in enumerate(args) if isinstance(x, torch.nn.Parameter) and x.requires_grad]
    if weights and wrt and torch.is_grad_enabled():
        inputs = [x for _, x in wrt]
        again = [t for t in leaves(rerun()) if isinstance(t, torch.Tensor)]
        ga = torch.autograd.grad(sum((again[i] * w).sum() for i, w in weights), inputs, allow_unused=True)
        gb = torch.autograd.grad(sum((theirs[i] * w).sum() for i, w in weights), inputs, allow_unused=True)
        if sequence_parallel is not None:
            ga = tuple(None if g is None else _group_mean(g, sequence_parallel) for g in ga)
        for (k, x), da, db in zip(wrt, ga, gb):
            if da is None and db is None:
                continue
            da = torch.zeros_like(x) if da is None else da
            db = torch.zeros_like(x) if db is None else db
            err = _rel(da, db)
            grads += 1
            worst_grad = max(worst_grad, err)
            if err > tolerance(x.dtype):
                raise ExactnessError(
                    f"the gradient of parameter {input_names[k]} (shape {list(x.shape)}, {x.dtype}) differs from the "
                    f"original program's by {err:.2e} relative (tolerance {tolerance(x.dtype):.0e}); {REPORT_HOW}"
                )
    ms = (time.perf_counter() - start) * 1e3
    what = f"{len(mine)} outputs (worst rel err {worst_out:.1e})"
    if grads:
        what += f", {grads} parameter gradients (worst {worst_grad:.1e}{', the group mean' if sequence_parallel else ''})"
    return f"{what}, against the original program in {ms:.0f} ms"


def _group_mean(g: torch.Tensor, sp) -> torch.Tensor:
    import torch.distributed as dist

    from ..ops.sp_collectives import process_group

    g = g.detach().clone()
    dist.all_reduce(g, group=process_group(sp.group_name))
    return g / sp.world
