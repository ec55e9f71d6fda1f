"""Helpers the tests share: batches, tiny Hugging Face models, graph capture, and the exactness checks.

Expected values never come from the code under test: the checks compare the
dualkv result with the unmodified model (or loss) run without it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
import signal

import pytest
import torch
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata
from torch.testing import FileCheck

import dualkv_compile
from dualkv_compile.analysis.token_axes import analyze_token_axes
from dualkv_compile.analysis.token_inputs import find_token_inputs
from dualkv_compile.backend import dualkv_backend
from dualkv_compile.rewrite.fuse_linear_log_prob import fuse_linear_log_prob
from dualkv_compile.rewrite.pack_graph import pack_graph
from dualkv_compile.rewrite.packed_inputs import PackedInputs
from dualkv_compile.layout.packed_ops import unpack_tokens

transformers = pytest.importorskip("transformers")

def grpo_batch(groups, vocab, left_pad=2, right_pad=1, seed=0, share_response_tokens=0):
    """Rows [pad | prompt | response | pad] for groups of (prompt_len, [response lens]); returns ids, mask, positions.

    ``share_response_tokens`` makes the responses of each group start with that many equal tokens.
    """
    g = torch.Generator().manual_seed(seed)
    rows = [(P, r) for P, rs in groups for r in rs]
    S = left_pad + max(P for P, _ in rows) + max(r for _, r in rows) + right_pad
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros(len(rows), S, dtype=torch.long)
    b = 0
    for P, rs in groups:
        prompt = torch.randint(1, vocab, (P,), generator=g)
        lead = torch.randint(1, vocab, (share_response_tokens,), generator=g)
        lp = left_pad + (max(pp for pp, _ in groups) - P)  # prompts left-padded to one length
        for r in rs:
            resp = torch.randint(1, vocab, (r,), generator=g)
            resp[: min(r, share_response_tokens)] = lead[: min(r, share_response_tokens)]
            ids[b, lp : lp + P] = prompt
            ids[b, lp + P : lp + P + r] = resp
            mask[b, lp : lp + P + r] = 1
            b += 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return ids, mask, pos


BATCHES = {
    "one_group": [(7, [3, 5, 4, 2])],
    "three_groups": [(6, [3, 4]), (4, [2, 5, 1]), (8, [2])],
    "ragged_padding": [(5, [1, 6, 0, 3])],
}

def cuda_syncs(fn):
    """``(fn()'s result, the (file, line) of every host sync CUDA's sync debug mode reported while it ran)``."""
    import warnings

    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = fn()
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    return out, [(x.filename, x.lineno) for x in w if "synchronizing" in str(x.message)]


@contextlib.contextmanager
def time_limit(seconds: int):
    """Fails the test (instead of hanging the session) if the body runs longer than ``seconds`` (a guard against
    an exponential walk coming back, not a timing)."""
    def expired(signum, frame):
        raise TimeoutError(f"over {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

def check_model(model, batches, inner="aot_eager", forward=None, tol=1e-5):
    """Compile a copy with dualkv; compare logits at valid positions and every parameter gradient."""
    forward = forward or (lambda m, ids, mask, pos: m(input_ids=ids, attention_mask=mask).logits)
    ref_model = copy.deepcopy(model)
    compiled = torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": inner}))
    for ids, mask, pos in batches:
        vocab_proj = torch.randn(forward(ref_model, ids, mask, pos).shape[-1], generator=torch.Generator().manual_seed(1))
        out = forward(compiled, ids, mask, pos)
        ref = forward(ref_model, ids, mask, pos)
        valid = mask.bool()
        assert rel(out[valid], ref[valid]) <= tol
        (out[valid] @ vocab_proj).sum().backward()
        (ref[valid] @ vocab_proj).sum().backward()
        exact = None  # float64 gradients of the unmodified model, made only if a gradient misses ``tol``
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            if q.grad is None:
                assert p.grad is None or p.grad.abs().max() == 0, name
                continue
            if rel(p.grad, q.grad) <= tol:
                continue
            # An ill-conditioned sum (a scalar parameter's gradient over every token: xIELU's alpha_n) can differ
            # between two float32 summation orders by more than tol: then dualkv must be as close to the float64
            # gradient as the unmodified float32 model is.
            exact = exact or _float64_grads(ref_model, forward, ids, mask, pos, valid, vocab_proj)
            err, plain = rel(p.grad.double(), exact[name]), rel(q.grad.double(), exact[name])
            assert err <= max(tol, plain), (name, err, plain)
        model.zero_grad(set_to_none=True)
        ref_model.zero_grad(set_to_none=True)

def _float64_grads(model, forward, ids, mask, pos, valid, vocab_proj) -> dict:
    m64 = copy.deepcopy(model).double()
    m64.zero_grad(set_to_none=True)
    (forward(m64, ids, mask, pos)[valid] @ vocab_proj.double()).sum().backward()
    return {n: p.grad for n, p in m64.named_parameters() if p.grad is not None}


def hf_model(family, impl, layers=2, head_dim=8):
    cfgs = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }
    Config, Model = cfgs[family]
    cfg = Config(
        vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=128, use_cache=False,
    )
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return Model(cfg).train()

def capture(model, *args, example_inputs=None, **kwargs) -> torch.fx.GraphModule:
    """The one Dynamo graph of ``model(*args, **kwargs)``; its real inputs are appended to ``example_inputs``."""
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        if example_inputs is not None:
            example_inputs.extend(inputs)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, dynamic=False)(*args, **kwargs)
    assert len(graphs) == 1
    return graphs[0]

def normalise(code: str) -> str:
    lines = []
    for line in code.strip().splitlines():
        line = line.split(";")[0].rstrip()
        if not line.strip() or re.fullmatch(r"\s*\w+ = L_\w+", line):
            continue
        line = re.sub(r"L_self_modules_(\w+?)_parameters_weight_", r"\1.weight", line)
        line = re.sub(r"l_self_modules_(\w+?)_parameters_weight_", r"\1.weight", line)
        lines.append(line)
    return "\n".join(lines)


VOCAB = 101

def make_batch(groups, seed=0, left_pad=2):
    ids, mask, _ = grpo_batch(groups, VOCAB, left_pad=left_pad, seed=seed)
    B, S = ids.shape
    g = torch.Generator().manual_seed(seed + 100)
    response = torch.zeros_like(mask)
    b = 0
    for P, rs in groups:
        for r in rs:
            cols = mask[b].nonzero().flatten()
            response[b, cols[P:]] = 1  # the row's tokens after its prompt
            b += 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "response_mask": response,
        "old_logp": torch.randn(B, S - 1, generator=g) * 0.1 - 4.6,
        "ref_logp": torch.randn(B, S - 1, generator=g) * 0.1 - 4.6,
        "advantages": torch.randn(B, generator=g),
    }

def token_logp_and_entropy(model, batch, temperature=0.7):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, :-1] / temperature
    logp = torch.log_softmax(logits.float(), dim=-1)
    token_logp = logp.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy

def clipped_objective(batch, token_logp, eps=0.2):
    ratio = torch.exp(token_logp - batch["old_logp"])
    adv = batch["advantages"][:, None]
    return -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)

def grpo_token_mean(model, batch):
    logp, _ = token_logp_and_entropy(model, batch)
    m = batch["response_mask"][:, 1:].float()
    return (clipped_objective(batch, logp) * m).sum() / m.sum()

def dr_grpo_seq_mean_token_sum(model, batch):
    logp, _ = token_logp_and_entropy(model, batch)
    m = batch["response_mask"][:, 1:].float()
    return (clipped_objective(batch, logp) * m).sum(-1).mean()

def seq_mean_token_mean(model, batch):
    logp, _ = token_logp_and_entropy(model, batch)
    m = batch["response_mask"][:, 1:].float()
    return ((clipped_objective(batch, logp) * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()

def with_entropy_and_kl(model, batch, beta=0.04, ent_coef=0.01):
    logp, entropy = token_logp_and_entropy(model, batch)
    m = batch["response_mask"][:, 1:].float()
    delta = batch["ref_logp"] - logp
    kl = torch.exp(delta) - delta - 1  # the k3 estimator against reference log-probs
    per_token = clipped_objective(batch, logp) + beta * kl - ent_coef * entropy
    return (per_token * m).sum() / m.sum()

def entropy_from_logits(logits):
    """veRL's form of the per-token entropy (written here, not imported): logsumexp minus the softmax-weighted logits."""
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)

