"""In-place ops are part of the program (docs/design.md, semantics 9): made out-of-place and packed, or refused; never dropped."""

from __future__ import annotations

import copy
import operator
import functools

import pytest
import torch

import dualkv_compile
from dualkv_compile.backend import dualkv_backend
from dualkv_compile.normalize.functionalize import functionalize_mutations, mutated_input

from tests.helpers import hf_model, rel, grpo_batch
from tests.helpers import assert_loss_and_grads_match, clipped_objective, make_batch

pytestmark = pytest.mark.usefixtures("one_thread")


def _temperature_statement(logits, kind):
    """The in-place statements trainers write on logits (veRL's classic actor: ``logits.div_(temperature)``)."""
    if kind == "div_":
        logits.div_(0.7)
    elif kind == "mul_":
        logits.mul_(1 / 0.7)
    elif kind == "sub_":
        logits.sub_(logits.detach().abs() * 0.5)  # not a constant shift: log_softmax is shift-invariant
    elif kind == "copy_":
        logits.copy_(logits * 1.5)
    elif kind == "iadd":
        logits += torch.linspace(0, 2, logits.shape[-1])
    elif kind == "chain":
        logits.div_(0.7)
        logits.clamp_(-3.0, 3.0)


def _loss(model, batch, kind):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    _temperature_statement(logits, kind)
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    logp = logp.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    m = batch["response_mask"][:, 1:].float()
    return (clipped_objective(batch, logp) * m).sum() / m.sum()


# div_ (veRL's temperature), copy_ and a chain in `make test`; the other statements under `make test-slow` (the
# suite's time budget; the fuzz draws div_, mul_, sub_ and copy_ chains in `make test` too).
@pytest.mark.parametrize(
    "kind", ["div_", "copy_", "chain"] + [pytest.param(k, marks=pytest.mark.slow) for k in ("mul_", "sub_", "iadd")]
)
def test_in_place_statement_on_logits_is_kept_and_packed(kind):
    torch._dynamo.reset()
    model = hf_model("qwen3", "sdpa")
    ref_model = copy.deepcopy(model)
    batch = make_batch([(7, [3, 5, 4, 2])])
    loss = dualkv_compile.policy_loss(functools.partial(_loss, kind=kind), inner="aot_eager")
    assert_loss_and_grads_match(loss(model, batch), _loss(ref_model, batch, kind), model, ref_model)
    report = dualkv_compile.reports()[-1]
    assert report.rewritten and report.packed_calls == 1, report


