"""A data-parallel GRPO loss step with dualkv under FSDP2 or DDP (torchrun), checked against the plain step.

Every rank builds its own micro-batch of ``--prompts`` prompts with
``--rollouts`` responses each, all rollouts of a prompt on that rank (the
data-loader rule dualkv needs; ``dualkv_compile.distributed.check_groups_on_rank``
verifies it and the script prints its verdict). The model (a Qwen3 of
configurable shape, random weights, the same on every rank) is wrapped twice
from the same initial weights:

    --mode fsdp   fully_shard(model) on the root (FSDP2), optionally with
                  MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) (--bf16)
    --mode ddp    DistributedDataParallel, torch._dynamo.config.optimize_ddp = False

and one GRPO clipped-objective step (forward, backward, gradient
reduce-scatter / all-reduce) runs through ``@dualkv_compile.policy_loss`` on
one copy and through plain ``torch.compile`` (same inner compiler) on the
other. The script prints each rank's layout stats and which graphs dualkv
rewrote, compares the loss and every (local shard of every) gradient, times
both steps (CUDA events on GPU) and records each rank's peak memory.

``--per-layer`` also applies ``fully_shard`` to each decoder layer, as veRL
and TRL shard large models. FSDP2 runs its per-module hooks outside Dynamo,
so that is a graph break around every layer: the layer's graph takes hidden
states, cos/sin and a 4-D mask, not token ids. dualkv packs it anyway: the
first layer call detects the layout from its hidden states (rows whose
prompt copies are bitwise equal) and mask, later layer calls and the final
norm / lm_head graphs carry it (``dualkv_compile.layout.carried``), each
checking that it holds for its inputs; the loss graph detects it again from
the token ids. The summary lists every graph and its layout source.

``--sp N`` adds Ulysses sequence parallelism: a (world / N) x N mesh, the ranks of a sequence-parallel group
read the same batch and dualkv splits its packed stream over them (``options["sequence_parallel"]``); gradients
are reduced by FSDP2 with its defaults. ``--baseline ulysses`` compares with the same batch as remove-padding
sequences, nothing shared, split by the same Ulysses code (the way veRL runs it) instead of plain
``torch.compile`` of the duplicated rows; ``--logprobs-in-model`` computes the log-probs inside the wrapped
module's forward (``LogProbPolicy``), so FSDP2's graph break passes log-probs, not ``[B, S, V]`` logits.

    torchrun --nproc-per-node 2 examples/fsdp_grpo.py --device cpu --mode ddp
    torchrun --nproc-per-node 4 examples/fsdp_grpo.py --device cpu --mode fsdp --sp 2 --prompts 2 --rollouts 4
    torchrun --nproc-per-node 2 examples/fsdp_grpo.py --device cuda --mode fsdp --bf16 \\
        --layers 8 --hidden 1024 --prompt-len 1024 --response-len 256 --out results/

Rank 0 writes ``fsdp_grpo.json`` and ``fsdp_grpo.md`` to ``--out`` and the last
line is a one-line summary ending "fsdp_grpo: OK" when parity holds (and the
model ran packed on every rank).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import dualkv_compile
from dualkv_compile.distributed import check_groups_on_rank

PAD = 0


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--mode", choices=["fsdp", "ddp"], default="fsdp")
    ap.add_argument("--per-layer", action="store_true", help="fsdp: also fully_shard each decoder layer (graph breaks per layer; packed on a carried layout, see the docstring)")
    ap.add_argument("--bf16", action="store_true", help="fsdp: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
    ap.add_argument("--checkpoint", action="store_true", help="activation checkpointing per decoder layer (Hugging Face gradient checkpointing, non-reentrant)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default 2 x hidden; Qwen3-8B: 12288)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=1, help="prompts per rank")
    ap.add_argument("--rollouts", type=int, default=4, help="responses per prompt")
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--response-len", type=int, default=8, help="longest response; responses are ragged")
    ap.add_argument("--sp", type=int, default=1, help="sequence-parallel degree (Ulysses): ranks in groups of N on a (world/N) x N "
                    "mesh; a group's ranks read the same batch, dualkv splits its packed stream over them")
    ap.add_argument("--baseline", choices=["plain", "ulysses"], default="plain",
                    help="the side dualkv is compared with: plain torch.compile of the duplicated rows (each rank of a "
                    "sequence-parallel group computes all of them), or 'ulysses': the duplicated rows as remove-padding "
                    "sequences, nothing shared (dualkv with min_shared past every prompt: each row its own tree, the same "
                    "kernels and chunked log-probs), split over the group by the same Ulysses code")
    ap.add_argument("--fixed-lengths", action="store_true", help="prompts of exactly --prompt-len tokens, responses of exactly --response-len")
    ap.add_argument("--logprobs-in-model", action="store_true", help="compute the next-token log-probs inside the "
                    "FSDP-wrapped module's forward (LogProbPolicy): no [B, S, V] logits cross FSDP2's graph break")
    ap.add_argument("--no-shared-batch", action="store_true", help="do not wrap the dualkv step in dualkv_compile.shared_batch "
                    "(then the graphs of a model split by FSDP2 find the layout themselves, per call)")
    ap.add_argument("--iters", type=int, default=0, help="timed steps per variant after the parity step (0: none)")
    ap.add_argument("--inner", choices=["inductor", "aot_eager"], default=None, help="default: inductor on cuda, aot_eager on cpu")
    ap.add_argument("--tol", type=float, default=None, help="relative tolerance (default 1e-4 fp32, 5e-2 bf16)")
    ap.add_argument("--profile", action="store_true", help="after timing, profile 3 steps of each variant (torch.profiler); "
                    "rank 0 writes the tables (by self CPU time and by device time) to --out")
    ap.add_argument("--out", default=None, help="directory for fsdp_grpo.json / .md (rank 0)")
    return ap.parse_args(argv)


def build_model(args, device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    head_dim = args.hidden // args.heads
    cfg = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate or 2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=head_dim,
        max_position_embeddings=max(4096, args.prompt_len + args.response_len + 8), use_cache=False, pad_token_id=PAD,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)  # the same weights on every rank, as after a broadcast from rank 0
    model = Qwen3ForCausalLM(cfg).to(device).train()
    if args.checkpoint:
        # torch.utils.checkpoint around each layer: dualkv inlines the regions and keeps them recomputed.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # Up to transformers 5.22 a layer checkpoints its __call__, FSDP2's hooks included, and Dynamo then runs it
        # uncompiled: the checkpoint goes around the layer's forward instead (both sides; a no-op on newer ones).
        dualkv_compile.integrations.hf_checkpointing.checkpoint_inside_hooks(model)
    return model


def make_batch(args, rank, device):
    """Data rank ``rank``'s micro-batch: rows [prompt | response | pad], all rollouts of a prompt here, consecutive.

    Right-padded: no row starts with padding, so the plain side's fused SDPA never sees a query with every key
    masked (left-padded rows gave NaN gradients on CUDA), and the default positions (0, 1, ...) are each token's."""
    g = torch.Generator().manual_seed(1000 + rank)
    rows = []
    for _ in range(args.prompts):
        P = args.prompt_len if args.fixed_lengths else int(torch.randint(args.prompt_len // 2, args.prompt_len + 1, (1,), generator=g))
        prompt = torch.randint(1, args.vocab, (P,), generator=g)
        for _ in range(args.rollouts):
            R = args.response_len if args.fixed_lengths else int(torch.randint(1, args.response_len + 1, (1,), generator=g))
            rows.append((prompt, torch.randint(1, args.vocab, (R,), generator=g)))
    S = max(len(p) + len(r) for p, r in rows)
    B = len(rows)
    ids = torch.full((B, S), PAD)
    mask = torch.zeros(B, S, dtype=torch.long)
    resp = torch.zeros(B, S, dtype=torch.long)
    for b, (p, r) in enumerate(rows):
        P, n = len(p), len(p) + len(r)
        ids[b, :P], ids[b, P:n] = p, r
        mask[b, :n] = 1
        resp[b, P:n] = 1
    return {
        "input_ids": ids.to(device),
        "attention_mask": mask.to(device),
        "response_mask": resp.to(device),
        "old_logp": (torch.randn(B, S - 1, generator=g) * 0.1 - 5.0).to(device),
        "advantages": torch.randn(B, generator=g).to(device),
    }


class LogProbPolicy(torch.nn.Module):
    """The model with each next token's log-prob computed in its forward, as veRL's fused kernels return them.

    FSDP2's hooks run outside Dynamo, so on the module ``fully_shard`` wraps they break the graph: with the
    log-probs after the model's call, its ``[B, S, V]`` logits leave the model's graph unpacked (153 GiB at
    8 x 67K tokens and a 151,936-token vocabulary). Inside the wrapped forward, the lm_head, log-softmax and
    gather trace into the model's graph (one chunked op under dualkv) and only ``[B, S - 1]`` log-probs cross.

    The backbone and the lm_head are called from this forward, not through the causal LM's: with ``fully_shard``
    on each layer too, the graph breaks inside the backbone end Dynamo's trace of every frame around it, so the
    causal LM's own forward would run its lm_head in a graph of its own and return the logits to this frame's."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        hidden = self.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return next_token_log_probs(self.model.get_output_embeddings()(hidden), input_ids)


def next_token_log_probs(logits, input_ids):
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def token_log_probs(model, batch):
    if isinstance(model, LogProbPolicy):
        return model(batch["input_ids"], batch["attention_mask"])
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return next_token_log_probs(logits, batch["input_ids"])


def grpo_loss(model, batch, clip=0.2):
    logp = token_log_probs(model, batch)
    ratio = torch.exp(logp - batch["old_logp"])
    adv = batch["advantages"][:, None]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    mask = batch["response_mask"][:, 1:].float()
    return (per_token * mask).sum() / mask.sum()


def wrap(model, args, device):
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else MixedPrecisionPolicy()
    if args.per_layer:
        for layer in (model.model if isinstance(model, LogProbPolicy) else model).model.layers:
            fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def in_shared_batch(step, min_shared=1):
    """The step with the batch's layout detected once by the caller (``dualkv_compile.shared_batch``): under FSDP2
    per layer no graph of the model sees ``input_ids`` by name, and the first layer's would detect it from its
    hidden states on every call; the lm_head's graph sees the ids but no mask, and would count padding as tokens."""
    def run(model, batch):
        with dualkv_compile.shared_batch(batch["input_ids"], batch["attention_mask"], min_shared=min_shared):
            return step(model, batch)
    return run


def first_step(fn, model, batch, device, say, name):
    """The parity step's loss (backward done), or None if it ran out of GPU memory (said, memory freed)."""
    try:
        loss = fn(model, batch)
        loss.backward()
        return loss
    except torch.OutOfMemoryError as e:
        say(f"{name}: out of memory ({str(e).splitlines()[0][:160]})")
        model.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None


def out_of_memory_summary(args, rank, world, dk_loss, plain_loss, device) -> int:
    """One side ran out of memory: say which, with each rank's peak; the other side's step time if it ran."""
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    mine = {"rank": rank, "dualkv_oom": dk_loss is None, "baseline_oom": plain_loss is None, "peak_mib": peak}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        line = ", ".join(f"rank {r['rank']}: dualkv {'OOM' if r['dualkv_oom'] else 'ran'}, {args.baseline} "
                         f"{'OOM' if r['baseline_oom'] else 'ran'} (peak {r['peak_mib'] or 0:.0f} MiB)" for r in everyone)
        verdict = "OK (baseline out of memory)" if not any(r["dualkv_oom"] for r in everyone) else "DUALKV OUT OF MEMORY"
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "fsdp_grpo_oom.json"), "w") as f:
                json.dump({"date": datetime.date.today().isoformat(), "torch": torch.__version__, "args": vars(args), "ranks": everyone}, f, indent=2)
        print(f"{args.mode} x{world}{f' sp {args.sp}' if args.sp > 1 else ''}: {line} - fsdp_grpo: {verdict}", flush=True)
    return 0 if not any(r["dualkv_oom"] for r in everyone) else 1


