"""The per-op token-axis rules (analysis/token_rules.py, analysis/shape_rules.py), one table per rule family, and the driver.

Each row of ``TABLES`` (the rows live in ``rows_token_rules.py`` and
``rows_shape_rules.py`` and ``rows_recurrent_rules.py``, written in the row language of ``rule_rows.py``;
the MoE rows in ``test_moe_rules.py`` and ``test_moe_copies.py``) applies one op to placeholders and
names the ``NodeInfo`` its rule gives or the failure it raises. Every
registered rule key has a row and every row targets a registered rule. The
``test_driver_*`` tests run ``analyze_token_axes`` on small graphs.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from dualkv_compile.analysis.node_info import Kind, NodeInfo, RuleFailed
from dualkv_compile.analysis.token_axes import analyze_token_axes
from dualkv_compile.analysis.token_inputs import Role, TokenInput, TokenInputs
from dualkv_compile.analysis.rule_registry import REFINEMENTS, RULES, refine_rule, rule_for

from .rows_recurrent_rules import CAUSAL_CONV, GATED_DELTA_ROWS, MAMBA1_ROWS, MAMBA2_ROWS
from .rows_shape_rules import CAT, COMPLEX, GETITEM, MOVE, SIZE, SLICE_SCATTER, SPLIT, STACK, VIEW
from .rows_token_rules import (
    COUPLING, CUMULATIVE, DROPOUT, EMBEDDING, LIKE, LINEAR, MATMUL, MIN_MAX, NEW_LIKE, NORMS, REDUCTIONS, SCATTER, SOFTMAX,
    _pointwise_rows,
)
from .rule_rows import NONE, B, S, Fails, Weighs, apply_rule, tags


TABLES = {
    "pointwise": _pointwise_rows(),
    "like": LIKE,
    "linear": LINEAR,
    "embedding": EMBEDDING,
    "matmul": MATMUL,
    "reductions": REDUCTIONS,
    "min_max": MIN_MAX,
    "scatter": SCATTER,
    "new_like": NEW_LIKE,
    "slice_scatter": SLICE_SCATTER,
    "softmax": SOFTMAX,
    "norms": NORMS,
    "coupling": COUPLING,
    "dropout": DROPOUT,
    "cumulative": CUMULATIVE,
    "view": VIEW,
    "complex": COMPLEX,
    "move": MOVE,
    "getitem": GETITEM,
    "cat": CAT,
    "stack": STACK,
    "split": SPLIT,
    "size": SIZE,
    "causal_conv": CAUSAL_CONV,
    "gated_delta": GATED_DELTA_ROWS,
    "mamba2": MAMBA2_ROWS,
    "mamba1": MAMBA1_ROWS,
}


def _values(row):
    """A row's ``(id, op, inputs, expected)``, of a plain row or of one in ``pytest.param`` (with marks)."""
    return row.values if hasattr(row, "marks") else row


def _params():
    for table, rows in TABLES.items():
        for row in rows:
            values = _values(row)
            yield pytest.param(*values[1:], id=f"{table}:{values[0]}", marks=getattr(row, "marks", ()))


@pytest.mark.parametrize("op, inputs, expected", list(_params()))
def test_rule(op, inputs, expected):
    if isinstance(expected, Fails):
        with pytest.raises(expected.exc) as e:
            apply_rule(op, inputs)
        assert expected.match in str(e.value)
    elif isinstance(expected, Weighs):
        got = apply_rule(op, inputs)
        assert (got.kind, got.tags) == (NONE, tags(expected.spec)) and got.weighted is not None, got
        assert (got.weighted.op, got.weighted.operand.name) == (expected.op, f"x{expected.operand}")
    else:
        assert apply_rule(op, inputs) == expected


def _all_rows():
    from .test_moe_copies import COPIES_TABLES  # Llama 4's expert-major copies (analysis/moe_copies.py)
    from .test_moe_rules import MOE_TABLES  # the MoE routing rules' rows (analysis/moe_rules.py)

    return [row for tables in (TABLES, MOE_TABLES, COPIES_TABLES) for rows in tables.values() for row in rows]


def test_every_rule_key_has_a_row():
    covered = {_values(row)[1].key() for row in _all_rows()}
    missing = sorted(f"{op} {getattr(target, '__name__', target)}" for op, target in RULES if (op, target) not in covered)
    assert not missing, f"registered token-axis rules without a table row: {missing}"


def test_every_row_targets_a_registered_rule():
    keys = [_values(row)[1].key() for row in _all_rows()]
    assert [k for k in keys if k not in RULES] == []


def test_rule_for_unregistered():
    graph = fx.Graph()
    a = graph.placeholder("a")
    assert rule_for(a) is None
    assert rule_for(graph.call_function(torch.flip, (a,))) is None
    assert rule_for(graph.call_method("flip", (a,))) is None
    assert rule_for(graph.call_module("linear", (a,))) is None  # a module named like a method
    assert rule_for(graph.call_method("view", (a, 1))) is not None


def test_refinement_tried_before_the_rule():
    """``refine_rule``: a refinement's result where it applies (not None), else the target's rule; a target with a
    refinement and no rule fails as one without a rule does (computed in the original layout)."""
    graph = fx.Graph()
    a = graph.placeholder("a")
    flip, view = graph.call_function(torch.flip, (a, 1)), graph.call_method("view", (a, 1))
    mine, info = NodeInfo(Kind.NONE), {a: NodeInfo(Kind.NONE, ())}
    refinement = refine_rule(torch.flip, methods=("view",))(lambda node, info, B, S: mine if node.args[1:] == (1,) else None)
    try:
        assert rule_for(view)(view, info, B, S) is mine
        assert rule_for(flip)(flip, info, B, S) is mine
        flip.args = (a, (0,))
        with pytest.raises(RuleFailed, match="no token-axis rule for flip"):
            rule_for(flip)(flip, info, B, S)
    finally:
        for key in (("call_function", torch.flip), ("call_method", "view")):
            REFINEMENTS[key].remove(refinement)
            if not REFINEMENTS[key]:
                del REFINEMENTS[key]


