"""The group-keeping token balancer (``dualkv_compile.layout.micro_batches``) alone, on random GRPO-shaped rows.

Balance is max over min *packed* tokens per micro-batch (each group's prompt once per micro-batch it lands in). The
factors stated: against the best whole-group placement over the same number of micro-batches (brute force), at most
1.15x (measured here: at most 1.07x, equal in 95% of cases); against veRL 0.9.1's own ``rearrange_micro_batches`` on
the same rows (it splits groups), where the budget holds two of the largest group, at most 1.35x (measured: at most
1.31x, median 0.93x, better than veRL's in 81% of cases; one micro-batch more than veRL's in 12%). veRL's comparison
runs where veRL is importable (``make test-verl`` collects it through tests/integrations/test_verl.py); the
brute-force bound runs everywhere.
"""

from __future__ import annotations

import importlib.util
import itertools
import random

import pytest
import torch

from dualkv_compile.layout.micro_batches import balance_micro_batches, min_micro_batches, prompt_groups


def grpo_rows(rng, groups, max_rows=8, max_prompt=64, max_response=64):
    """Shuffled rows ``(group, prompt length, response length)`` of ``groups`` groups."""
    rows = []
    for g in range(groups):
        prompt = rng.randint(4, max_prompt)
        rows += [(g, prompt, rng.randint(1, max_response)) for _ in range(rng.randint(1, max_rows))]
    rng.shuffle(rows)
    return rows


def plan_of(rows, budget, count=None):
    tokens = [p + r for _, p, r in rows]
    shared = {g: p for g, p, _ in rows}
    return balance_micro_batches(tokens, [g for g, _, _ in rows], budget, shared=shared, count=count)


def packed_of(rows, part):
    """Packed tokens of a micro-batch, written out: each group's prompt once, plus its responses."""
    seen = {}
    for i in part:
        g, p, r = rows[i]
        seen[g] = seen.get(g, p) + r
    return sum(seen.values())


def group_tokens(rows):
    valid = {}
    for g, p, r in rows:
        valid[g] = valid.get(g, 0) + p + r
    return valid


def test_groups_are_never_split_and_the_budget_holds_over_random_inputs():
    rng = random.Random(0)
    for case in range(400):
        rows = grpo_rows(rng, rng.randint(1, 24))
        valid = group_tokens(rows)
        # From below the largest group (some go alone) to the whole batch (one micro-batch).
        budget = rng.randint(max(p + r for _, p, r in rows), sum(valid.values()))
        plan = plan_of(rows, budget)
        assert sorted(i for part in plan.rows for i in part) == list(range(len(rows))), case
        where = {}
        for m, part in enumerate(plan.rows):
            assert part, case
            for i in part:
                where.setdefault(rows[i][0], set()).add(m)
        assert all(len(ms) == 1 for ms in where.values()), (case, where)
        for part, v, packed in zip(plan.rows, plan.valid_tokens, plan.packed_tokens):
            assert v == sum(rows[i][1] + rows[i][2] for i in part) and packed == packed_of(rows, part)
            groups = {rows[i][0] for i in part}
            # Within the budget, unless it is one group over it on its own (and a reason names its rows).
            assert v <= budget or (len(groups) == 1 and valid[groups.pop()] > budget), (case, part, v, budget)
        over = [g for g, v in valid.items() if v > budget]
        assert len([r for r in plan.reasons if "over the budget" in r]) == len(over), case
        shared = {g: p for g, p, _ in rows}
        assert len(plan.rows) == min_micro_batches([p + r for _, p, r in rows], [g for g, _, _ in rows], budget, shared=shared)
        # Rows group by group in each micro-batch (the layout's group_size check reads them so), in batch order.
        first = {}
        for i, (g, _, _) in enumerate(rows):
            first.setdefault(g, i)
        assert all(list(part) == sorted(part, key=lambda i: (first[rows[i][0]], i)) for part in plan.rows), case


def test_a_group_over_the_budget_is_a_micro_batch_of_its_own_and_explain_says_so():
    # group 0: 4 rows of 10 + 6 (64 valid, 34 packed) over a budget of 40; groups 1 and 2 share a micro-batch.
    rows = [(0, 10, 6)] * 4 + [(1, 5, 3), (2, 6, 4), (1, 5, 2)]
    plan = plan_of(rows, 40)
    assert sorted(plan.rows) == [(0, 1, 2, 3), (4, 6, 5)]
    assert dict(zip(plan.rows, plan.packed_tokens))[(0, 1, 2, 3)] == 10 + 4 * 6
    text = plan.explain()
    assert "group of rows [0, 1, 2, 3]: 64 valid tokens, over the budget of 40: a micro-batch of its own (34 packed)" in text
    assert "2 micro-batches of 7 rows in 3 groups, budget 40 valid tokens" in text


