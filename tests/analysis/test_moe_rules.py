"""MoE routing and expert dispatch (analysis/moe_rules.py): the per-op rows, and the grouped dispatch as a whole.

``MOE_TABLES`` are rows of test_token_rules' tables (run there with the
others), written in the row language of ``rule_rows.py``. The grouped
dispatch (sort by expert, gather, histc/cumsum offsets, grouped matmuls,
inverse permutation) is checked on Dynamo graphs of a small function written
as Hugging Face's ``grouped_mm_experts_forward``: the analysis tags it, the
packed graph equals the original at every valid position (values and
gradients), and each way of reading a step of the dispatch other than the
one it exists for refuses the graph.
"""

from __future__ import annotations

import importlib
import operator

import pytest
import torch
import torch.nn.functional as F

import dualkv_compile
from dualkv_compile.analysis.node_info import Kind, NodeInfo, Route
from dualkv_compile.analysis.token_axes import analyze_token_axes
from dualkv_compile.analysis.token_inputs import find_token_inputs
from dualkv_compile.analysis.rule_registry import rule_for
from dualkv_compile.rewrite.pack_graph import pack_graph
from dualkv_compile.rewrite.packed_inputs import PackedInputs

from ..helpers import capture, grpo_batch, rel
from .rule_rows import B, S, D, NONE, TOKEN, In, X0, X1, X2, apply_rule, fails, fn, meth, out, weighs
from .test_token_rules import test_rule as check_row  # one row's check (not collected again under this name)

transformers = pytest.importorskip("transformers")
importlib.import_module("transformers.integrations.moe")  # registers torch.ops.transformers.grouped_mm_fallback

x = In((B, S, D), "b s -", TOKEN)
merged = In((B * S, D), "bs -", TOKEN)
ids2 = In((B * S * 2,), "bs", TOKEN, value=torch.randint(0, 4, (B * S * 2,)), slen=S)  # top-2 expert ids, flattened
top_i = In((B * S, 2), "bs -", TOKEN, value=torch.randint(0, 4, (B * S, 2)))