def with_verl_entropy(model, batch, temperature=0.7, ent_coef=0.01):
    """An entropy bonus as veRL computes it: from the (scaled, upcast) logits the log-probs are taken from."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = (logits[:, :-1] / temperature).float()
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    m = batch["response_mask"][:, 1:].float()
    per_token = clipped_objective(batch, token_logp) - ent_coef * entropy_from_logits(logits)
    return (per_token * m).sum() / m.sum()


LOSSES = [grpo_token_mean, dr_grpo_seq_mean_token_sum, seq_mean_token_mean, with_entropy_and_kl]
GROUPS = [(6, [3, 4, 1, 5]), (4, [2, 5]), (7, [3])]

def assert_loss_and_grads_match(loss, ref, model, ref_model, tol=1e-5):
    """``loss`` equals ``ref`` and, after both backward passes, every parameter gradient of ``model`` equals ``ref_model``'s."""
    assert rel(loss.detach(), ref.detach()) <= tol
    loss.backward()
    ref.backward()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert rel(p.grad, q.grad) <= tol, name

def grpo_steps_match(decorated, model, ref_model, groups_per_step=([(6, [3, 4, 1, 5]), (4, [2, 5])], [(5, [2, 6, 3])])) -> list:
    """One ``grpo_token_mean`` step per batch of ``groups_per_step`` (other layouts each), the decorated loss's value
    and gradients checked against the plain model's; returns the reports the steps made."""
    import dualkv_compile

    start = len(dualkv_compile.reports())
    for seed, groups in enumerate(groups_per_step):
        batch = make_batch(groups, seed=seed)
        assert_loss_and_grads_match(decorated(model, batch), grpo_token_mean(ref_model, batch), model, ref_model)
        model.zero_grad(set_to_none=True)
        ref_model.zero_grad(set_to_none=True)
    return dualkv_compile.reports()[start:]


