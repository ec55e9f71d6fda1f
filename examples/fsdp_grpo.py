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

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dualkv_compile  # noqa: E402
from dualkv_compile.distributed import check_groups_on_rank  # noqa: E402
from benchmarks.model.model_gpu import flops as step_flops  # noqa: E402  (the GPU benchmarks' FLOP model)
from examples.fsdp_grpo_model import LogProbPolicy, build_model, grpo_loss, in_shared_batch, make_batch, wrap  # noqa: E402
from examples.fsdp_grpo_report import (  # noqa: E402
    Timer, first_step, local_grads, markdown, mfu, out_of_memory_summary, profile_steps, rel,
)


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
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="a GPU's dense bf16 peak, for the MFU (H100/H200 SXM: 989)")
    ap.add_argument("--out", default=None, help="directory for fsdp_grpo.json / .md (rank 0)")
    return ap.parse_args(argv)


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
    model_cfg = base.config.to_dict()
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
                  "tokens_after": stats.tokens_after, "rho": stats.rho, "attention_ratio": stats.attention_ratio,
                  "attention_pairs_before": stats.attention_pairs_before, "attention_pairs_after": stats.attention_pairs_after},
        "flops": dict(zip(("logical", "executed"), step_flops(model_cfg, stats, vocab=args.vocab))),
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
        if device.type == "cuda" and args.bf16:
            summary["mfu"] = mfu(summary, args.peak_tflops)
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


if __name__ == "__main__":
    sys.exit(main())