MOE_TABLES = {
    "select": [
        ("topk-experts", fn(torch.topk, X0, 2, dim=-1), [x], out("b s -", TOKEN)),
        ("topk-method", meth("topk", X0, 2), [merged], out("bs -", TOKEN)),
        ("topk-along-s", fn(torch.topk, X0, 2, 1), [x], fails("topk along a token axis")),
        ("topk-method-along-bs", meth("topk", X0, 2, 0), [merged], fails("topk along a token axis")),
        ("sort-features", fn(torch.sort, X0, -1), [x], out("b s -", TOKEN)),
        ("sort-method-features", meth("sort", X0, dim=2), [x], out("b s -", TOKEN)),
        ("argsort", fn(torch.argsort, X0, -1), [x], out("b s -", TOKEN)),
        ("argsort-method", meth("argsort", X0, 2, True), [x], out("b s -", TOKEN)),
        ("argsort-along-s", fn(torch.argsort, X0, 1), [x], fails("argsort along a token axis")),
        # Along the token axis only an ascending sort of integer ids starts a dispatch (test_expert_sort).
        ("sort-floats-along-bs", fn(torch.sort, X0, 0), [In((B * S,), "bs", TOKEN, slen=S)], fails("sort along a token axis")),
        ("sort-ids-descending", fn(torch.sort, X0, descending=True), [ids2], fails("sort along a token axis")),
        ("sort-method-next-token-ids", meth("sort", X0),
         [In((B * (S - 1),), "bs", TOKEN, value=torch.randint(0, 4, (B * (S - 1),)), shift=1, slen=S - 1)],
         fails("sort along a token axis")),
    ],
    "one_hot": [
        ("expert-mask", fn(F.one_hot, X0, num_classes=5), [top_i], out("bs - -", TOKEN)),
        ("ids", fn(F.one_hot, X0, 10), [In((B, S), "b s", TOKEN, value=torch.randint(0, 10, (B, S)))], out("b s -", TOKEN)),
        ("classes-from-data", fn(F.one_hot, X0), [top_i], fails("one_hot with num_classes inferred from the largest id")),
    ],
    "count": [
        # Expert counts over the batch: weighted by multiplicity on the packed stream (analysis/token_reductions.py).
        ("histc", fn(torch.histc, X0, bins=4, min=0, max=3), [In((B * S * 2,), "bs", TOKEN)], weighs("-", "histc")),
        ("histc-method", meth("histc", X0, 4, 0, 3), [In((B * S * 2,), "bs", TOKEN)], weighs("-", "histc")),
        ("histc-range-of-data", fn(torch.histc, X0, bins=4), [In((B * S * 2,), "bs", TOKEN)], fails("histc whose range is taken from the data")),
        ("histc-of-ids", fn(torch.histc, X0, 4, 0, 4), [In((B * S * 2,), "bs", TOKEN, from_inputs=True)], fails("of the inputs alone")),
        ("bincount", fn(torch.bincount, X0), [ids2], fails("bincount counts entries over every token")),
        ("bincount-method", meth("bincount", X0, minlength=4), [ids2], fails("bincount counts")),
    ],
    # DeepSeek-V3's group-limited routing: each token's top groups marked in a zeros_like of its group scores.
    "scatter": [
        ("groups-method", meth("scatter", X0, 1, X1, 1), [In((B * S, 4), "bs -", TOKEN), In((B * S, 2), "bs -", TOKEN, value=torch.randint(0, 4, (B * S, 2)))],
         out("bs -", TOKEN)),
        ("torch-src", fn(torch.scatter, X0, -1, X1, X2), [x, In((B, S, 2), "b s -", TOKEN, value=torch.randint(0, D, (B, S, 2))), In((B, S, 2), "b s -", TOKEN)],
         out("b s -", TOKEN)),
        ("along-bs", meth("scatter", X0, 0, X1, 1), [In((B * S, 4), "bs -", TOKEN), In((B * S, 4), "bs -", TOKEN, value=torch.randint(0, B * S, (B * S, 4)))],
         fails("scatter along a token axis")),
        ("reduce", meth("scatter", X0, 1, X1, 1, reduce="add"), [In((B * S, 4), "bs -", TOKEN), In((B * S, 2), "bs -", TOKEN, value=torch.randint(0, 4, (B * S, 2)))],
         fails("scatter with a reduction")),
        ("constant-index", meth("scatter", X0, 1, X1, 1), [In((B * S, 4), "bs -", TOKEN), In((1, 2), "- -", NONE, value=torch.zeros(1, 2, dtype=torch.long))],
         fails("does not follow its tensor's token axes")),
    ],
    "repeat_interleave": [
        # batched_mm: each token's row top-k times, token-major (k entries per token of the merged axis).
        ("rows-per-token", meth("repeat_interleave", X0, 2, dim=0), [merged], out("bs -", TOKEN)),
        ("torch-along-s", fn(torch.repeat_interleave, X0, 2, 1), [x], out("b s -", TOKEN)),
        ("features", meth("repeat_interleave", X0, 2, -1), [x], out("b s -", TOKEN)),
        ("along-b", meth("repeat_interleave", X0, 2, 0), [x], fails("repeat_interleave along the b axis")),
        ("flattened", meth("repeat_interleave", X0, 2), [merged], fails("without an int count and dim")),
        # HF's load-balancing loss: the flat mask, k entries per token (a 1-d value keeps its order).
        ("flat-mask", meth("repeat_interleave", X0, 2), [In((B * S,), "bs", TOKEN)], out("bs", TOKEN)),
    ],
}


@pytest.mark.parametrize(
    "op, inputs, expected",
    [pytest.param(*row[1:], id=f"{table}:{row[0]}") for table, rows in MOE_TABLES.items() for row in rows],
)
def test_rule(op, inputs, expected):
    check_row(op, inputs, expected)


def test_expert_sort():
    """``sort`` of top-k expert ids along their merged token axis: the dispatch's start, 2 entries per token."""
    res = apply_rule(fn(torch.sort, X0), [ids2])
    assert (res.kind, res.tags, res.slen, res.route.what, res.route.factor) == (Kind.ROUTED, ("r",), S, "sort", 2)
    assert res.route.order.target is torch.sort