def local_grads(model):
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "to_local"):
            g = g.to_local()  # FSDP2: this rank's shard of the reduced gradient
        out[name] = None if g is None else g.detach().float()
    return out


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class Timer:
    def __init__(self, device):
        self.device = device

    def __call__(self, fn, iters):
        times = []
        for _ in range(iters):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times) if times else None


def main(argv=None) -> int:
    args = parse(argv)
    if args.mode == "ddp" and (args.bf16 or args.per_layer or args.sp > 1):
        raise SystemExit("--bf16, --per-layer and --sp apply to --mode fsdp")
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # several ranks on one small CPU: threads only contend
    dist.init_process_group(backend)
    try:
        code = run_rank(args, device)
    finally:
        # Free what holds the process group (FSDP state and its device mesh, compiled graphs, async
        # work) while the interpreter is fully alive, and let every rank finish before teardown: a gloo
        # group freed during interpreter shutdown aborts the process now and then.
        torch._dynamo.reset()
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return code


def run_rank(args, device) -> int:
    """The parity step, timing and summary of one rank (the process group is initialised)."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def say(msg):
        print(f"[rank {rank}] {msg}", flush=True)

    inner = args.inner or ("inductor" if args.device == "cuda" else "aot_eager")
    # DDP's Dynamo optimizer splits the graph at gradient buckets; only the first piece would hold the token ids.
    torch._dynamo.config.optimize_ddp = False
    if world % args.sp:
        raise SystemExit(f"--sp {args.sp} must divide the number of ranks {world}")
    dp = world // args.sp
    sp_mesh = None
    data_rank = rank
    if args.sp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dp, args.sp), mesh_dim_names=("dp", "sp"))
        sp_mesh, data_rank = mesh["sp"], mesh.get_local_rank("dp")
    base = build_model(args, device)
    if args.logprobs_in_model:
        base = LogProbPolicy(base)
    plain_model, dk_model = wrap(copy.deepcopy(base), args, device), wrap(base, args, device)
    if args.baseline == "ulysses":
        # Nothing is shared (min_shared past every prompt), so dualkv packs the duplicated rows as remove-padding
        # does: each row its own sequence, causal varlen attention, Ulysses over the group.
        plain_step = dualkv_compile.policy_loss(grpo_loss, inner=inner, sequence_parallel=sp_mesh, min_shared=10**9, min_rho=1.0)
    else:
        plain_step = torch.compile(grpo_loss, backend=inner)
    dk_step = dualkv_compile.policy_loss(grpo_loss, inner=inner, sequence_parallel=sp_mesh)
    if not args.no_shared_batch:
        dk_step = in_shared_batch(dk_step)
        if args.baseline == "ulysses":  # its layout too, nothing shared: remove padding's tokens, no more
            plain_step = in_shared_batch(plain_step, min_shared=10**9)

    batch = make_batch(args, data_rank, device)  # the ranks of a sequence-parallel group read the same batch
    # Prompts split across data-parallel ranks (the ranks of a sequence-parallel group share theirs by design).
    dp_group = mesh["dp"].get_group() if args.sp > 1 else None
    report = check_groups_on_rank(batch["input_ids"], batch["attention_mask"], response_mask=batch["response_mask"], process_group=dp_group)
    stats = dualkv_compile.detect(batch["input_ids"], batch["attention_mask"]).stats()
    say(f"layout: {stats}")
    say(f"groups: {'all rollouts of each prompt on this rank' if report.ok else report}")

    # Parity: one step each, from the same weights, on the same per-rank batch.
    start = len(dualkv_compile.reports())
    dk_loss = first_step(dk_step, dk_model, batch, device, say, "dualkv")
    graphs = dualkv_compile.reports()[start:]
    mid = len(dualkv_compile.reports())
    plain_loss = first_step(plain_step, plain_model, batch, device, say, args.baseline)
    for r in dualkv_compile.reports()[mid:]:  # the ulysses baseline's graphs (nothing shared)
        say(f"{args.baseline} baseline: " + str(r).replace("\n", "\n    "))
    if dk_loss is None or plain_loss is None:
        return out_of_memory_summary(args, rank, world, dk_loss, plain_loss, device)
    packed = any(r.rewritten and r.packed_calls > 0 for r in graphs)
    for r in graphs:
        say(str(r).replace("\n", "\n    "))
    tol = args.tol if args.tol is not None else (5e-2 if args.bf16 else 1e-4)
    loss_err = abs(dk_loss.item() - plain_loss.item()) / max(abs(plain_loss.item()), 1e-12)
    a, b = local_grads(dk_model), local_grads(plain_model)
    errs = {k: rel(a[k], b[k]) for k in b if b[k] is not None and b[k].numel()}
    grad_worst = max(errs, key=errs.get, default=None)
    grad_err = errs.get(grad_worst, 0.0)
    missing = [k for k in b if (a[k] is None) != (b[k] is None)]
    nonfinite = {}
    for side, grads in (("dualkv", a), ("plain", b)):
        bad = [k for k, g in grads.items() if g is not None and not torch.isfinite(g).all()]
        nonfinite[side] = len(bad)
        if bad:
            say(f"non-finite gradients ({side}): {len(bad)} of {len(grads)}, first {bad[:4]}")
    say(f"parity: loss {dk_loss.item():+.6f} vs {plain_loss.item():+.6f} (rel {loss_err:.2e}), max rel grad diff {grad_err:.2e} ({grad_worst})")

    # Timing: the same step again, each variant separately, after the warm-up above.
    timer = Timer(device)

    def step(fn, model):
        def run():
            fn(model, batch).backward()
            model.zero_grad(set_to_none=True)
        return run

    result = {}
    for name, fn, model in (("plain", plain_step, plain_model), ("dualkv", dk_step, dk_model)):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        ms = timer(step(fn, model), args.iters)
        peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
        result[name] = {"ms": ms, "peak_mib": peak}

    if args.profile:
        profile_steps(args, rank, (("plain", step(plain_step, plain_model)), ("dualkv", step(dk_step, dk_model))))

    mine = {
        # Per rank under --sp: the model graph's packed tokens (the one with attention; a loss graph after a graph break has its own layout).
        "rank": rank, "packed": packed, "local_tokens": max((r.local_tokens or 0 for r in graphs if r.num_attention), default=0) or None, "loss_rel_err": loss_err, "grad_max_rel_err": grad_err, "grad_worst": grad_worst, "missing_grads": missing,
        "nonfinite_grads": nonfinite, "stats": {"rows": stats.num_rows, "groups": stats.num_groups, "tokens_before": stats.tokens_before,
                  "tokens_after": stats.tokens_after, "rho": stats.rho, "attention_ratio": stats.attention_ratio},
        "split_prompts": [str(s) for s in report.split], **result,
    }
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    ok_parity = all(r["loss_rel_err"] <= tol and r["grad_max_rel_err"] <= tol and not r["missing_grads"] for r in everyone)
    all_packed = all(r["packed"] for r in everyone)
    if rank == 0:
        timed = args.iters > 0 and all(r["plain"]["ms"] and r["dualkv"]["ms"] for r in everyone)
        speedup = statistics.mean(r["plain"]["ms"] / r["dualkv"]["ms"] for r in everyone) if timed else None
        summary = {
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "device": args.device,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "mode": args.mode, "per_layer": args.per_layer, "bf16": args.bf16, "checkpoint": args.checkpoint, "world_size": world, "sp": args.sp, "baseline": args.baseline, "logprobs_in_model": args.logprobs_in_model, "inner": inner,
            "shape": {k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "prompts", "rollouts", "prompt_len", "response_len", "fixed_lengths")},
            "tolerance": tol, "parity": ok_parity, "packed_on_every_rank": all_packed, "mean_speedup": speedup, "ranks": everyone,
        }
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "fsdp_grpo.json"), "w") as f:
                json.dump(summary, f, indent=2)
            with open(os.path.join(args.out, "fsdp_grpo.md"), "w") as f:
                f.write(markdown(summary))
        verdict = "OK" if ok_parity and all_packed else ("NOT PACKED" if ok_parity else "MISMATCH")
        if not ok_parity and any(r["nonfinite_grads"]["plain"] for r in everyone) and not any(r["nonfinite_grads"]["dualkv"] for r in everyone):
            # A NaN in the reference's gradients (e.g. fully masked padding rows through a fused SDPA) leaves nothing to compare.
            verdict = "REFERENCE NON-FINITE (plain step's gradients; dualkv's are finite)"
        worst_loss = max(r["loss_rel_err"] for r in everyone)
        worst_grad = max(r["grad_max_rel_err"] for r in everyone)
        rho = statistics.mean(r["stats"]["rho"] for r in everyone)
        speed = f", speedup {speedup:.2f}x" if speedup else ""
        print(
            f"{args.mode}{' bf16' if args.bf16 else ''}{' checkpoint' if args.checkpoint else ''} x{world}{f' sp {args.sp}' if args.sp > 1 else ''} ({args.device}, against {args.baseline}): rho {rho:.2f}x{speed}, "
            f"loss rel err {worst_loss:.1e}, max grad rel err {worst_grad:.1e} (tol {tol:.0e}) - fsdp_grpo: {verdict}",
            flush=True,
        )
    return 0 if ok_parity and all_packed else 1


def profile_steps(args, rank, steps) -> None:
    """3 steps of each variant under torch.profiler; rank 0 writes two tables per variant to ``--out``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    for name, run in steps:
        with profile(activities=activities) as prof:
            for _ in range(3):
                run()
            if args.device == "cuda":
                torch.cuda.synchronize()
        if rank == 0 and args.out:
            os.makedirs(args.out, exist_ok=True)
            events = prof.key_averages()
            with open(os.path.join(args.out, f"profile_{name}.txt"), "w") as f:
                f.write(f"{name}: 3 steps, by self CPU time\n")
                f.write(events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90))
                if args.device == "cuda":
                    f.write(f"\n{name}: 3 steps, by device time\n")
                    f.write(events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90))


