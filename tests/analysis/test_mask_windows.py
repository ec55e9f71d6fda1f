"""``analysis.mask_windows``: each spelling of a window read exactly, on graphs whose index tensors carry the
``[..., S, 1]`` / ``[..., 1, S]`` layouts that tell a query index from a key index; and what it cannot read.

Each case is also checked against the dense mask it stands for (the window read must reproduce the
comparison's own truth table), so a reader off by one fails here, not only in a model test.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from dualkv_compile.analysis.mask_windows import mask_windows
from tests.helpers import time_limit

S = 12


def _graph(build):
    """``(mask node, evaluate)``: the graph ``build(g, q, kv, lp)`` with q ``[1, 1, S, 1]``, kv ``[1, 1, 1, S]`` and a
    per-row offset lp ``[2, 1, 1, 1]`` (left padding), meta from running it on those shapes."""
    g = fx.Graph()
    q, kv, lp = g.placeholder("q"), g.placeholder("kv"), g.placeholder("lp")
    out = build(g, q, kv, lp)
    g.output(out)
    gm = fx.GraphModule(torch.nn.Module(), g)
    vals = (torch.arange(S).view(1, 1, S, 1), torch.arange(S).view(1, 1, 1, S), torch.tensor([0, 3]).view(2, 1, 1, 1))
    env = {}  # real values as example_value meta, as Dynamo gives them
    for n, v in zip(g.find_nodes(op="placeholder"), vals):
        env[n] = v
    for n in g.nodes:
        if n.op == "call_function":
            args = fx.node.map_arg(n.args, lambda a: env[a])
            env[n] = n.target(*args)
        if n in env:
            n.meta["example_value"] = env[n]
    return out, gm(*vals)


def _sub(g, a, b):
    return g.call_function(operator.sub, (a, b))


def _add(g, a, b):
    return g.call_function(operator.add, (a, b))


CASES = [
    # Hugging Face's sliding_window_overlay: kv > q - w  (w keys, q - kv < w)
    ("kv > q - 4", lambda g, q, kv, lp: g.call_function(operator.gt, (kv, _sub(g, q, 4))), 4, 0),
    ("kv >= q - 4", lambda g, q, kv, lp: g.call_function(operator.ge, (kv, _sub(g, q, 4))), 5, 0),
    ("q - kv < 3", lambda g, q, kv, lp: g.call_function(operator.lt, (_sub(g, q, kv), 3)), 3, 0),
    ("q - kv <= 3", lambda g, q, kv, lp: g.call_function(operator.le, (_sub(g, q, kv), 3)), 4, 0),
    ("3 > q - kv", lambda g, q, kv, lp: g.call_function(operator.gt, (3, _sub(g, q, kv))), 3, 0),
    ("kv + 5 > q", lambda g, q, kv, lp: g.call_function(operator.gt, (_add(g, kv, 5), q)), 5, 0),
    ("q < kv + 2", lambda g, q, kv, lp: g.call_function(operator.lt, (q, _add(g, kv, 2))), 2, 0),
    ("|q - kv| <= 2", lambda g, q, kv, lp: g.call_function(operator.le, (g.call_function(torch.abs, (_sub(g, q, kv),)), 2)), 3, 0),
    # chunked_overlay: (kv - lp) // c == (q - lp) // c
    ("chunks of 4 after left padding", lambda g, q, kv, lp: g.call_function(operator.eq, (
        g.call_function(operator.floordiv, (_sub(g, kv, lp), 4)), g.call_function(operator.floordiv, (_sub(g, q, lp), 4)))), 0, 4),
    ("chunks of 5", lambda g, q, kv, lp: g.call_function(operator.eq, (
        g.call_function(operator.floordiv, (q, 5)), g.call_function(operator.floordiv, (kv, 5)))), 0, 5),
    ("causal", lambda g, q, kv, lp: g.call_function(operator.le, (kv, q)), 0, 0),
]


@pytest.mark.parametrize("what, build, window, chunk", CASES, ids=[c[0] for c in CASES])
def test_forms_read_exactly(what, build, window, chunk):
    node, truth = _graph(build)
    read = mask_windows(node)
    assert (read.window, read.chunk, read.unknown) == (window, chunk, ()), what
    # The window read reproduces the comparison on the causal half, for every row's offset.
    q, kv = torch.arange(S)[:, None], torch.arange(S)[None, :]
    for row in range(truth.shape[0] if truth.dim() == 4 else 1):
        lp = (0, 3)[row] if "padding" in what else 0
        dq, dk = q - lp, kv - lp
        want = torch.ones(S, S, dtype=torch.bool)
        if window:
            want &= dq - dk < window
        if chunk:
            want &= torch.div(dq, chunk, rounding_mode="floor") == torch.div(dk, chunk, rounding_mode="floor")
        got = truth.expand(-1, -1, S, S)[min(row, truth.shape[0] - 1), 0]
        valid = (kv <= q) & (kv >= lp)
        assert torch.equal(got & valid, want & valid), what


@pytest.mark.parametrize("what, build", [
    ("q - kv > 2 (a lower bound)", lambda g, q, kv, lp: g.call_function(operator.gt, (_sub(g, q, kv), 2))),
    ("2 q > kv", lambda g, q, kv, lp: g.call_function(operator.gt, (_add(g, q, q), kv))),
    ("q == kv", lambda g, q, kv, lp: g.call_function(operator.eq, (q, kv))),
    ("chunks of 4 and 2", lambda g, q, kv, lp: g.call_function(operator.and_, (
        g.call_function(operator.eq, (g.call_function(operator.floordiv, (q, 4)), g.call_function(operator.floordiv, (kv, 4)))),
        g.call_function(operator.eq, (g.call_function(operator.floordiv, (q, 2)), g.call_function(operator.floordiv, (kv, 2))))))),
])
def test_what_it_cannot_read_is_unknown(what, build):
    node, _ = _graph(build)
    assert mask_windows(node).unknown, what


def test_several_windows_intersect():
    node, _ = _graph(lambda g, q, kv, lp: g.call_function(operator.and_, (
        g.call_function(operator.gt, (kv, _sub(g, q, 6))), g.call_function(operator.lt, (_sub(g, q, kv), 3)))))
    assert mask_windows(node).window == 3


def test_sequence_ids_read_at_q_and_kv_are_no_window():
    """Hugging Face's packed_sequence_mask (``ids[b, q] == ids[b, kv]``) is a group rule the layout's sequences
    hold, not a window: read as none, nothing unknown; the same lookup against another tensor stays unknown."""
    def build(other):
        def f(g, q, kv, lp):
            ids = g.placeholder("ids")
            ids2 = g.placeholder("ids2") if other else ids
            a = g.call_function(operator.getitem, (ids, (0, q)))
            b = g.call_function(operator.getitem, (ids2, (0, kv)))
            return g.call_function(operator.eq, (a, b))
        return f

    for other, unknown in ((False, ()), (True, ("eq",))):
        g = fx.Graph()
        q, kv, lp = g.placeholder("q"), g.placeholder("kv"), g.placeholder("lp")
        out = build(other)(g, q, kv, lp)
        for n, v in ((q, torch.zeros(1, 1, S, 1, dtype=torch.long)), (kv, torch.zeros(1, 1, 1, S, dtype=torch.long))):
            n.meta["example_value"] = v
        assert mask_windows(out).unknown == unknown


def _shared_chain(g, x, steps: int):
    """``x = x * x`` then ``x = x / (x + 1)`` (a Sinkhorn-like normalisation), alternating, ``steps`` times: every step
    reads the previous one twice, so the expression, unfolded as a tree, has 2**steps leaves."""
    for i in range(steps):
        if i % 2:
            x = g.call_function(operator.truediv, (x, g.call_function(operator.add, (x, 1))))
        else:
            x = g.call_function(operator.mul, (x, x))
    return x


@pytest.mark.parametrize("form", ["window", "chunk"])
def test_shared_subexpressions_are_keyed_once(form):
    """A mask offset by a deep chain of shared subexpressions (DeepSeek-V4's hyper-connections' Sinkhorn iterations
    made its mask analysis exponential): two separately built but identical chains are one term, read in well
    under a second. Unmemoised structural keys take time (and memory) exponential in the chain's 40 steps."""
    g = fx.Graph()
    q, kv, lp = g.placeholder("q"), g.placeholder("kv"), g.placeholder("lp")
    for n, v in ((q, torch.zeros(1, 1, S, 1, dtype=torch.long)), (kv, torch.zeros(1, 1, 1, S, dtype=torch.long))):
        n.meta["example_value"] = v
    o1, o2 = _shared_chain(g, lp, 40), _shared_chain(g, lp, 40)  # distinct nodes, one structure
    assert o1 is not o2
    if form == "window":  # kv + o > q - 4 + o  <=>  q - kv < 4
        mask = g.call_function(operator.gt, (_add(g, kv, o1), _add(g, _sub(g, q, 4), o2)))
        want = (4, 0, ())
    else:  # (kv - o) // 4 == (q - o) // 4
        mask = g.call_function(operator.eq, (g.call_function(operator.floordiv, (_sub(g, kv, o1), 4)),
                                             g.call_function(operator.floordiv, (_sub(g, q, o2), 4))))
        want = (0, 4, ())
    g.output(mask)
    with time_limit(20):
        read = mask_windows(mask)
    assert (read.window, read.chunk, read.unknown) == want
    # Another structure (the last step's denominator, 39 steps and + 1, for the 40-step chain) is another term:
    # the window is not read.
    o3 = g.call_function(operator.add, (_shared_chain(g, lp, 39), 1))
    other = g.call_function(operator.gt, (_add(g, kv, o1), _add(g, _sub(g, q, 4), o3)))
    with time_limit(20):
        assert mask_windows(other).unknown == (other.name,)
