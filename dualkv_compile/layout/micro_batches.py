"""Token-balanced micro-batches that keep every group of rows whole (veRL's ``use_dynamic_bsz``).

    groups, shared = prompt_groups(ids, lengths, prompt_lengths)   # rows with equal prompts, each prompt's length
    plan = balance_micro_batches(lengths, groups, max_tokens, shared=shared, count=None)
    plan.rows                                # the micro-batches, as row indices; plan.explain() says why

The budget means what veRL's ``rearrange_micro_batches`` means by ``max_token_len``: the *valid* tokens
(attention-mask ones, unpacked) of a micro-batch's rows, at most ``max_tokens``. The balance is over the *packed*
tokens (each group's shared prompt once, plus the rest of its rows: what dualkv computes). Guarantees, for any input:

* every group's rows land in one micro-batch, except where ``count`` asks for more micro-batches than there are
  groups to fill them (the data-parallel ranks' common count): then the fewest groups are split, and a reason says
  so; a group whose valid tokens are over the budget is a micro-batch of its own, and a reason says so;
* every other micro-batch is within the budget; none is empty; each row is in exactly one;
* the groups are placed largest packed cost first, each into the micro-batch of least packed cost it fits in
  (LPT, over the fewest micro-batches that fit, or exactly ``count``);
* micro-batches in veRL's order (by cost, the lightest at both ends), rows group by group, in batch order;
* deterministic: the same inputs give the same plan (ties go to the lower index).

Host-only, pure Python over lists of ints; ``prompt_groups`` compares prompts exactly, as the forest does (bytes).
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Optional, Sequence

import torch

__all__ = ["MicroBatches", "balance_micro_batches", "min_micro_batches", "prompt_groups"]


@dataclasses.dataclass(frozen=True)
class MicroBatches:
    """A plan: ``rows`` of each micro-batch, their valid (budget) and packed token counts, and the reasons."""

    rows: tuple[tuple[int, ...], ...]
    valid_tokens: tuple[int, ...]
    packed_tokens: tuple[int, ...]
    max_tokens: int
    groups: int
    reasons: tuple[str, ...] = ()

    @property
    def balance(self) -> float:
        """Max over min packed tokens of the micro-batches (1.0 is perfect)."""
        return max(self.packed_tokens) / max(min(self.packed_tokens), 1) if self.rows else 1.0

    def explain(self) -> str:
        n_rows = sum(len(r) for r in self.rows)
        lines = [
            f"{len(self.rows)} micro-batches of {n_rows} rows in {self.groups} groups, budget {self.max_tokens} "
            f"valid tokens per micro-batch; balance (max/min packed tokens) {self.balance:.3f}",
            f"  valid tokens:  {list(self.valid_tokens)}",
            f"  packed tokens: {list(self.packed_tokens)}",
        ]
        return "\n".join(lines + [f"  {r}" for r in self.reasons])


@dataclasses.dataclass
class _Group:
    key: Hashable
    rows: list[int]
    valid: int
    shared: int = 0
    cost: int = 0

    def packed(self, tokens: Sequence[int], rows: Sequence[int]) -> int:
        """The packed tokens of some of its rows: the shared prompt once, the rest of each row."""
        return self.shared + sum(int(tokens[r]) - self.shared for r in rows)


def prompt_groups(ids: torch.Tensor, lengths: Sequence[int], prompt_lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Rows whose prompts are equal, token for token: a group id per row (``0..G-1`` in order of first row) and each
    group's prompt length (the tokens its rows share).

    ``ids``: the rows' valid tokens back to back (veRL's nested ``input_ids.values()``), on any device (one copy to
    the host); ``lengths``: each row's valid tokens; ``prompt_lengths``: each row's prompt tokens (its first ones)."""
    if len(lengths) != len(prompt_lengths):
        raise ValueError(f"lengths ({len(lengths)}) and prompt_lengths ({len(prompt_lengths)}) must have one entry a row")
    host = ids.detach().reshape(-1).to("cpu", torch.int64).numpy()
    if sum(lengths) != host.size:
        raise ValueError(f"ids holds {host.size} tokens, the lengths add up to {sum(lengths)}")
    index: dict[tuple[int, bytes], int] = {}
    group, shared, start = [], [], 0
    for n, p in zip(lengths, prompt_lengths):
        if not 0 <= p <= n:
            raise ValueError(f"a prompt length {p} outside its row's {n} tokens")
        g = index.setdefault((p, host[start:start + p].tobytes()), len(index))
        if g == len(shared):
            shared.append(p)
        group.append(g)
        start += n
    return group, shared