def markdown(s: dict) -> str:
    shape = ", ".join(f"{k}={v}" for k, v in s["shape"].items())
    lines = [
        f"# fsdp_grpo: {s['mode']}{' (fully_shard per layer)' if s['per_layer'] else ''}{', bf16 MixedPrecisionPolicy' if s['bf16'] else ''}{', activation checkpointing' if s.get('checkpoint') else ''}, {s['world_size']} ranks"
        + (f", sequence parallel {s['sp']}" if s.get("sp", 1) > 1 else "") + f"; baseline: {s.get('baseline', 'plain')}",
        "",
        f"{s['date']}; torch {s['torch']}; device {s['gpu'] or s['device']}; inner compiler {s['inner']}; {shape}.",
        f"Parity (relative, tolerance {s['tolerance']:.0e}): {'holds' if s['parity'] else 'FAILS'}; packed on every rank: {s['packed_on_every_rank']}.",
        "",
        "| rank | rows | groups | tokens before -> after (per rank) | rho | loss rel err | max grad rel err | plain ms | dualkv ms | speedup | plain peak MiB | dualkv peak MiB |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in s["ranks"]:
        st, p, d = r["stats"], r["plain"], r["dualkv"]
        sp = p["ms"] / d["ms"] if p["ms"] and d["ms"] else None
        lines.append(
            f"| {r['rank']} | {st['rows']} | {st['groups']} | {st['tokens_before']} -> {st['tokens_after']}"
            f"{' (' + str(r['local_tokens']) + ')' if r.get('local_tokens') else ''} | {st['rho']:.2f}x | "
            f"{r['loss_rel_err']:.1e} | {r['grad_max_rel_err']:.1e} | {f(p['ms'], '.2f')} | {f(d['ms'], '.2f')} | {f(sp, '.2f')} | "
            f"{f(p['peak_mib'], '.0f')} | {f(d['peak_mib'], '.0f')} |"
        )
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
