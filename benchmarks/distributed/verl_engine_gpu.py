"""veRL 0.9's FSDP engine on a GPU with and without dualkv: the forward/backward step at a Qwen3-1.7B shape.

One process per side, then a comparison (each side builds the same random-weight model from the same seed):

    python benchmarks/distributed/verl_engine_gpu.py --side plain --out /tmp/verl      # veRL's own forward_step
    python benchmarks/distributed/verl_engine_gpu.py --side dualkv --out /tmp/verl     # + external_lib=dualkv_compile.integrations.verl
    python benchmarks/distributed/verl_engine_gpu.py --compare /tmp/verl --report OUT  # times, peaks, log-prob and gradient agreement

The engine is veRL's ``FSDPEngineWithLMHead`` (FSDP2 on every layer, one NCCL rank, veRL's default bf16 mixed
precision, its gradient checkpointing on) built by ``examples/verl_engine_step.build_engine``; the batch is
veRL's remove-padding form of ``--groups`` prompts of ``--prompt-len`` tokens with ``--rollouts`` responses of
``--response-len`` tokens each, ``--micro-batch`` rows per micro-batch (default: one group, whole), a GRPO-style
loss on the log-probs with an entropy bonus. ``--side plain --plain-fused`` (saved as ``plain_fused``) runs the plain
side with veRL's ``use_fused_kernels``; ``--compare`` reads every plain side it finds.
The plain side's attention is ``--plain-attn`` (default ``torch_varlen``: ``benchmarks/ops/varlen_attention.py``,
torch's varlen flash attention over the row's sequences, standing in for the FlashAttention-2 varlen call veRL
configures, whose wheel does not exist for the machine); dualkv's model is configured with ``sdpa``, whose
attention its kernel replaces on the packed stream. Each side saves to ``--out``: step times, peak memory, the
loss, the log-probs and the gradients (bfloat16) of its first step.

veRL 0.9 imports ray at import time (``verl.protocol``) and ray's wheel is larger than what can be carried to
the GPU machine: ``benchmarks/distributed/verl_gpu_stubs/ray`` is a stub of it, named as such, put first on ``PYTHONPATH``
for these runs only; the engine's forward/backward in one process never calls ray.

On the GPU machine (torch 2.11, transformers 5.17 there) carry these wheels (``--no-deps``; README of the device
tool): verl 0.9.1, tensordict 0.15.3, pyvers 0.2.3, codetiming 1.4.0, hydra-core 1.3.8, omegaconf 2.4.0,
antlr4-python3-runtime 4.9.3 (built here as a wheel: only its sdist is on the index), pydantic 2.14.4,
pydantic_core 2.50.5, typing-inspection 0.4.5, annotated-types 0.8.0, orjson 3.13.0, pylatexenc 2.11 (7.7 MB
with trl's and datasets'), then:

    export PYTHONPATH=$PWD/benchmarks/distributed/verl_gpu_stubs:/tmp/site:$PWD
    python3 benchmarks/distributed/verl_engine_gpu.py --side plain && python3 benchmarks/distributed/verl_engine_gpu.py --side dualkv \
        && python3 benchmarks/distributed/verl_engine_gpu.py --compare /tmp/verl_engine_gpu --report $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)
from benchmarks import harness  # noqa: E402


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", choices=["plain", "dualkv"])
    ap.add_argument("--out", default="/tmp/verl_engine_gpu")
    ap.add_argument("--compare", default=None, help="a directory both sides wrote: compare them")
    ap.add_argument("--report", default=None, help="with --compare: write verl_engine_gpu.{json,md} here")
    ap.add_argument("--plain-attn", default="torch_varlen")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=6144)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--response-len", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="rows per micro-batch (ppo_micro_batch_size_per_gpu), both sides; default --rollouts: one group "
                    "each, whole (a 2 x 8 batch of 5K rows as one micro-batch is [81920, 151936] float32 logits: 46 GiB)")
    ap.add_argument("--plain-fused", action="store_true",
                    help="the plain side with veRL's use_fused_kernels (chunked log-probs and entropy, no [T, V] logits)")
    ap.add_argument("--iters", type=int, default=3, help="timed steps after the first")
    ap.add_argument("--profile", action="store_true", help="profile one more step after the timed ones: the top ops, "
                    "printed and saved (its time is not in the step times)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run (gloo, veRL's CPU stub)")
    return ap.parse_args(argv)


def batch(args, device):
    g = torch.Generator().manual_seed(1)
    P, R = args.prompt_len, args.response_len
    rows = []
    for _ in range(args.groups):
        prompt = torch.randint(1, args.vocab, (P,), generator=g)
        rows += [torch.cat([prompt, torch.randint(1, args.vocab, (R,), generator=g)]) for _ in range(args.rollouts)]
    ids = torch.stack(rows).to(device)
    mask = torch.ones_like(ids)
    pos = torch.arange(P + R, device=device).expand_as(ids).contiguous()
    response_mask = torch.ones(ids.shape[0], R, dtype=torch.long, device=device)
    return ids, mask, pos, response_mask


def run_side(args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29543"), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    cuda = args.device == "cuda"
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(0)
    else:
        import verl_cpu_platform

        verl_cpu_platform.install()
    import verl_engine_step as ves

    from benchmarks.ops import varlen_attention  # noqa: F401  (registers torch_varlen)

    dualkv = args.side == "dualkv"
    config = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  head_dim=args.head_dim, max_position_embeddings=max(4096, args.prompt_len + args.response_len + 8))
    fused = args.plain_fused and not dualkv
    micro_batch = args.micro_batch or args.rollouts
    engine = ves.build_engine(config, dualkv=dualkv, attn="sdpa" if dualkv else args.plain_attn, bf16=True,
                              checkpoint=True, inner="inductor" if cuda else "aot_eager", fused=fused)
    data = ves.verl_batch(*batch(args, "cuda" if cuda else "cpu"), micro_batch_size=micro_batch, fused=fused)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times, first = [], None
    for i in range(1 + args.iters + int(args.profile)):
        profiling = args.profile and i == 1 + args.iters
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if cuda else [])) if profiling else contextlib.nullcontext()
        sync()
        t = time.perf_counter()
        with prof:
            out = engine.forward_backward_batch(data, loss_function=ves.loss_function, forward_only=False)
            sync()
        elapsed = time.perf_counter() - t
        if profiling:  # a profiled step is slower: printed, not in the step times
            table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=25)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"profile_{args.side}.txt"), "w") as f:
                f.write(table)
            print(table, flush=True)
        else:
            times.append(elapsed)
        print(f"verl_engine_gpu: {args.side} step {i + 1}: {elapsed:.3f} s{' (profiled)' if profiling else ''}", flush=True)
        if i == 0:
            first = {
                "loss": float(out["metrics"]["loss"][0]) if isinstance(out.get("metrics", {}).get("loss"), list) else out.get("metrics"),
                "log_probs": out["model_output"]["log_probs"].values().float().cpu() if "model_output" in out else None,
                "grads": {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).to(torch.bfloat16).cpu()
                          for n, p in engine.module.named_parameters() if p.grad is not None},
            }
        engine.module.zero_grad(set_to_none=True)
    attn = "sdpa (dualkv kernel)" if dualkv else args.plain_attn + (" + veRL use_fused_kernels" if fused else "")
    result = {"side": args.side, "attn": attn, "micro_batch": micro_batch, "step_s": times,
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, **first}
    if dualkv:
        import dualkv_compile

        result["reports"] = [str(r) for r in dualkv_compile.reports()]
    os.makedirs(args.out, exist_ok=True)
    torch.save(result, os.path.join(args.out, f"{args.side}{'_fused' if fused else ''}.pt"))
    torch.distributed.destroy_process_group()


# What the summary keeps of each side's saved result.
SIDE_KEYS = ("attn", "micro_batch", "step_s", "peak_gib", "loss")


def compare_pair(a: dict, b: dict) -> tuple[dict, str]:
    """One plain side ``a`` against dualkv ``b``: the summary entries and a line of text."""
    grad_rel = {n: ((b["grads"][n].float() - g.float()).norm() / g.float().norm().clamp_min(1e-30)).item()
                for n, g in a["grads"].items() if n in b["grads"]}
    worst = max(grad_rel, key=grad_rel.get)
    lp = (b["log_probs"] - a["log_probs"]).abs().max().item() if a["log_probs"] is not None and b["log_probs"] is not None else None
    pm, dm = statistics.mean(a["step_s"][1:] or a["step_s"]), statistics.mean(b["step_s"][1:] or b["step_s"])
    entry = {"plain": {k: a.get(k) for k in SIDE_KEYS},
             "speedup": pm / dm, "log_prob_max_abs_diff": lp, "grad_max_rel": grad_rel[worst], "grad_worst": worst}
    text = (f"plain ({a['attn']}) {pm * 1e3:.1f} ms, dualkv {dm * 1e3:.1f} ms, speedup {pm / dm:.2f}x; "
            f"first step {a['step_s'][0]:.1f} s / {b['step_s'][0]:.1f} s; peak {a['peak_gib']} / {b['peak_gib']} GiB; "
            f"log-probs max |diff| {lp}; gradients max rel {grad_rel[worst]:.2e} ({worst})")
    return entry, text


def compare(args, argv=None) -> int:
    b = torch.load(os.path.join(args.compare, "dualkv.pt"), weights_only=False)
    stamp = harness.stamp("verl_engine_gpu", device=None, script=__file__, argv=argv)
    summary = {"date": stamp["date"], "torch": stamp["versions"]["torch"],
               "transformers": stamp["versions"]["transformers"],
               "gpu": stamp["device"] if torch.cuda.is_available() else None,
               "dualkv": {k: b.get(k) for k in SIDE_KEYS},
               "against": {}, "dualkv_reports": b.get("reports")}
    lines = []
    for side in ("plain", "plain_fused"):
        path = os.path.join(args.compare, f"{side}.pt")
        if not os.path.exists(path):
            continue
        summary["against"][side], text = compare_pair(torch.load(path, weights_only=False), b)
        lines.append(f"veRL engine step (steps 2+): {text}")
        print(lines[-1], flush=True)
    if not lines:
        raise SystemExit(f"no plain side in {args.compare}: run --side plain first")
    if args.report:
        meta = {k: summary[k] for k in ("date", "torch", "transformers", "gpu")}
        harness.write_json(os.path.join(args.report, "verl_engine_gpu.json"), harness.record(
            stamp, meta=meta, results={k: v for k, v in summary.items() if k not in meta}), indent=2)
        with open(os.path.join(args.report, "verl_engine_gpu.md"), "w") as f:
            body = "\n\n".join(f"- {t}" for t in lines)
            f.write(f"# veRL engine, with and without dualkv ({summary['date']})\n\n{summary['gpu']}; torch {summary['torch']}, "
                    f"transformers {summary['transformers']}\n{harness.markdown_stamp(stamp)[1]}\n\n{body}\n")
    return 0


def main(argv=None) -> int:
    args = parse(argv)
    if args.compare:
        return compare(args, argv)
    if not args.side:
        raise SystemExit("--side plain|dualkv, or --compare DIR")
    run_side(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