def _analyze(build):
    """``analyze_token_axes`` of a graph over ``input_ids`` of shape [B, S] that ``build(graph, ids)`` completes."""
    graph = fx.Graph()
    ids = graph.placeholder("input_ids")
    ids.meta["example_value"] = torch.randint(0, 10, (B, S))
    result = build(graph, ids)
    graph.output(result)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    return analyze_token_axes(gm, TokenInputs((TokenInput(Role.INPUT_IDS, ids),)), attention=[]), result


def test_driver_no_rule():
    def build(graph, ids):
        n = graph.call_function(torch.flip, (ids, (1,)))
        n.meta["example_value"] = torch.flip(ids.meta["example_value"], (1,))
        return n

    axes, node = _analyze(build)
    assert axes.info[node].kind is Kind.ORIG
    assert axes.info[node].cause == f"{node.name}: no token-axis rule for flip"
    assert axes.refusals == ()


def test_driver_coupling_refuses_and_shift_is_inherited():
    def build(graph, ids):
        nxt = graph.call_function(operator.getitem, (ids, (slice(None), slice(1, None))))
        nxt.meta["example_value"] = ids.meta["example_value"][:, 1:]
        f = graph.call_method("float", (nxt,))
        f.meta["example_value"] = nxt.meta["example_value"].float()
        d = graph.call_function(F.dropout, (f, 0.1, True))
        d.meta["example_value"] = f.meta["example_value"]
        return (f, d)

    axes, (f, d) = _analyze(build)
    # Of the ids alone: the rewrite computes it in the original layout where that layout needs it.
    assert axes.info[f] == NodeInfo(Kind.TOKEN, ("b", "s"), shift=1, slen=S - 1, from_inputs=True)
    assert axes.info[d].kind is Kind.ORIG and not axes.info[d].from_inputs  # a random draw is never computed twice
    assert axes.refusals == (f"{d.name}: dropout p=0.1 in training mode draws different masks for the copies of a shared prompt",)


def test_driver_size_of_a_token_value_is_a_number_not_a_refusal():
    """``ids.size(1)`` (an int, not a tensor) and ``ids.size()`` read off a token value give NONE: the view they
    shape keeps its token axes, and the value divided by the size stays per-token."""

    def build(graph, ids):
        ev = ids.meta["example_value"]
        whole = graph.call_method("size", (ids,))
        whole.meta["example_value"] = ev.size()
        cols = graph.call_method("size", (ids, 1))
        cols.meta["example_value"] = ev.size(1)
        flat = graph.call_method("view", (ids, whole))
        flat.meta["example_value"] = ev.view(ev.size())
        scaled = graph.call_function(operator.truediv, (flat, cols))
        scaled.meta["example_value"] = flat.meta["example_value"] / ev.size(1)
        return (whole, cols, scaled)

    axes, (whole, cols, scaled) = _analyze(build)
    assert axes.info[whole].kind is Kind.NONE and axes.info[cols].kind is Kind.NONE
    assert (axes.info[scaled].kind, axes.info[scaled].tags) == (Kind.TOKEN, ("b", "s"))


def test_driver_arange_of_a_batch_as_long_as_its_sequence():
    """With B == S a static graph's ``arange(S)`` (the column index) and ``arange(B)`` (a row index) are one op,
    ``arange(n)``. It is a column value: lined up with the sequence axis the packed stream reads entry c at column
    c, as the original does whatever it was written for; lined up with the batch axis (a row index) it conflicts,
    and the value is computed in the original layout rather than packed as a column."""
    n = 5
    graph = fx.Graph()
    ids = graph.placeholder("input_ids")
    ids.meta["example_value"] = torch.randint(0, 10, (n, n))

    def op(target, *args, method=False):
        node = (graph.call_method if method else graph.call_function)(target, args)
        vals = [a.meta["example_value"] if isinstance(a, fx.Node) else a for a in args]
        node.meta["example_value"] = getattr(vals[0], target)(*vals[1:]) if method else target(*vals)
        return node

    idx = op(torch.arange, n)
    f = op("float", ids, method=True)
    by_column = op(operator.add, f, idx)  # f[b, s] + s
    rows = op(operator.getitem, idx, (slice(None), None))
    by_row = op(operator.add, f, rows)  # f[b, s] + b
    rows_expanded = op("expand", rows, n, n, method=True)
    by_expanded_row = op(operator.add, f, rows_expanded)
    graph.output((by_column, by_row, by_expanded_row))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    axes = analyze_token_axes(gm, TokenInputs((TokenInput(Role.INPUT_IDS, ids),)), attention=[])
    assert (axes.info[idx].kind, axes.info[idx].tags) == (Kind.COLUMN, ("s",))
    assert (axes.info[by_column].kind, axes.info[by_column].tags) == (Kind.TOKEN, ("b", "s"))
    assert axes.info[by_row].kind is Kind.ORIG and "broadcasts token axis" in axes.info[by_row].cause
    assert axes.info[by_expanded_row].kind is Kind.ORIG
    assert axes.refusals == ()
