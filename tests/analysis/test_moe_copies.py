"""Expert-major copies of the tokens (analysis/moe_copies.py): Llama 4's MoE dispatch, rule by rule and whole.

``COPIES_TABLES`` are rows of the registered rules (``repeat``, and the views ``moe_copies`` refines),
written in the row language of ``rule_rows.py`` and counted by test_token_rules' coverage tests; rows
that make copies (ROUTED, with a ``Route`` naming the node) are checked by ``test_makes_copies``.
``COPIES_READS`` are rows of ``routed_rule`` on copies inputs. The dispatch as a whole is checked on
Dynamo graphs of a small function written as ``Llama4TextMoe.forward``: the packed graph equals the
original at every valid position (values and gradients), and each variant that mixes tokens (a capacity,
an expert choosing its tokens, a view pairing the wrong entries, a sum over the copies) refuses the graph.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

import dualkv_compile
from dualkv_compile.analysis.moe_rules import routed_rule
from dualkv_compile.analysis.node_info import Kind, NodeInfo
from dualkv_compile.analysis.token_axes import analyze_token_axes
from dualkv_compile.analysis.token_inputs import find_token_inputs
from dualkv_compile.rewrite.pack_graph import pack_graph
from dualkv_compile.rewrite.packed_inputs import PackedInputs

from ..helpers import capture, grpo_batch, rel
from .rule_rows import B, D, NONE, S, TOKEN, Fails, In, X0, X1, apply_rule, couples, fails, fn, meth, out, tags, x
from .test_token_rules import test_rule as check_row  # one row's check (not collected again under this name)

N = B * S
ROUTED, ORIG = Kind.ROUTED, Kind.ORIG
merged = In((N, D), "bs -", TOKEN, slen=S)
scores_t = In((3, N), "- bs", TOKEN, slen=S)  # router scores [N, E] transposed
per_expert = In((3, N, D), "- bs -", TOKEN, slen=S)  # [E, N, D]: the experts' bmm


def copies(shape, spec="r -", k=3, **kw) -> In:
    return In(shape, spec, ROUTED, slen=S, route=("copies", k), **kw)


COPIES_TABLES = {
    "repeat": [
        ("features", meth("repeat", X0, 1, 2), [merged], out("bs -", TOKEN)),
        ("new-leading-dims", meth("repeat", X0, 2, 1, 1), [merged], out("- bs -", TOKEN)),
        ("tuple-counts", meth("repeat", X0, (1, 1, 2)), [x], out("b s -", TOKEN)),
        ("along-s", meth("repeat", X0, 1, 2, 1), [x], fails("repeat along the s axis")),
        ("along-b", meth("repeat", X0, 2, 1, 1), [x], fails("repeat along the b axis")),
        # k entries per token (a top-k's merged axis): no copies of it, computed in the original layout.
        ("per-token-entries", meth("repeat", X0, 2, 1), [In((N * 2, D), "bs -", TOKEN, slen=S)], fails("repeat along the bs axis")),
        ("next-token", meth("repeat", X0, 2, 1), [In((B * (S - 1), D), "bs -", TOKEN, shift=1, slen=S - 1)],
         fails("repeat along the bs axis")),
    ],
    # Views the copies refinement leaves to shape_rules' rule (which keeps its own result).
    "copies_view": [
        ("merge-b-s", meth("view", X0, N, D), [x], out("bs -", TOKEN)),
        ("token-major-merge", meth("reshape", X0, -1), [In((N, 3), "bs -", TOKEN, slen=S)], out("bs", TOKEN)),
        ("two-feature-dims-ahead", meth("reshape", X0, -1), [In((2, 3, N), "- - bs", TOKEN, slen=S)],
         fails("reshape that merges feature dims ahead of a token axis")),
        ("per-token-entries", meth("reshape", X0, -1), [In((3, N * 2), "- bs", TOKEN, slen=S)],
         fails("reshape that merges feature dims ahead of a token axis")),
        ("merge-with-features-too", meth("reshape", X0, -1), [per_expert],
         fails("reshape that merges feature dims ahead of a token axis")),
    ],
}


@pytest.mark.parametrize(
    "op, inputs, expected",
    [pytest.param(*row[1:], id=f"{table}:{row[0]}") for table, rows in COPIES_TABLES.items() for row in rows],
)
def test_rule(op, inputs, expected):
    check_row(op, inputs, expected)


MAKES_COPIES = [
    ("repeat", meth("repeat", X0, 3, 1), [merged], "r -", 3),
    ("repeat-tuple", meth("repeat", X0, (4, 1)), [merged], "r -", 4),
    ("repeat-and-tile", meth("repeat", X0, 3, 2), [merged], "r -", 3),
    ("scores", meth("reshape", X0, -1, 1), [scores_t], "r -", 3),  # [E, N] -> [E*N, 1]
    ("experts-out", meth("view", X0, -1, D), [per_expert], "r -", 3),  # [E, N, D] -> [E*N, D]
    ("torch.reshape", fn(torch.reshape, X0, (3 * N, D)), [per_expert], "r -", 3),
    ("flatten", meth("flatten", X0, 0, 1), [per_expert], "r -", 3),
    ("unit-dims", meth("reshape", X0, 1, 3 * N, D), [In((3, 1, N, D), "- - bs -", TOKEN, slen=S)], "- r -", 3),
]


@pytest.mark.parametrize("op, inputs, spec, k", [pytest.param(*r[1:], id=r[0]) for r in MAKES_COPIES])
def test_makes_copies(op, inputs, spec, k):
    res = apply_rule(op, inputs)
    assert (res.kind, res.tags, res.slen, res.route.what, res.route.factor) == (ROUTED, tags(spec), S, "copies", k)
    assert res.route.order.op != "placeholder"  # the node that made them


c = copies((3 * N, D))
c1 = copies((3 * N, 1))
W = In((5, D), "- -", NONE)

# Nodes reading copies, through routed_rule: (kind, tags, factor) for copies out, a NodeInfo, or a failure.
COPIES_READS = [
    ("mul", fn(operator.mul, X0, X1), [c, c1], (ROUTED, "r -", 3)),
    ("mul-parameter", fn(operator.mul, X0, X1), [c, In((D,), "-", NONE)], (ROUTED, "r -", 3)),
    ("to", meth("to", X0, torch.float64), [c], (ROUTED, "r -", 3)),
    ("linear", fn(F.linear, X0, X1), [c, W], (ROUTED, "r -", 3)),
    ("transpose", meth("transpose", X0, 0, 1), [c], (ROUTED, "- r", 3)),
    ("chunk-features", meth("chunk", X0, 2, -1), [c], (ROUTED, "r -", 3)),
    ("tile-features", meth("repeat", X0, 1, 2), [c], (ROUTED, "r -", 3)),
    # The split back recovers the token axis: [E*N, D] -> [E, N, D] (Llama4TextExperts' view).
    ("split", meth("view", X0, 3, -1, D), [c], out("- bs -", TOKEN, slen=S)),
    ("split-reshape", meth("reshape", X0, 3, N, D), [c], out("- bs -", TOKEN, slen=S)),
    ("split-unit-dims", meth("view", X0, 3, 1, N, D), [c], out("- - bs -", TOKEN, slen=S)),
    # Everything along the copies axis couples tokens.
    ("split-token-major", meth("view", X0, N, 3, D), [c], couples("reshape [36, 8] -> [12, 3, 8] that splits a token axis")),
    ("view-features", meth("view", X0, 3 * N, 2, D // 2), [c], couples("view of expert-major copies of the tokens: reshape")),
    ("slice", fn(operator.getitem, X0, (slice(0, N),)), [c], couples("slice along a token axis")),
    ("sum", meth("sum", X0, 0), [c], couples("sum of expert-major copies of the tokens")),
    ("cumsum", meth("cumsum", X0, 0), [c], couples("cumulative sum along the sequence axis")),
    ("topk", fn(torch.topk, X0, 2, 0), [c], couples("topk along a token axis")),
    ("sort", fn(torch.sort, X0), [copies((3 * N,), "r", value=torch.randint(0, 3, (3 * N,)))], couples("sort along a token axis")),
    ("contract", fn(torch.matmul, X0, X1), [In((5, 3 * N), "- -", NONE), c], couples("matmul that contracts over a token axis")),
    ("outer", fn(operator.mul, X0, X1), [c1, copies((1, 3 * N), "- r")], couples("to token axes ('r', 'r')")),
    ("size", meth("size", X0, 0), [c], couples("moves expert-major copies of the tokens to token axes ()")),
    ("repeat-copies", meth("repeat", X0, 2, 1), [c], couples("repeat along the r axis")),
    ("setitem", fn(operator.setitem, X0, (slice(None),), 0.0), [c], couples("no token-axis rule for setitem")),
    ("randn_like", fn(torch.randn_like, X0), [c], couples("draws different values for the copies")),
    ("different-counts", fn(operator.mul, X0, X1), [c, copies((3 * N, D), k=6)], couples("of different counts")),
    ("sort-values", fn(operator.mul, X0, X1), [c, In((3 * N, D), "r -", ROUTED, slen=S, route=("values", 1))],
     couples("combines expert-major copies of the tokens with an expert sort's values")),
    ("orig", fn(operator.mul, X0, X1), [c, In((3 * N, D), "- -", ORIG)], couples("with a value computed in the original layout")),
]


@pytest.mark.parametrize("op, inputs, expected", [pytest.param(*r[1:], id=r[0]) for r in COPIES_READS])
def test_reads_copies(op, inputs, expected):
    if isinstance(expected, Fails):
        with pytest.raises(expected.exc) as e:
            apply_rule(op, inputs, rule=routed_rule)
        assert expected.match in str(e.value)
        return
    res = apply_rule(op, inputs, rule=routed_rule)
    if isinstance(expected, NodeInfo):
        assert res == expected
        return
    kind, spec, k = expected
    assert (res.kind, res.tags, res.slen, res.route.what, res.route.factor) == (kind, tags(spec), S, "copies", k)


# ------------------------------------------------------------------ the dispatch on Dynamo graphs

E, H, V = 3, 6, 31  # experts, expert width, vocabulary (D = 8: the hidden size)


def _dispatch(input_ids, emb, router, gate_up, down, shared, variant, top_k=1):
    """``Llama4TextMoe.forward`` after an embedding, its in-place ``scatter_``/``add_`` out of place (as the
    backend's functionalization makes them; test_rotary_families runs the model itself); ``variant`` changes
    one step."""
    h = F.embedding(input_ids, emb)
    b, s, _ = h.shape
    hs = h.reshape(-1, D)
    logits = F.linear(hs, router)
    top_v, top_i = torch.topk(logits, top_k, dim=1)
    scores = torch.full_like(logits, float("-inf")).scatter(1, top_i, top_v)
    scores = torch.sigmoid(scores.float()).to(scores.dtype)
    if variant == "expert-choice":  # each expert keeps its 4 best tokens of the batch
        scores = scores * (scores >= scores.topk(4, dim=0).values[-1:])
    routed_in = hs.repeat(scores.shape[1], 1)
    routed_in = routed_in * scores.transpose(0, 1).reshape(-1, 1)
    xs = routed_in.view(E, -1, D)
    if variant == "token-major-view":  # [N, E, D] -> [E, N, D]: pairs copies of other tokens
        xs = routed_in.view(-1, E, D).transpose(0, 1)
    if variant == "capacity":  # each expert takes the first 6 tokens it is given, in batch order
        xs = xs * ((xs[..., :1] != 0).cumsum(dim=1) <= 6)
    gate, up = torch.bmm(xs, gate_up).chunk(2, dim=-1)
    routed_out = torch.bmm(up * F.silu(gate), down).view(-1, D)
    if variant == "sum-copies":
        routed_out = routed_out + routed_out.mean(dim=0)
    out = F.linear(hs, shared) + routed_out.reshape(E, -1, D).sum(dim=0)
    if variant == "copies-output":
        return out.view(b, s, D), routed_in
    return out.view(b, s, D)


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"emb": (V, D), "router": (E, D), "gate_up": (E, D, 2 * H), "down": (E, H, D), "shared": (D, D)}
    return {k: (torch.randn(*v, generator=g) * 0.5).requires_grad_() for k, v in shapes.items()}


GROUPS = [(5, [3, 4, 2]), (3, [2, 5])]


def _analyze(variant, top_k=1):
    ids, mask, _ = grpo_batch(GROUPS, V)
    inputs = []
    w = _weights()
    gm = capture(lambda input_ids: _dispatch(input_ids, **w, variant=variant, top_k=top_k), ids, example_inputs=inputs)
    return gm, analyze_token_axes(gm, find_token_inputs(gm.graph), attention=[]), inputs, ids, mask


@pytest.mark.parametrize("top_k", [1, 2])
def test_dispatch_packs_exactly(top_k):
    gm, axes, inputs, ids, mask = _analyze("llama4", top_k)
    assert axes.refusals == ()
    copies_of = {n.target for n in gm.graph.nodes if n.op != "output" and axes.info[n].kind is ROUTED}
    assert {"repeat", "reshape", "view", operator.mul} <= copies_of  # the dispatch runs on the packed stream
    assert all(axes.info[n].route.what == "copies" for n in gm.graph.nodes if n.op != "output" and axes.info[n].kind is ROUTED)
    result = gm.graph.find_nodes(op="output")[0].all_input_nodes[0]
    assert axes.info[result] == NodeInfo(Kind.TOKEN, ("b", "s", None), slen=ids.shape[1])

    packed = pack_graph(gm, axes, "reference")
    layout = dualkv_compile.detect(ids, mask)
    assert layout.num_tokens < ids.numel()
    (repeat,) = [n for n in packed.graph.nodes if n.target == "repeat"]
    got = packed(*inputs, *PackedInputs.of(layout))
    want = gm(*inputs)
    got, want = (t[0] if isinstance(t, (tuple, list)) else t for t in (got, want))
    valid = mask.bool()
    assert rel(got[valid], want[valid]) <= 1e-5
    params = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    proj = torch.randn(D, generator=torch.Generator().manual_seed(3))
    g_got = torch.autograd.grad((got[valid] @ proj).sum(), params)
    g_want = torch.autograd.grad((want[valid] @ proj).sum(), params)
    for a, b in zip(g_got, g_want):
        assert rel(a, b) <= 1e-5


REFUSED = [
    ("copies-output", "an output of the MoE dispatch's expert sort depends on every token"),
    ("sum-copies", "mean of expert-major copies of the tokens"),
    ("token-major-view", "view of expert-major copies of the tokens: reshape"),
    ("capacity", "cumulative sum along the sequence axis couples tokens"),
    ("expert-choice", "combines MoE routing values with a value computed in the original layout"),
]


@pytest.mark.parametrize("variant, why", REFUSED, ids=[v for v, _ in REFUSED])
def test_dispatch_refusals(variant, why):
    _, axes, *_ = _analyze(variant)
    assert any(why in r for r in axes.refusals), axes.refusals
