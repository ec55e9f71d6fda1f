"""Ulysses sequence parallelism on CPU (gloo): 2 ranks (sp 2) and 4 ranks (dp 2 x sp 2), against one process.

Each rank runs ``@policy_loss(sequence_parallel=...)`` (or the compiled model) on its data-parallel
group's batch: a prefix forest of depth 2 (a system prompt, two group prompts, ragged responses) in
shuffled rows. The expected values are the unmodified model's on the same batch in the same process,
without dualkv: the loss on every rank, and the mean of every parameter gradient over the
sequence-parallel group (what FSDP2 and DDP reduce; ``ops.sp_collectives`` states the convention). Each rank holds ceil(T / sp) packed tokens. Assertions run inside the
ranks; a failure fails ``mp.spawn`` with the rank's traceback.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.distributed as dist

from tests.gloo_ranks import spawn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available")

VOCAB = 101


def _spawn(world, fn, *args):
    """``fn(rank, world, *args)`` on ``world`` gloo ranks."""
    spawn(fn, world, *args, world=world)


def forest_batch(seed: int):
    """Rows of a depth-2 forest, shuffled and padded on both sides: a 6-token system prompt, then two group
    prompts (4 and 6 tokens) with ragged responses. Returns ids, mask and the forest's packed token count."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    tok = lambda n: torch.randint(1, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    system = tok(6)  # 31 packed tokens: not a multiple of 2, so the last rank holds a padding token
    groups = [(tok(4), [tok(n) for n in (3, 1, 4)]), (tok(6), [tok(n) for n in (2, 5)])]
    rows = [system + prompt + resp for prompt, resps in groups for resp in resps]
    total = len(system) + sum(len(p) + sum(len(r) for r in rs) for p, rs in groups)
    rng.shuffle(rows)
    S = max(map(len, rows)) + 3
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        left = rng.randint(0, S - len(row))
        ids[b, left : left + len(row)] = torch.tensor(row)
        mask[b, left : left + len(row)] = 1
    return ids, mask, total


def tiny_model(family: str, layers: int = 2):
    import transformers

    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, use_cache=False,
    )
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                          decoder_sparse_step=1, norm_topk_prob=True, output_router_logits=True)
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "gpt_oss":  # learnable sinks, split over the group's heads; a binding window of 4 on layer 0
        cfg = transformers.GptOssConfig(**common, sliding_window=4, num_local_experts=2, num_experts_per_tok=1,
                                        layer_types=["sliding_attention", "full_attention"][:layers])
        cls = transformers.GptOssForCausalLM
    else:
        cfg = transformers.Qwen3Config(**common)
        cls = transformers.Qwen3ForCausalLM
    cfg._attn_implementation = "eager" if family == "gpt_oss" else "sdpa"  # gpt-oss has no sdpa path
    torch.manual_seed(0)
    model = cls(cfg).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_()  # sinks of the scores' size, so that they and their gradient matter
    return model


def grpo_loss(model, input_ids, attention_mask, position_ids, advantages):
    """Token-mean clipped GRPO loss at temperature 0.7 (plus the router's load-balancing loss for MoE)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    logp = torch.log_softmax(out.logits[:, :-1].float() / 0.7, dim=-1)
    token_logp = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(token_logp - token_logp.detach())
    adv = advantages[:, None]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    m = (attention_mask[:, 1:] * attention_mask[:, :-1]).float()  # tokens whose previous column is a token
    loss = (per_token * m).sum() / m.sum()
    aux = getattr(out, "aux_loss", None)
    return loss if aux is None else loss + 0.01 * aux


def _check_family(family, mesh, sp, layers):
    import dualkv_compile

    sp_group = mesh["sp"].get_group()
    dp_rank = mesh.get_local_rank("dp")
    model = tiny_model(family, layers)
    ref = copy.deepcopy(model)
    ids, mask, total = forest_batch(seed=20 + dp_rank)  # the same batch on every rank of a sequence-parallel group
    pos = (mask.cumsum(1) - 1).clamp(min=0)  # each row's positions count from its first token, as veRL's do
    adv = torch.randn(ids.shape[0], generator=torch.Generator().manual_seed(3 + dp_rank))
    # check_exact: the first call also runs the original program and compares (gradients as the group's mean).
    loss_fn = dualkv_compile.policy_loss(grpo_loss, sequence_parallel=mesh["sp"], inner="aot_eager", check_exact="first")
    before = len(dualkv_compile.reports())
    for step in range(2):  # the second call runs the compiled graphs again
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss = loss_fn(model, ids, mask, pos, adv)
        want = grpo_loss(ref, ids, mask, pos, adv)
        assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item()), (family, step, loss.item(), want.item())
        loss.backward()
        want.backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            g = p.grad.clone()
            dist.all_reduce(g, group=sp_group)
            g /= sp  # the mean over the group, as FSDP2 and DDP take it
            err = ((g - q.grad).norm() / q.grad.norm().clamp_min(1e-30)).item()
            assert err <= 1e-5, (family, step, name, err)
    new = dualkv_compile.reports()[before:]
    packed = [r for r in new if r.num_attention]
    assert packed and all(r.packed_calls == 2 for r in packed), [str(r) for r in new]
    checks = [c for r in packed for c in r.exactness_checks]
    assert len(checks) == len(packed) and all("the group mean" in c for c in checks), checks
    for r in packed:
        assert r.last_stats.tokens_after == total
        assert r.local_tokens == -(-total // sp), (r.local_tokens, total)


def _assert_group_mean_grads(model, ref, group, sp):
    """Every parameter gradient's mean over the sequence-parallel group equals the one-process model's (1e-5)."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        err = ((g / sp - q.grad).norm() / q.grad.norm().clamp_min(1e-30)).item()
        assert err <= 1e-5, (name, err)