def test_the_plan_is_deterministic_and_does_not_depend_on_the_group_names():
    rng = random.Random(1)
    for _ in range(50):
        rows = grpo_rows(rng, rng.randint(2, 16))
        budget = rng.randint(max(group_tokens(rows).values()), 4 * max(group_tokens(rows).values()))
        a, b = plan_of(rows, budget), plan_of(rows, budget)
        renamed = plan_of([(f"uid-{97 - g}", p, r) for g, p, r in rows], budget)
        assert a == b and a.rows == renamed.rows and a.packed_tokens == renamed.packed_tokens


def test_a_common_count_fills_with_whole_groups_first_and_splits_only_past_the_groups():
    rows = [(g, 8, 4) for g in range(5) for _ in range(2)]  # 5 groups of 2 rows, 24 valid each
    assert len(plan_of(rows, 120).rows) == 1
    plan = plan_of(rows, 120, count=3)  # the data-parallel ranks' maximum: more than this rank needs
    assert len(plan.rows) == 3 and not plan.reasons
    assert all(len({rows[i][0] for i in part}) * 2 == len(part) for part in plan.rows)
    plan = plan_of(rows, 120, count=7)  # past the 5 groups: two groups are split, and the reasons say so
    assert len(plan.rows) == 7 and sum("split across micro-batches" in r for r in plan.reasons) == 2
    with pytest.raises(ValueError, match="need at least 3"):
        plan_of(rows, 60, count=1)
    with pytest.raises(ValueError, match="one would be empty"):
        plan_of(rows, 120, count=11)


def _best_balance(rows, k, budget):
    """The best max/min packed tokens over every whole-group placement into ``k`` micro-batches within the budget."""
    valid, shared = group_tokens(rows), {g: p for g, p, _ in rows}
    packed = {g: valid[g] - (sum(1 for h, _, _ in rows if h == g) - 1) * shared[g] for g in valid}
    names, best = sorted(valid), None
    for assign in itertools.product(range(k), repeat=len(names) - 1):
        assign = (0, *assign)
        cost, tokens = [0] * k, [0] * k
        for g, b in zip(names, assign):
            cost[b] += packed[g]
            tokens[b] += valid[g]
        if min(cost) and max(tokens) <= budget:
            best = min(best or float("inf"), max(cost) / min(cost))
    return best


def test_balance_within_a_factor_of_the_best_whole_group_placement():
    rng = random.Random(2)
    checked = 0
    for _ in range(150):
        rows = grpo_rows(rng, rng.randint(2, 7))
        valid = group_tokens(rows)
        budget = rng.randint(max(valid.values()), max(max(valid.values()), sum(valid.values()) // 2))
        plan = plan_of(rows, budget)
        if 2 <= len(plan.rows) <= 3:
            assert plan.balance <= 1.15 * _best_balance(rows, len(plan.rows), budget), (rows, budget, plan)
            checked += 1
    assert checked >= 100


@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="veRL is installed in .venv-verl only")
def test_balance_within_a_factor_of_verls_rearrange_micro_batches():
    from tensordict import TensorDict
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    rng = random.Random(3)
    ours, theirs, extra = [], [], 0
    for _ in range(200):
        rows = grpo_rows(rng, rng.randint(4, 32))
        tokens = [p + r for _, p, r in rows]
        budget = 2 * max(group_tokens(rows).values())
        if 2 * budget > sum(tokens):
            continue
        plan = plan_of(rows, budget)
        ids = torch.nested.nested_tensor_from_jagged(torch.zeros(sum(tokens), dtype=torch.long),
                                                     torch.tensor([0, *itertools.accumulate(tokens)]))
        _, parts = rearrange_micro_batches(TensorDict({"input_ids": ids}, batch_size=[len(rows)]), budget)
        verl_packed = [packed_of(rows, part) for part in parts]
        ours.append(plan.balance)
        theirs.append(max(verl_packed) / min(verl_packed))
        extra += len(plan.rows) - len(parts)
        assert plan.balance <= 1.35 * theirs[-1], (rows, budget, plan, parts)
    assert len(ours) >= 150
    # Whole groups cost veRL's count at most one more micro-batch in a few cases of ten.
    assert extra <= 0.2 * len(ours)
    assert sum(o < t for o, t in zip(ours, theirs)) >= 0.6 * len(ours)


def test_prompt_groups_are_rows_with_equal_prompt_tokens():
    rows = [[1, 2, 3, 9], [1, 2, 3, 8, 8], [1, 2, 4, 7], [5, 6, 7], [1, 2, 3, 7]]
    prompts = [3, 3, 3, 2, 3]
    ids = torch.tensor([t for r in rows for t in r])
    groups, shared = prompt_groups(ids, [len(r) for r in rows], prompts)
    assert groups == [0, 0, 1, 2, 0] and shared == [3, 3, 2]
    # a prompt of another length is another group, even where its tokens begin the same
    assert prompt_groups(ids, [len(r) for r in rows], [3, 2, 3, 2, 3])[0] == [0, 1, 2, 3, 0]
    with pytest.raises(ValueError, match="tokens"):
        prompt_groups(ids[:-1], [len(r) for r in rows], prompts)
    with pytest.raises(ValueError, match="prompt length"):
        prompt_groups(ids, [len(r) for r in rows], [3, 3, 3, 4, 3])