def assert_packed_structure(tc, packed, inputs, layout) -> None:
    """One packed decoder layer's structure, for graphs whose names a transformers release generates:
    one shared-prompt attention and no SDPA, the attention mask input dropped (not rebuilt on the packed
    stream), and no value laid out ``[B, S, ...]`` between the pack and the unpack (``inputs``: the
    graph's real inputs, ``layout``: one whose token count differs from B * S)."""
    (
        FileCheck()
        .check("pack_tokens")
        .check_count("torch.ops.dualkv.attention_fwd.default", 1, exactly=True)
        .check_not("scaled_dot_product_attention")
        .check("unpack_tokens")
        .run(packed.code)
    )
    mask_ph = [n for n in packed.graph.find_nodes(op="placeholder") if "attention_mask" in n.name]
    tc.assertEqual(len(mask_ph), 1)
    tc.assertEqual(len(mask_ph[0].users), 0, "the attention mask is dropped, not rebuilt on the packed stream")
    B, S = layout.batch_size, layout.seq_len
    tc.assertNotEqual(layout.num_tokens, B * S)
    ShapeProp(packed).propagate(*inputs, *PackedInputs.of(layout))
    token_major = [
        n.name for n in packed.graph.nodes
        if n.op == "call_function" and n.target is not unpack_tokens
        and isinstance(n.meta.get("tensor_meta"), TensorMetadata) and tuple(n.meta["tensor_meta"].shape[:2]) == (B, S)
    ]
    tc.assertEqual(token_major, [], "values laid out [B, S, ...] inside the packed region")

def packed_loss_graph(loss_fn, model, batch, chunked_log_probs=True):
    """The packed graph the backend builds for ``loss_fn`` (attention backend "reference"), its shapes propagated."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(loss_fn, backend=capture, dynamic=False)(model, batch)
    gm, example_inputs = graphs[0]
    axes = analyze_token_axes(gm, find_token_inputs(gm.graph))
    packed = pack_graph(gm, axes, "reference")
    if chunked_log_probs:
        fuse_linear_log_prob(packed)
    # Sequences packed into rows (position ids given) share across columns, as the backend detects them.
    pos = batch.get("position_ids")
    layout = dualkv_compile.detect(batch["input_ids"], batch.get("attention_mask"), pos, same_columns=pos is None)
    ShapeProp(packed).propagate(*example_inputs, *PackedInputs.of(layout))
    return packed, layout


def shard_per_layer(model):
    """FSDP2's ``fully_shard`` on each decoder layer and the root, as veRL and TRL shard (a process group must exist)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def assert_sharded_grads_close(model, ref, tol=1e-5):
    """Every parameter gradient of ``model`` (FSDP2 shards gathered whole) within ``tol`` of ``ref``'s, by norm."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        err = ((g - q.grad).norm() / q.grad.norm().clamp_min(1e-30)).item()
        assert err <= tol, (name, err)