def _check_compiled_model(mesh, sp):
    """``torch.compile(model, backend="dualkv", options={"sequence_parallel": ...})``: the logits at valid positions
    and the gradients of a loss the caller computes from them (eagerly, on every rank)."""
    import dualkv_compile

    sp_group = mesh["sp"].get_group()
    model = tiny_model("qwen3")
    ref = copy.deepcopy(model)
    ids, mask, _ = forest_batch(seed=40 + mesh.get_local_rank("dp"))
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    compiled = torch.compile(model, backend="dualkv", options={"sequence_parallel": mesh["sp"], "inner": "aot_eager"})
    before = len(dualkv_compile.reports())
    out = compiled(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    want = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    valid = mask.bool()
    torch.testing.assert_close(out[valid], want[valid], rtol=1e-5, atol=1e-5)
    proj = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2))
    (out[valid] @ proj).square().mean().backward()
    (want[valid] @ proj).square().mean().backward()
    _assert_group_mean_grads(model, ref, sp_group, sp)
    (report,) = dualkv_compile.reports()[before:]
    assert report.packed_calls == 1 and report.local_tokens is not None, str(report)


def _check_remove_padding_row(mesh, sp):
    """veRL's remove-padding row with labels rolled outside the graph (the veRL integration's region): the log-probs
    picked from the gathered packed rows (``gather_unpacked``), the entropy per token, and the gradients."""
    import functools

    import dualkv_compile
    from tests.rewrite.test_gather_unpacked import GROUPS, remove_padding_row, verl_log_probs

    model = tiny_model("qwen3")
    ref = copy.deepcopy(model)
    ids, pos, rolled = remove_padding_row(GROUPS, seed=7)
    options = {"sequence_parallel": mesh["sp"], "inner": "aot_eager"}
    before = len(dualkv_compile.reports())
    logp, entropy = torch.compile(functools.partial(verl_log_probs, model), backend="dualkv", options=options)(
        input_ids=ids, position_ids=pos, rolled=rolled)
    want_logp, want_entropy = verl_log_probs(ref, ids, pos, rolled)
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-5, atol=1e-5)
    (logp.sum() + 0.1 * entropy.sum()).backward()
    (want_logp.sum() + 0.1 * want_entropy.sum()).backward()
    _assert_group_mean_grads(model, ref, mesh["sp"].get_group(), sp)
    (report,) = dualkv_compile.reports()[before:]
    assert report.packed_calls == 1 and report.local_tokens is not None, str(report)
    # The entropy off: the picked log-probs fuse with the lm_head (the op reads the gathered rows by unpack_index).
    from tests.rewrite.test_gather_unpacked import verl_log_probs_only

    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    before = len(dualkv_compile.reports())
    logp = torch.compile(functools.partial(verl_log_probs_only, model), backend="dualkv", options=options)(
        input_ids=ids, position_ids=pos, rolled=rolled)
    want_logp = verl_log_probs_only(ref, ids, pos, rolled)
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    weights = torch.randn(want_logp.shape, generator=torch.Generator().manual_seed(3))
    (logp * weights).sum().backward()
    (want_logp * weights).sum().backward()
    _assert_group_mean_grads(model, ref, mesh["sp"].get_group(), sp)
    (report,) = dualkv_compile.reports()[before:]
    assert report.packed_calls == 1 and report.fused_log_probs == 1 and report.local_tokens is not None, str(report)


