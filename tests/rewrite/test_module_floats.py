"""Module floats an op reads as numbers (rewrite.module_floats): baked into the packed graph, checked per call, so
the packed graph's own Dynamo trace does not restart after AOTAutograd traced it (issue 36's warm-start cost)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import dualkv_compile
from dualkv_compile.rewrite.module_floats import bake_module_floats


class _Block(nn.Module):
    """An embedding (its ``norm_type`` a float F.embedding takes as a number), a LayerNorm (``eps``, the same), an
    RMS-style ``+ eps`` (tensor arithmetic AOTAutograd tensorifies), causal attention and a head."""

    def __init__(self, vocab=32, dim=16, heads=2):
        super().__init__()
        self.heads, self.rms_eps = heads, 1e-6
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        B, S = input_ids.shape
        h = self.embed(input_ids)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.rms_eps)
        q, k, v = self.qkv(self.norm(h)).view(B, S, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(h + a.transpose(1, 2).reshape(B, S, -1))


def _loss(model, input_ids):
    logp = model(input_ids).float().log_softmax(-1)
    return -logp[:, :-1].gather(-1, input_ids[:, 1:, None]).mean()


def _batch():
    prompt = torch.randint(0, 32, (1, 12)).expand(4, 12)
    return torch.cat([prompt, torch.randint(0, 32, (4, 6))], 1)


def test_packed_graph_compiles_once_without_a_restart_and_a_changed_float_runs_unpacked():
    """Its packed graph traced once (a TensorifyScalarRestartAnalysis traced it twice: norm_type and eps were
    specialised only after AOTAutograd's whole trace), exact against eager, and after a LayerNorm eps changed."""
    torch.manual_seed(0)
    model, ids = _Block(), _batch()
    torch._dynamo.reset()
    start = len(dualkv_compile.reports())  # reports() is a copy: earlier tests' reports stay in it
    fn = dualkv_compile.policy_loss(_loss, dynamic=True, inner="aot_eager")
    loss = fn(model, ids)
    [report] = [r for r in dualkv_compile.reports()[start:] if r.rewritten]
    assert report.packed_calls == 1 and report.packed_compiles == 1, report
    torch.testing.assert_close(loss, _loss(model, ids))
    model.norm.eps = 1e-3  # Dynamo recompiles the frame (it guards the builtin module's eps) or the check runs unpacked
    torch.testing.assert_close(fn(model, ids), _loss(model, ids))


def test_every_module_float_is_baked_and_no_argument_float():
    """``norm_type``, the LayerNorm's ``eps`` and the ``+ eps`` of tensor arithmetic are baked with their values
    (left to AOTAutograd, that one became ops on a CPU tensor: C++ code in a CUDA graph, whose cached load probes
    the host's instruction sets); a float the function takes as an argument is never baked (it may change every
    step)."""
    graphs = []

    def backend(gm, example_inputs):  # as dualkv's backend: during the call, while Dynamo's graph args are in its meta
        graphs.append((gm, bake_module_floats(gm, example_inputs)))
        return gm.forward

    def f(model, input_ids, eps):
        h = model.norm(model.embed(input_ids))
        return F.layer_norm(h, (h.shape[-1],), eps=eps) + model.rms_eps

    torch._dynamo.reset()
    model = _Block()
    torch.compile(f, backend=backend, dynamic=True)(model, _batch(), 1e-4)
    [(gm, checks)] = graphs
    assert sorted((v, what.split(" (")[0]) for _, v, what in checks) == [
        (1e-06, "l_model_rms_eps"), (1e-05, "l_model_modules_norm_eps"), (2.0, "l_model_modules_embed_norm_type")]
    reads = {n.args[0].name for n in gm.graph.find_nodes(op="call_method", target="item")}
    assert reads == {"l_eps_"}, reads


def test_a_changed_tensor_arithmetic_module_float_runs_unpacked_and_exact():
    """The RMS-style ``+ eps`` float, now baked too: changing it between calls runs the original program (exact,
    with the reason reported) instead of the packed graph built for the old value."""
    torch.manual_seed(0)
    model, ids = _Block(), _batch()
    torch._dynamo.reset()
    start = len(dualkv_compile.reports())
    fn = dualkv_compile.policy_loss(_loss, dynamic=True, inner="aot_eager")
    torch.testing.assert_close(fn(model, ids), _loss(model, ids))
    model.rms_eps = 1e-2
    torch.testing.assert_close(fn(model, ids), _loss(model, ids))
    [report] = [r for r in dualkv_compile.reports()[start:] if r.rewritten]
    assert report.packed_calls == 1, report
    assert any("rms_eps" in why for why in report.fallback_reasons), report.fallback_reasons