def _groups(tokens: Sequence[int], groups: Sequence[Hashable], shared) -> list[_Group]:
    if len(tokens) != len(groups):
        raise ValueError(f"tokens ({len(tokens)}) and groups ({len(groups)}) must have one entry a row")
    by_key: dict[Hashable, _Group] = {}
    for row, (n, g) in enumerate(zip(tokens, groups)):
        if int(n) < 0:
            raise ValueError(f"row {row} has a negative token count {n}")
        entry = by_key.setdefault(g, _Group(g, [], 0, 0))
        entry.rows.append(row)
        entry.valid += int(n)
    for entry in by_key.values():
        entry.shared = 0 if shared is None else int(shared[entry.key])
        if not 0 <= entry.shared <= min(int(tokens[r]) for r in entry.rows):
            raise ValueError(f"group {entry.key!r}: {entry.shared} shared tokens, more than a row of it holds")
        entry.cost = entry.packed(tokens, entry.rows)
    return list(by_key.values())  # in order of first row


def _place(items: list[_Group], k: int, max_tokens: int) -> Optional[list[list[_Group]]]:
    """LPT into ``k`` bins under the budget: each group (largest cost first) into the fitting bin of least cost."""
    bins: list[list[_Group]] = [[] for _ in range(k)]
    cost, valid = [0] * k, [0] * k
    for item in sorted(items, key=lambda g: (-g.cost, -g.valid, g.rows[0])):
        fits = [b for b in range(k) if valid[b] + item.valid <= max_tokens]
        if not fits:
            return None
        b = min(fits, key=lambda b: (cost[b], valid[b], b))
        bins[b].append(item)
        cost[b] += item.cost
        valid[b] += item.valid
    return _refine(bins, max_tokens)


def _refine(bins: list[list[_Group]], max_tokens: int) -> list[list[_Group]]:
    """Moves and swaps of groups between the heaviest and the lightest bin while they narrow that pair's gap
    (within the budget): LPT's last placements are coarse."""
    for _ in range(4 * sum(len(b) for b in bins)):
        cost = [sum(g.cost for g in b) for b in bins]
        valid = [sum(g.valid for g in b) for b in bins]
        h = max(range(len(bins)), key=lambda b: (cost[b], -b))
        lo = min(range(len(bins)), key=lambda b: (cost[b], b))
        gap, best = cost[h] - cost[lo], None
        for i, a in enumerate(bins[h]):
            for j, b in enumerate([None] + bins[lo]):
                dc = a.cost - (b.cost if b else 0)
                dv = a.valid - (b.valid if b else 0)
                if valid[lo] + dv > max_tokens or valid[h] - dv > max_tokens or (b is None and len(bins[h]) == 1):
                    continue
                new = abs(gap - 2 * dc)
                if new < gap and (best is None or new < best[0]):
                    best = (new, i, j)
        if best is None:
            break
        _, i, j = best
        a = bins[h].pop(i)
        if j:
            bins[h].append(bins[lo].pop(j - 1))
        bins[lo].append(a)
    return bins