def _check_fsdp_per_layer(mesh, sp):
    """FSDP2 on each decoder layer and the root (the graph breaks at every layer: the layer graphs pack on a layout
    carried from graph to graph), Ulysses over the same 2 ranks: the loss, and FSDP2's reduced gradients (the mean
    over the ranks) equal one process's. The group checks its layout once per layout, not once per graph."""
    import dualkv_compile
    import dualkv_compile.runtime.runner as runner
    from torch.distributed.fsdp import fully_shard

    model = tiny_model("qwen3")
    ref = copy.deepcopy(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids, mask, _ = forest_batch(seed=60)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    adv = torch.randn(ids.shape[0], generator=torch.Generator().manual_seed(61))
    checks = []
    real_agree = runner.agree
    runner.agree = lambda *a: (checks.append(a[0]), real_agree(*a))[1]
    before = len(dualkv_compile.reports())
    saved = []
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(tuple(t.shape)), t)[1], lambda t: t):
            loss = dualkv_compile.policy_loss(grpo_loss, sequence_parallel=mesh["sp"], inner="aot_eager")(model, ids, mask, pos, adv)
        loss.backward()
    finally:
        runner.agree = real_agree
    # The hidden states pass between the layer graphs as [B, S, H] (the caller's layout), whole on every rank;
    # no graph keeps them for its backward.
    assert (*ids.shape, 32) not in saved, saved
    want = grpo_loss(ref, ids, mask, pos, adv)
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item()), (loss.item(), want.item())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        g = p.grad.full_tensor()
        err = ((g - q.grad).norm() / q.grad.norm().clamp_min(1e-30)).item()
        assert err <= 1e-5, (name, err)
    new = dualkv_compile.reports()[before:]
    layers = [r for r in new if r.num_attention]
    assert layers and all(r.packed_calls >= 1 for r in layers), [str(r) for r in new]
    calls = sum(r.calls for r in new if r.rewritten)
    assert len(checks) < calls, (len(checks), calls)  # carried layouts reuse the check


def _check_checkpointed_layers_save_their_chunk(mesh, sp):
    """Activation checkpointing under sequence parallelism: a layer's forward saves this rank's chunk for its
    backward, not the q/k/v and output exchanged over the group. Before the fix Dynamo's re-trace of the packed
    graph dropped the checkpoint tags of the Ulysses steps (a Python function it inlined), so every layer saved
    the whole stream's q, k, v and attention output for this rank's heads (``[1, H / sp, sp * Tl, D]``)."""
    import dualkv_compile

    model = tiny_model("qwen3", layers=2)
    ref = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids, mask, total = forest_batch(seed=70)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    adv = torch.randn(ids.shape[0], generator=torch.Generator().manual_seed(71))
    stream = sp * -(-total // sp)  # the padded packed stream
    saved = []
    fn = dualkv_compile.policy_loss(grpo_loss, sequence_parallel=mesh["sp"], inner="aot_eager")
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(tuple(t.shape)), t)[1], lambda t: t):
        loss = fn(model, ids, mask, pos, adv)
    loss.backward()
    assert dualkv_compile.reports()[-1].packed_calls >= 1
    whole = [s for s in saved if len(s) == 4 and s[2] == stream]
    assert not whole, whole
    assert (1, stream // sp, 32) in saved  # each layer's input: this rank's chunk of the hidden states
    want = grpo_loss(ref, ids, mask, pos, adv)
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item()), (loss.item(), want.item())


def _sp_rank(rank, world, sp, further=False):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // sp, sp), mesh_dim_names=("dp", "sp"))
    # 4 ranks share 2 cores in CI: one layer there (the 2-rank run covers a layer's output feeding the next).
    layers = 2 if world == 2 else 1
    if further:  # the families and integrations beyond the core path (`make test-slow`)
        for family in ("qwen3_moe", "gpt_oss"):
            _check_family(family, mesh, sp, layers)
            torch._dynamo.reset()
        _check_compiled_model(mesh, sp)
        torch._dynamo.reset()
        _check_remove_padding_row(mesh, sp)
        torch._dynamo.reset()
        _check_fsdp_per_layer(mesh, sp)
        torch._dynamo.reset()
        _check_checkpointed_layers_save_their_chunk(mesh, sp)
        return
    for family in ("qwen3",) if world == 2 else ("qwen3", "qwen3_moe"):
        _check_family(family, mesh, sp, layers)
        torch._dynamo.reset()
    if world == 2:
        _ulysses_rank(rank, world)
        _three_heads_rank(rank, world)
        torch._dynamo.reset()
        _disagreeing_rank(rank, world)