def test_one_row_batch_reshaped_back():
    """A one-row batch (remove-padding, [1, S]) flattened to [S, D] by an MoE block and reshaped back to
    [1, S, D]: the batch axis returns, so the block's output adds to the [b, s] residual."""
    graph = torch.fx.Graph()
    flat = graph.placeholder("flat")
    flat.meta["example_value"] = torch.randn(S, D)
    node = graph.call_method("reshape", (flat, 1, S, D))
    node.meta["example_value"] = flat.meta["example_value"].reshape(1, S, D)
    info = {flat: NodeInfo(Kind.TOKEN, ("bs", None), slen=S)}
    assert rule_for(node)(node, info, 1, S) == NodeInfo(Kind.TOKEN, ("b", "s", None))
    # With more rows than one, [B*S] -> [1, B*S] is the merged axis behind a new dim.
    info[flat] = NodeInfo(Kind.TOKEN, ("bs", None), slen=S // 2)
    assert rule_for(node)(node, info, 2, S // 2) == NodeInfo(Kind.TOKEN, (None, "bs", None))


# ------------------------------------------------------------------ the grouped dispatch on Dynamo graphs

E, K, H, V = 4, 2, 8, 31  # experts, top-k, expert width, vocabulary (D = 8: the hidden size)
_mm = torch.ops.transformers.grouped_mm_fallback


def _dispatch(input_ids, emb, router, w_up, w_down, variant, attention_mask=None):
    """Hugging Face's ``grouped_mm_experts_forward`` after a router; ``variant`` changes one step."""
    h = F.embedding(input_ids, emb)
    b, s, _ = h.shape
    hs = h.view(-1, D)
    probs = F.softmax(F.linear(hs, router), dim=-1)
    top_w, top_i = torch.topk(probs, K, dim=-1)
    top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    if variant == "batched":  # batched_mm_experts_forward: no sort, every step per token
        ids = top_i.reshape(-1)
        xs = hs.repeat_interleave(K, dim=0)
        y = torch.bmm(w_up[ids], xs.unsqueeze(-1)).squeeze(-1)
        y = torch.bmm(w_down[ids], F.silu(y).unsqueeze(-1)).squeeze(-1)
        y = y * top_w.reshape(-1).unsqueeze(-1)
        return y.view(-1, K, D).sum(dim=1).view(b, s, D)
    ids, weights = top_i.reshape(-1), top_w.reshape(-1)
    keys, perm = torch.sort(ids, descending=variant == "descending")
    xs = hs[perm // (3 if variant == "floordiv-3" else K)]
    ws = weights[perm]
    counts = torch.histc(keys.float(), bins=E, min=0, max=2 * E if variant == "bins" else E - 1)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    if variant == "F.grouped_mm":  # bfloat16 only under torch.compile
        y = F.silu(F.grouped_mm(xs.bfloat16(), w_up.bfloat16().transpose(-2, -1), offs=offs))
        y = F.grouped_mm(y, w_down.bfloat16().transpose(-2, -1), offs=offs).float()
    else:
        y = F.silu(_mm(xs, w_up.transpose(-2, -1), offs=offs))
        y = _mm(y, w_down.transpose(-2, -1), offs=offs)
    y = y * ws.unsqueeze(-1)
    if variant == "sum-sorted":
        y = y + y.sum(dim=0)
    if variant == "cumsum-sorted":
        y = y.cumsum(dim=0)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.size(0)).flip(0) if variant == "not-arange" else torch.arange(perm.size(0))
    if variant == "two-sorts":
        _, perm2 = torch.sort((ids + 1) % E)
        inv2 = torch.empty_like(perm2)
        inv2[perm2] = torch.arange(perm2.size(0))
        inv = inv2
    out = y[inv].view(-1, K, D).sum(dim=1).view(b, s, D)
    if variant == "counts-as-data":
        out = out + counts.sum()
    if variant == "capacity":  # Switch-style: each entry's position in its expert's queue, over all tokens
        position = torch.cumsum(F.one_hot(ids, E), dim=0)
        out = out * (position.sum(-1).view(-1, K).amax(-1) < 8).view(b, s, 1)
    if variant == "perm-output":
        return out, perm
    if variant == "masked-counts":  # a load-balancing loss's counts, in the original layout: k ids per token
        flat_mask = attention_mask.reshape(-1).float().repeat_interleave(K)
        return out, torch.zeros(E).scatter_add(0, top_i.reshape(-1), flat_mask)
    return out


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"emb": (V, D), "router": (E, D), "w_up": (E, H, D), "w_down": (E, D, H)}
    return {k: (torch.randn(*v, generator=g) * 0.5).requires_grad_() for k, v in shapes.items()}


GROUPS = [(5, [3, 4, 2]), (3, [2, 5])]


def _graph(variant):
    ids, mask, _ = grpo_batch(GROUPS, V)
    inputs = []
    w = _weights()
    if variant == "masked-counts":
        fn = lambda input_ids, attention_mask: _dispatch(input_ids, **w, variant=variant, attention_mask=attention_mask)  # noqa: E731
        gm = capture(fn, ids, mask, example_inputs=inputs)
    else:
        gm = capture(lambda input_ids: _dispatch(input_ids, **w, variant=variant), ids, example_inputs=inputs)
    return gm, inputs, ids, mask


def _analyze(variant):
    gm, inputs, ids, mask = _graph(variant)
    return gm, analyze_token_axes(gm, find_token_inputs(gm.graph), attention=[]), inputs, ids, mask


@pytest.mark.parametrize("variant", ["grouped", "F.grouped_mm", "batched", "masked-counts"])
def test_dispatch_packs_exactly(variant):
    gm, axes, inputs, ids, mask = _analyze(variant)
    assert axes.refusals == ()
    kinds = {n.name: axes.info[n] for n in gm.graph.nodes if n.op != "output"}
    if variant == "batched":
        assert not any(i.kind is Kind.ROUTED for i in kinds.values())
    else:
        routes = [i.route.what for i in kinds.values() if i.kind is Kind.ROUTED]
        assert {"sort", "keys", "perm", "values", "counts", "offsets", "inverse", "mutation"} == set(routes)
    result = gm.graph.find_nodes(op="output")[0].all_input_nodes[0]
    assert axes.info[result] == NodeInfo(Kind.TOKEN, ("b", "s", None), slen=ids.shape[1])

    packed = pack_graph(gm, axes, "reference")
    layout = dualkv_compile.detect(ids, mask)
    assert layout.num_tokens < ids.numel()
    if variant != "batched":
        sorts = [n for n in packed.graph.nodes if n.target is torch.sort]
        assert len(sorts) == 1
    got = packed(*inputs, *PackedInputs.of(layout))
    want = gm(*inputs)
    if variant == "masked-counts":  # the counts read the top-k ids in the original layout (pack_graph.emit_original)
        assert torch.equal(got[1], want[1])
    got, want = (t[0] if isinstance(t, (tuple, list)) else t for t in (got, want))
    valid = mask.bool()
    tol = 1e-2 if variant == "F.grouped_mm" else 1e-5
    assert rel(got[valid], want[valid]) <= tol
    params = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    proj = torch.randn(D, generator=torch.Generator().manual_seed(3))
    g_got = torch.autograd.grad((got[valid] @ proj).sum(), params)
    g_want = torch.autograd.grad((want[valid] @ proj).sum(), params)
    for a, b in zip(g_got, g_want):
        assert rel(a, b) <= tol


REFUSED = [
    ("perm-output", "an output of the MoE dispatch's expert sort depends on every token"),
    ("counts-as-data", "reads the MoE routing's counts as data"),
    ("bins", "does not give expert id 1 a bin of its own"),
    ("floordiv-3", "floordiv of a sort permutation by 3"),
    ("sum-sorted", "sum of expert-sorted values: sum of a routed value over the token axes"),
    ("cumsum-sorted", "cumulative sum along the sequence axis"),
    ("not-arange", "setitem does not write arange(n)"),
    ("two-sorts", "combines the values of two expert sorts"),
    ("capacity", "cumulative sum along the sequence axis couples tokens"),
]


@pytest.mark.parametrize("variant, why", REFUSED, ids=[v for v, _ in REFUSED])
def test_dispatch_refusals(variant, why):
    _, axes, *_ = _analyze(variant)
    assert any(why in r for r in axes.refusals), axes.refusals


def test_descending_sort_runs_in_the_original_layout():
    """A sort the dispatch rules do not take (descending) is an ordinary op along the token axis: computed on
    the unpacked values, the graph not refused."""
    gm, axes, *_ = _analyze("descending")
    assert axes.refusals == ()
    (result,) = gm.graph.find_nodes(op="output")[0].all_input_nodes
    assert axes.info[result].kind is Kind.ORIG and "sort along a token axis" in axes.info[result].cause


def test_inverse_permutation_is_written_once_before_it_is_read():
    gm, axes, *_ = _analyze("grouped")
    (setitem,) = [n for n in gm.graph.nodes if n.target is operator.setitem]
    inv = setitem.args[0]
    assert axes.info[inv].route == Route(axes.info[inv].route.order, "inverse", K)
    assert axes.info[inv].tags == ("bs",)