def _fewest(items: list[_Group], max_tokens: int) -> list[list[_Group]]:
    """The placement over the fewest bins LPT fits in (from the token bound up; one bin a group always fits)."""
    k = -(-sum(g.valid for g in items) // max_tokens) if items else 0
    while True:
        bins = _place(items, max(k, 1), max_tokens) if items else []
        if bins is not None:
            return bins
        k += 1


def _check(max_tokens, count) -> None:
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if count is not None and (not isinstance(count, int) or count < 1):
        raise ValueError(f"count must be a positive integer or None, got {count!r}")


def min_micro_batches(tokens: Sequence[int], groups: Sequence[Hashable], max_tokens: int, *, shared=None) -> int:
    """The fewest micro-batches ``balance_micro_batches`` needs for these rows (before a common ``count``)."""
    _check(max_tokens, None)
    items = _groups(tokens, groups, shared)
    over = [g for g in items if g.valid > max_tokens]
    return len(over) + len(_fewest([g for g in items if g.valid <= max_tokens], max_tokens))


def balance_micro_batches(
    tokens: Sequence[int], groups: Sequence[Hashable], max_tokens: int, *, shared=None, count: Optional[int] = None,
) -> MicroBatches:
    """Micro-batches of whole groups (module docstring). ``tokens``: each row's valid tokens; ``groups``: each row's
    group (any hashable: rows with the same one share a prompt); ``shared``: the tokens each group's rows share (its
    prompt length), indexed by its id (default: none); ``count``: exactly this many micro-batches (at least
    ``min_micro_batches``, at most the rows), else the fewest."""
    _check(max_tokens, count)
    items = _groups(tokens, groups, shared)
    reasons = []
    over = [[g] for g in items if g.valid > max_tokens]
    for (g,) in over:
        reasons.append(f"group of rows {g.rows}: {g.valid} valid tokens, over the budget of {max_tokens}: a "
                       f"micro-batch of its own ({g.cost} packed)")
    rest = [g for g in items if g.valid <= max_tokens]
    bins = _fewest(rest, max_tokens)
    if count is not None:
        if count < len(over) + len(bins):
            raise ValueError(f"count={count}: these rows need at least {len(over) + len(bins)} micro-batches")
        if count > len(tokens):
            raise ValueError(f"count={count} micro-batches of {len(tokens)} rows: one would be empty")
        k = min(count - len(over), len(rest))
        bins = (_place(rest, k, max_tokens) if k > len(bins) else None) or bins
    parts = [[r for g in sorted(b, key=lambda g: g.rows[0]) for r in g.rows] for b in over + bins]
    groups_of = [len(b) for b in over + bins]
    while count is not None and len(parts) < count:
        # More micro-batches asked for than LPT filled: halve the heaviest micro-batch of several groups, or else
        # (no such one) the largest group's rows.
        split = [i for i in range(len(parts)) if groups_of[i] > 1] or [i for i in range(len(parts)) if len(parts[i]) > 1]
        i = max(split, key=lambda i: (_packed(parts[i], items, tokens), -i))
        rows, several = parts[i], groups_of[i] > 1
        if several:
            whole = [g for g in items if g.rows[0] in rows]
            halves = _place(whole, 2, sum(g.valid for g in whole))
            parts[i:i + 1] = [[r for g in sorted(h, key=lambda g: g.rows[0]) for r in g.rows] for h in halves]
            groups_of[i:i + 1] = [len(h) for h in halves]
        else:
            parts[i:i + 1] = [rows[: len(rows) // 2], rows[len(rows) // 2:]]
            groups_of[i:i + 1] = [1, 1]
            reasons.append(f"group of rows {rows} split across micro-batches: {count} micro-batches asked for "
                           f"(the data-parallel ranks' common count) and no micro-batch of several groups left to halve")
    return _plan(parts, items, tokens, max_tokens, reasons)


def _packed(rows: Sequence[int], items: list[_Group], tokens: Sequence[int]) -> int:
    """The packed tokens of a micro-batch: each group's (or part of a group's) prompt once, the rest of each row."""
    mine = set(rows)
    return sum(g.packed(tokens, [r for r in g.rows if r in mine]) for g in items if mine.intersection(g.rows))


def _plan(parts, items, tokens, max_tokens, reasons) -> MicroBatches:
    costs = [_packed(p, items, tokens) for p in parts]
    # veRL's order (use_dynamic_bsz_balance): by cost, heaviest first, then every other one reversed in front, so the
    # lightest micro-batches sit at both ends.
    order = sorted(range(len(parts)), key=lambda i: (-costs[i], parts[i][0]))
    order = order[::2][::-1] + order[1::2]
    return MicroBatches(
        rows=tuple(tuple(parts[i]) for i in order),
        valid_tokens=tuple(sum(int(tokens[r]) for r in parts[i]) for i in order),
        packed_tokens=tuple(costs[i] for i in order),
        max_tokens=max_tokens, groups=len(items), reasons=tuple(reasons),
    )