def test_sp2_matches_one_process():
    """2 ranks, one sequence-parallel group of 2: a tiny Qwen3 through @policy_loss, the attention op alone, a
    refused head count, and ranks given different batches (one spawn: each process pays its start once)."""
    _spawn(2, _sp_rank, 2)


@pytest.mark.slow  # the same 2 ranks over further paths; the core path above runs in `make test`
def test_sp2_further_paths_match_one_process():
    """Qwen3-MoE and gpt-oss through @policy_loss, the compiled model, the remove-padding row, FSDP2 per layer
    and checkpointed layers saving only their chunk, on the 2-rank sequence-parallel group."""
    _spawn(2, _sp_rank, 2, True)


@pytest.mark.slow  # 4 gloo ranks on CI's 2 cores; the 2-rank run covers the same paths but the dp x sp mesh
def test_dp2_sp2_matches_one_process():
    """4 ranks, 2 data-parallel groups of 2 sequence-parallel ranks, each group its own batch."""
    _spawn(4, _sp_rank, 2)


def _disagreeing_rank(rank, world):
    import dualkv_compile

    model = tiny_model("qwen3")
    ids, mask, _ = forest_batch(seed=rank)  # a different batch on each rank: a data loader bug
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    adv = torch.ones(ids.shape[0])
    loss_fn = dualkv_compile.policy_loss(grpo_loss, sequence_parallel=dist.group.WORLD, inner="aot_eager")
    with pytest.raises(Exception, match="see different batches"):
        loss_fn(model, ids, mask, pos, adv)


def _three_heads_rank(rank, world):
    """3 query heads cannot be split over 2 ranks: the graph is refused with the reason, and runs unpacked,
    with the whole gradient on each rank (their mean over the group is the gradient)."""
    import dualkv_compile
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=24, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=3, num_key_value_heads=1, head_dim=8, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).train()
    ref = copy.deepcopy(model)
    ids, mask, _ = forest_batch(seed=5)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    adv = torch.linspace(-1, 1, ids.shape[0])
    before = len(dualkv_compile.reports())
    loss = dualkv_compile.policy_loss(grpo_loss, sequence_parallel=dist.group.WORLD, inner="aot_eager")(model, ids, mask, pos, adv)
    report = dualkv_compile.reports()[before]
    assert not report.rewritten and "does not divide the 3 query heads" in report.reason, report
    want = grpo_loss(ref, ids, mask, pos, adv)
    loss.backward()
    want.backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def _ulysses_rank(rank, world):
    """The attention op alone: 4 query heads, 1 key/value head (repeated to 2 for the exchange), a forest of 19
    tokens padded to 20; each rank's output chunk and q/k/v gradients equal the whole-stream reference's."""
    from dualkv_compile.layout import tree_segments
    from dualkv_compile.ops.attention import shared_prompt_attention
    from dualkv_compile.ops.ulysses_attention import ulysses_attention

    seg_len, parent = [6, 3, 5, 4, 1], [-1, 0, 0, -1, 3]
    T = sum(seg_len)
    n = -(-T // world)
    pad = n * world - T
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, T, 8, generator=g, dtype=torch.float64) for h in (4, 1, 1))
    dout = torch.randn(1, 4, T, 8, generator=g, dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = shared_prompt_attention(*ref, tree_segments(seg_len, parent), backend="reference")
    want.backward(dout)

    padded = [torch.cat([t, t[:, :, :1].expand(-1, -1, pad, -1)], dim=2) for t in (q, k, v)]
    mine = [t[:, :, rank * n : (rank + 1) * n].clone().requires_grad_() for t in padded]
    segs = tree_segments(seg_len + [pad], parent + [-1])
    (out,) = ulysses_attention(*mine, *segs, 8 ** -0.5, 0.0, "reference", world, dist.group.WORLD.group_name)
    lo, hi = rank * n, min((rank + 1) * n, T)
    torch.testing.assert_close(out[:, :, : hi - lo], want[:, :, lo:hi])
    d = torch.cat([dout, dout.new_zeros(1, 4, pad, 8)], dim=2)[:, :, rank * n : (rank + 1) * n]
    out.backward(d)
    for t, r in zip(mine, ref):
        torch.testing.assert_close(t.grad[:, :, : hi - lo], r.grad[:, :, lo:hi])
