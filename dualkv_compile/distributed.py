"""Data-parallel training with dualkv: find prompt groups that the data loader split across ranks.

Under DDP or FSDP2 every rank packs its own micro-batch; the backend never looks at other ranks (no collective
runs inside the compiled step, where ranks may take different paths). A prompt whose rollouts land on several
ranks is therefore computed once *per rank*: exact, only the sharing is lost. The data loader must keep all
rollouts of a prompt on one rank (in one micro-batch, in any row order); ``check_groups_on_rank`` is the
explicit, per-batch check for that rule.

Assumes every rank of ``process_group`` calls ``check_groups_on_rank`` for the same step (it runs two
``all_gather_object`` collectives), with a batch ``layout.detect`` accepts (``[B, S]`` token ids, one contiguous
run of valid tokens per row).
Guarantees
    * Every rank returns the same split prompts (``SplitGroupReport.split``), each naming the ranks that hold its
      rows and how many each holds; rank 0's ``report.ok`` is every rank's.
    * A prompt is identified by a blake2b hash of its tokens (the same in every process): with ``response_mask``
      the row's valid tokens before its response; without it, each sequence's prefix up to the deepest forest
      node it shares with another sequence on some rank (a prompt with exactly one row on every rank that holds
      it is then not found: pass ``response_mask`` to catch that too).
    * Split prompts are logged once, as a warning on the "dualkv_compile" logger, by the lowest rank that holds
      rows of them. Without an initialised process group (or with one rank) nothing is gathered or split.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Optional

import torch

from .layout import detect

log = logging.getLogger("dualkv_compile")

__all__ = ["SplitGroup", "SplitGroupReport", "check_groups_on_rank"]


@dataclasses.dataclass(frozen=True)
class SplitGroup:
    """One prompt whose rows are on more than one rank."""

    prefix_len: int
    prefix_hash: str
    rows_per_rank: dict[int, int]

    def __str__(self) -> str:
        where = ", ".join(f"rank {r}: {n} row(s)" for r, n in sorted(self.rows_per_rank.items()))
        return f"prompt {self.prefix_hash[:12]} ({self.prefix_len} tokens) is split over ranks ({where})"


@dataclasses.dataclass(frozen=True)
class SplitGroupReport:
    """What ``check_groups_on_rank`` found; ``ok`` when no prompt is split."""

    rank: int
    world_size: int
    local_rows: int
    local_groups: int
    split: tuple[SplitGroup, ...]

    @property
    def ok(self) -> bool:
        return not self.split

    def __str__(self) -> str:
        head = f"rank {self.rank}/{self.world_size}: {self.local_rows} rows in {self.local_groups} groups"
        if self.ok:
            return f"{head}; no prompt split across ranks"
        return "\n".join([f"{head}; {len(self.split)} prompt(s) split across ranks:"] + [f"  {s}" for s in self.split])


def _digest(tokens: list[int]) -> str:
    return hashlib.blake2b(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes(), digest_size=16).hexdigest()


def check_groups_on_rank(
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    response_mask: Optional[torch.Tensor] = None,
    process_group=None,
    min_shared: int = 1,
) -> SplitGroupReport:
    """Find prompts whose rows this step's data loader put on more than one rank (see the module docstring).

    Call it on every rank of ``process_group`` (default: the world) with this
    rank's micro-batch, outside the compiled step. ``response_mask`` ([B, S],
    1 on response tokens) names each row's prompt exactly; ``min_shared`` is
    passed to ``detect`` when it is not given.
    """
    import torch.distributed as dist

    # detect validates input_ids / attention_mask and names a bad argument.
    layout = detect(input_ids, attention_mask, min_shared=min_shared)
    ids = input_ids.detach().cpu().tolist()
    rows = [ids[q.row][q.start : q.end] for q in layout.sequences]
    if response_mask is not None:
        if not isinstance(response_mask, torch.Tensor) or tuple(response_mask.shape) != tuple(input_ids.shape):
            got = list(response_mask.shape) if isinstance(response_mask, torch.Tensor) else type(response_mask).__name__
            raise ValueError(f"response_mask must have the shape of input_ids {list(input_ids.shape)}, got {got}")
        resp = response_mask.detach().cpu().bool().tolist()
        # A sequence's prompt: its valid tokens before the first response token.
        keys = set()
        for q in layout.sequences:
            first = next((c for c in range(q.start, q.end) if resp[q.row][c]), q.end)
            if first > q.start:
                keys.add((first - q.start, _digest(ids[q.row][q.start : first])))
    else:
        # A sequence's prompt: everything up to the deepest node it shares with another sequence
        # (a system prompt above it is shared by every group, so not a group's prompt).
        keys = set()
        for i, q in enumerate(layout.sequences):
            shared = [n for n in layout.path(i) if layout.nodes[n].count > 1]
            if shared:
                node = layout.nodes[shared[-1]]
                end = node.offset + node.length
                keys.add((end, _digest(rows[i][:end])))
    local_groups = layout.stats().num_groups

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(process_group) == 1:
        return SplitGroupReport(0, 1, layout.batch_size, local_groups, ())
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)

    # 1. Every rank's prompt keys; 2. per key, how many of this rank's rows start with that prompt.
    gathered: list = [None] * world
    dist.all_gather_object(gathered, sorted(keys), group=process_group)
    all_keys = sorted({tuple(k) for ks in gathered for k in ks})
    counts = [sum(1 for row in rows if len(row) >= L and _digest(row[:L]) == h) for L, h in all_keys]
    gathered_counts: list = [None] * world
    dist.all_gather_object(gathered_counts, counts, group=process_group)

    split = []
    for i, (L, h) in enumerate(all_keys):
        per_rank = {r: c[i] for r, c in enumerate(gathered_counts) if c[i] > 0}
        if len(per_rank) > 1:
            split.append(SplitGroup(L, h, per_rank))
    report = SplitGroupReport(rank, world, layout.batch_size, local_groups, tuple(split))
    for s in split:
        if min(s.rows_per_rank) == rank:
            log.warning(
                "dualkv: %s; each of those ranks computes the prompt once, so its sharing is lost. "
                "Keep all rollouts of a prompt on one rank (in one micro-batch).",
                s,
            )
    return report


def graph_split_hint(gm) -> Optional[str]:
    """Why a graph without token ids may exist under DDP / FSDP2, for the backend's refusal reason (None if neither applies).

    Both cut a compiled model into graphs where at most the first holds the
    token inputs (the others pack on a layout carried to them, see
    ``active_layout``, where they can): DDP's Dynamo optimizer splits
    at gradient-bucket boundaries, and FSDP2 runs its per-module hooks outside
    Dynamo (``torch._dynamo.disable``), a graph break at every submodule that
    ``fully_shard`` was applied to.
    """
    try:
        from torch._dynamo.utils import get_optimize_ddp_mode
        from torch.nn.parallel import DistributedDataParallel

        if DistributedDataParallel._get_active_ddp_module() is not None and get_optimize_ddp_mode() == "ddp_optimizer":
            return (
                "DDP's Dynamo optimizer split the model at gradient-bucket boundaries; "
                "set torch._dynamo.config.optimize_ddp = False to keep it one graph"
            )
    except (ImportError, AttributeError):  # a torch without these internals: no hint
        pass
    # The graphs of an FSDP2 submodule do not name its FSDP class (Dynamo
    # traces the module's forward frame after the hook's graph break), so
    # under a process group this can only be a conditional hint.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return (
            "if fully_shard (FSDP2) was applied to submodules, its hooks run outside Dynamo and break the graph "
            "around each of them: the graphs of those submodules pack on a layout carried from graph to graph, "
            "a graph like this one is left unchanged"
        )
    return None