def test_in_place_through_a_view_is_refused_and_exact():
    """A mutation through a view of a packed value cannot be carried: the graph is refused and runs unchanged."""

    def loss(model, batch):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logits[..., :10].mul_(2.0)
        lse = torch.log_softmax(logits.float(), dim=-1).logsumexp(-1)
        return (lse * batch["attention_mask"]).sum()

    torch._dynamo.reset()
    model = hf_model("qwen3", "sdpa")
    ref_model = copy.deepcopy(model)
    batch = make_batch([(7, [3, 5, 4, 2])])
    got = dualkv_compile.policy_loss(loss, inner="aot_eager")(model, batch)
    assert_loss_and_grads_match(got, loss(ref_model, batch), model, ref_model)
    report = dualkv_compile.reports()[-1]
    assert not report.rewritten and "in-place mul_" in report.reason, report


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_in_place_op_between_two_layers(impl):
    """A forward hook scaling the first decoder layer's output in place, inside the compiled model."""
    torch._dynamo.reset()
    model = hf_model("llama", impl, layers=2)

    def scale_in_place(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.mul_(0.5).add_(0.25)

    model.model.layers[0].register_forward_hook(scale_in_place)
    ref_model = copy.deepcopy(model)
    # float32 at 1e-4 (the scaled layer output makes float32 rounding visible at 1.5e-5; a dropped mutation is off
    # by O(1)); no left padding: HF's eager attention can turn fully masked rows into NaN that reaches valid rows.
    ids, mask, _ = grpo_batch([(5, [3, 4, 2]), (5, [5, 1])], 101, left_pad=0)
    compiled = torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    out = compiled(input_ids=ids, attention_mask=mask).logits
    ref = ref_model(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    assert rel(out[valid], ref[valid]) <= 1e-4
    proj = torch.randn(out.shape[-1], generator=torch.Generator().manual_seed(0))
    (out[valid] @ proj).sum().backward()
    (ref[valid] @ proj).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert rel(p.grad, q.grad) <= 1e-4, name
    assert sum(r.packed_calls for r in dualkv_compile.reports() if r.rewritten) >= 1


def _capture(fn, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=False)(*args)
    return graphs[0]


def test_functionalize_keeps_values_and_dtypes():
    """Out-of-place twins give the same values; ``bf16.mul_(fp32)`` stays bf16; later reads see the new value."""

    def fn(x, w, s):
        h = (x @ w).to(torch.bfloat16)
        h.mul_(s)  # fp32 operand: the in-place result stays bf16
        g = h.float()
        h.add_(1.0)
        torch.relu_(h)
        y = torch.nn.functional.silu(h, inplace=True)
        z = h.clone()
        z.copy_(h * 3)
        return g, h, y, z, h[:, :2].sum()

    x, w, s = torch.randn(3, 4), torch.randn(4, 4), torch.randn(4)
    gm = _capture(fn, x, w, s)
    new, leftover = functionalize_mutations(gm)
    assert leftover == []
    assert not [n for n in new.graph.nodes if mutated_input(n) is not None]
    assert any(mutated_input(n) is not None for n in gm.graph.nodes), "the original graph is left as it was"
    got, want = new(x, w, s), fn(x, w, s)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_functionalize_leaves_shared_storage_alone():
    """Mutations of an input, or through a view made before them, are not rewritten; they are reported."""

    def fn(x, w):
        x.mul_(2)
        h = x @ w
        v = h[:, :2]
        v.add_(1)
        return h

    gm = _capture(fn, torch.randn(3, 4), torch.randn(4, 4))
    new, leftover = functionalize_mutations(gm)
    assert [(m.node.target, m.target.op) for m in leftover] == [("mul_", "placeholder"), ("add_", "call_function")]
    assert "input" in leftover[0].why and "view" in leftover[1].why


def test_buffer_filled_by_slice_copies_becomes_slice_scatter():
    """DeepSeek-V3 assembles its key states in a ``new_empty`` buffer, ``buf[..., :d].copy_(a)`` then
    ``buf[..., d:].copy_(b)``: out of place as two ``slice_scatter``s (values and dtype kept). A slice read as well
    as written, or written with broadcasting, still makes the buffer not private (left, and reported)."""

    def fill(a, b):
        buf = a.new_empty(*a.shape[:-1], a.shape[-1] + b.shape[-1])
        buf[..., : a.shape[-1]].copy_(a)
        buf[..., a.shape[-1]:].copy_(b)
        return buf * 2

    a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 2, dtype=torch.float64)  # copy_ casts b to a's dtype
    gm = _capture(fill, a, b)
    new, leftover = functionalize_mutations(gm)
    assert leftover == []
    assert [n.target for n in new.graph.nodes if n.op == "call_function" and n.target is torch.slice_scatter] == [torch.slice_scatter] * 2
    got, want = new(a, b)[0], fill(a, b)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    def read_too(a):
        buf = a.new_zeros(*a.shape)
        v = buf[..., :2]
        v.copy_(a[..., :2])
        return buf + v.sum()

    def broadcast(a):
        buf = a.new_zeros(*a.shape)
        buf[..., :2].copy_(a[:1, ..., :2])
        return buf

    for fn in (read_too, broadcast):
        new, leftover = functionalize_mutations(_capture(fn, a))
        assert [m.why for m in leftover] == ["a view aliases it"], fn.__name__


def test_sections_written_into_a_view_of_section_zero_are_copied_out_of_place():
    """Qwen3.5's interleaved rotary: ``t = freqs[0]; t[..., 1::3] = freqs[1, ..., 1::3]; ...``: the mutated view of
    section 0 is read otherwise only through sections 1 and 2, so it is copied and each setitem becomes a
    ``slice_scatter`` (values kept; the base is not mutated, which no reader could see). A view the base reads
    back after the write (section 0 again) stays in place, reported."""

    def interleave(x):
        f = x.sin() * 1.0
        t = f[0]
        t[..., 1:7:3] = f[1, ..., 1:7:3]
        t[..., 2:7:3] = f[2, ..., 2:7:3].double()  # the assignment casts to t's dtype
        return torch.cat((t, t), dim=-1)

    x = torch.randn(3, 2, 5, 8)
    new, leftover = functionalize_mutations(_capture(interleave, x))
    assert leftover == []
    assert [n.target for n in new.graph.nodes if n.target is torch.slice_scatter] == [torch.slice_scatter] * 2
    assert not any(n.target is operator.setitem for n in new.graph.nodes)
    torch.testing.assert_close(new(x)[0], interleave(x), rtol=0, atol=0)

    def read_back(x):
        f = x.sin() * 1.0
        t = f[0]
        t[..., 1:7:3] = f[1, ..., 1:7:3]
        return t + f[0, ..., :1]

    new, leftover = functionalize_mutations(_capture(read_back, x))
    assert [m.why for m in leftover] == ["a view aliases it"]


def test_a_view_of_an_input_is_never_copied():
    """The caller's tensor must be mutated: a section written through a view of an input's view stays in place."""

    def write_input(x):
        f = x[:3]
        t = f[0]
        t[..., 1:7:3] = f[1, ..., 1:7:3]
        return t * 2

    x = torch.randn(4, 2, 5, 8)
    new, leftover = functionalize_mutations(_capture(write_input, x))
    assert len(leftover) == 1 and any(n.target is operator.setitem for n in new.graph.nodes)
