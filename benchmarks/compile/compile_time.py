"""Compile time of a GRPO loss step: ``@policy_loss(dynamic=True)`` against plain Inductor, cold and warm-started.

Every measurement is a fresh process (as every rank of every new training job is), timing the first forward +
backward (Dynamo, the rewrite, AOTAutograd, Inductor, the first run) and then one more step (the steady
state). Per side, two processes share one Inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``): the first
starts with it empty (cold), the second finds the FX graph and AOTAutograd caches the first filled (warm).

    python benchmarks/compile/compile_time.py --model 1.7b --out results/                          # on a GPU
    python benchmarks/compile/compile_time.py --model llama-1b --out results/                      # Llama-3.2-1B's shape
    python benchmarks/compile/compile_time.py --device cpu --model tiny --shape 4,64,16            # the mechanism, on CPU

Sides: ``plain`` is ``torch.compile(grpo_loss, dynamic=True)`` (Inductor) on the duplicated batch, ``dualkv``
is ``dualkv_compile.policy_loss(grpo_loss, dynamic=True)``; the loss is ``model_gpu.grpo_loss``. Prints a table
and writes ``compile_time.{json,md}`` to ``--out``. A second table splits each first step by phase (torch's
compile-time metrics: Dynamo's tracing, AOTAutograd's tracing, Inductor's codegen, cache loads), with Dynamo's
restarts of an analysis and the caches' bypasses; the reasons torch logged for them follow it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository
sys.path.insert(0, ROOT)
from benchmarks import harness  # noqa: E402
# Llama-3.2-1B's shape (issue 36 asks for a Llama-1B row beside the Qwen3 ones): 16 layers, head dim 64, tied head.
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1.7b", help="a model_gpu.MODELS key (tiny, 0.6b, 1.7b, 8b; Qwen3) or llama-1b")
    ap.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    ap.add_argument("--shape", default="8,1024,512", help="N,P,R: one group of N responses of R after a P-token prompt "
                    "(the plain side must fit: 16,4096,1024 ran out of memory on an H200 at Llama-1B)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--concurrent", action="store_true",
                    help="run the two sides side by side (less wall time; they share the host's CPUs, so each compiles "
                         "more slowly than alone, and the ratio is between two equally loaded processes)")
    ap.add_argument("--sides", default="plain,dualkv", help="the sides to measure (comma-separated; one side per "
                    "GPU in parallel runs, each with its own --out, keeps a long cold compile within one device call)")
    ap.add_argument("--profile-warm", action="store_true", help="run the warm process's first step under cProfile "
                    "and write where its time goes (by cumulative and by own time) to OUT/profile_<side>_warm.txt, the whole "
                    "profile to OUT/profile_<side>_warm.prof")
    ap.add_argument("--cache-dir", default=None, help="keep each side's Inductor cache in DIR/<side> (default: a "
                    "temporary directory, removed after), e.g. to read the generated code")
    ap.add_argument("--states", default="cold,warm", help="the processes to run per side: cold (an empty cache), warm "
                    "(the cache cold filled) or both; warm alone needs --cache-dir holding an earlier cold run's cache "
                    "(a long cold compile and its warm start then fit two device calls on one machine)")
    ap.add_argument("--packed-compile", choices=["direct", "nested"], default="direct", help="dualkv's route for "
                    "the packed graph (option packed_compile): direct, its default, or nested, for an A/B")
    ap.add_argument("--one", choices=["plain", "dualkv"], default=None, help=argparse.SUPPRESS)  # a child process
    ap.add_argument("--profile-to", default=None, help=argparse.SUPPRESS)  # the child's cProfile report, if any
    args = ap.parse_args(argv)
    if args.profile_warm and not args.out:
        ap.error("--profile-warm writes OUT/profile_<side>_warm.txt: give --out")
    unknown = set(args.sides.split(",")) - {"plain", "dualkv"}
    if unknown or not args.sides:
        ap.error(f"--sides: expected plain, dualkv or both (comma-separated), got {args.sides!r}")
    states = args.states.split(",")
    if not args.states or set(states) - {"cold", "warm"}:
        ap.error(f"--states: expected cold, warm or both (comma-separated), got {args.states!r}")
    if states == ["warm"] and not args.cache_dir:
        ap.error("--states warm: a warm start reads the cache an earlier cold run kept: give --cache-dir (the one "
                 "that run was given)")
    from benchmarks.model.model_gpu import MODELS

    if args.model != "llama-1b" and args.model not in MODELS:
        ap.error(f"--model: expected llama-1b or one of {', '.join(sorted(MODELS))}, got {args.model!r}")
    return args


def child(args) -> dict:
    """One process: the first step (compiling) and the next, in seconds."""
    import torch
    import dualkv_compile
    from benchmarks.model.model_gpu import MODELS, TINY_VOCAB, VOCAB, grpo_loss, make_batch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    llama = args.model == "llama-1b"
    cfg = dict(LLAMA_1B if llama else MODELS[args.model])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    vocab = cfg.pop("vocab_size", TINY_VOCAB if args.model == "tiny" else VOCAB)
    torch.manual_seed(0)
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if llama else (Qwen3Config, Qwen3ForCausalLM)
    model = model_cls(config_cls(vocab_size=vocab, max_position_embeddings=32768, use_cache=False,
                                 attn_implementation="sdpa", **cfg))
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = model.to(device=args.device, dtype=dtype).train()
    batch = make_batch(tuple(int(x) for x in args.shape.split(",")), args.device, vocab=vocab)
    notes = _watch_compile_logs()
    fn = (dualkv_compile.policy_loss(grpo_loss, dynamic=True, inner="inductor",
                                            packed_compile=args.packed_compile) if args.one == "dualkv"
          else torch.compile(grpo_loss, dynamic=True))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times = []
    for i in range(2):
        prof = None
        if i == 0 and args.profile_to:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        sync()
        t = time.perf_counter()
        fn(model, batch).backward()
        sync()
        times.append(time.perf_counter() - t)
        if prof is not None:
            prof.disable()
            _write_profile(prof, args.profile_to)
        model.zero_grad(set_to_none=True)
    packed = any(r.packed_calls for r in dualkv_compile.reports()) if args.one == "dualkv" else None
    split = breakdown(notes)
    # Whether a warm start found its graphs: Inductor's FX graph cache and AOTAutograd's cache, hits and misses.
    c = torch._dynamo.utils.counters
    caches = {k: int(c[group][k]) for group, keys in (("inductor", ("fxgraph_cache_hit", "fxgraph_cache_miss")),
                                                       ("aot_autograd", ("autograd_cache_hit", "autograd_cache_miss")))
              for k in keys}
    return {"first_s": times[0], "second_s": times[1], "packed": packed, **caches, **split}


# Phases of torch's compile-time metrics (torch._dynamo.utils.compilation_time_metrics, seconds per event) summed
# into the breakdown: where a first step's compile time goes.
PHASES = {
    "compile_s": ("_compile.compile_inner",),  # every Dynamo frame, its backend included (dualkv's nested ones too)
    "dynamo_trace_s": ("bytecode_tracing",),  # Dynamo's bytecode tracing (never cached by torch 2.11-2.14)
    "aot_trace_s": ("aot_collect_metadata", "aot_trace_joint_graph"),  # AOTAutograd's tracing (a cache miss's)
    "inductor_s": ("fx_codegen_and_compile",),  # Inductor's lowering and codegen (an FX graph cache miss's)
    "cache_load_s": ("AOTAutogradCache.inductor_load",),  # loading a cache hit's compiled graphs
}


def _write_profile(prof, path: str) -> None:
    """cProfile's top functions by cumulative and by own time, and torch's compile-time metrics by total."""
    import io
    import pstats

    import torch

    buf = io.StringIO()
    for key in ("cumulative", "tottime"):
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(45)
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", {})
    totals = sorted(((sum(v), len(v), k) for k, v in metrics.items()), reverse=True)
    buf.write("\ntorch compile-time metrics (s, calls, name; then each call's s for the per-frame phases):\n")
    buf.writelines(f"{t:9.3f} {n:5d} {k}\n" for t, n, k in totals[:40])
    for name in ("_compile.compile_inner", "bytecode_tracing", "AOTAutogradCache.inductor_load"):
        buf.write(f"{name}: {', '.join(f'{t:.3f}' for t in metrics.get(name, ()))}\n")
    with open(path, "w") as f:
        f.write(buf.getvalue())
    prof.dump_stats(path.rsplit(".", 1)[0] + ".prof")  # the whole profile, for pstats or snakeviz


def _watch_compile_logs() -> list:
    """Collect, from torch's loggers, why a cache was bypassed and why Dynamo restarted an analysis."""
    import logging

    notes = []

    class Keep(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if msg.startswith(("Bypassing", "Restarting analysis", "AOTAutograd cache unable")):
                notes.append(msg.splitlines()[0][:300])

    for name in ("torch._functorch._aot_autograd.autograd_cache", "torch._inductor.codecache",
                 "torch._dynamo.convert_frame"):
        logger = logging.getLogger(name)
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
        logger.addHandler(Keep(logging.INFO))
    return notes


def breakdown(notes: list) -> dict:
    """The first step's compile time by phase (``PHASES``), Dynamo's restarts of an analysis (each retraces its
    frame, and a TensorifyScalarRestartAnalysis comes after AOTAutograd traced the whole graph), and the caches'
    bypass reasons."""
    import torch

    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", {})
    out = {k: round(sum(sum(metrics.get(name, ())) for name in names), 3) for k, names in PHASES.items()}
    out["restarts"] = sum(len(v) for k, v in metrics.items() if k.startswith("compile_attempt_") and k != "compile_attempt_0")
    out["cache_bypass"] = int(torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_bypass"]
                              + torch._dynamo.utils.counters["inductor"]["fxgraph_cache_bypass"])
    out["notes"] = sorted(set(notes))
    return out


def run(args, side: str, cache: str, state: str = "cold") -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", side, "--model", args.model, "--shape", args.shape,
           "--device", args.device, "--packed-compile", args.packed_compile]
    cmd += ["--layers", str(args.layers)] if args.layers else []
    if args.profile_warm and state == "warm":
        os.makedirs(args.out, exist_ok=True)
        cmd += ["--profile-to", os.path.join(os.path.abspath(args.out), f"profile_{side}_warm.txt")]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    from dualkv_compile.runtime.nested_compile import _COALESCE_ANALYSIS_BREAKS_DYNAMIC

    if _COALESCE_ANALYSIS_BREAKS_DYNAMIC:
        # torch < 2.12: Inductor's coalescing analysis fails on some dynamic-shape graphs (pytorch/pytorch#181563;
        # a first GPU run of this benchmark on torch 2.11 died in it). dualkv's inner compile turns it off for its
        # dynamic graphs; plain Inductor gets the same setting, so both sides compile alike.
        env["TORCHINDUCTOR_COALESCE_TILING_ANALYSIS"] = "0"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"compile_time: the {side} process failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cell(row: dict, key: str, fmt: str = ".2f") -> str:
    return format(row[key], fmt) if key in row else "-"


def main(argv=None) -> int:
    args = parse(argv)
    if args.one:
        print(json.dumps(child(args)), flush=True)
        return 0
    rows = {}

    def one_side(side: str) -> None:
        kept = os.path.join(os.path.abspath(args.cache_dir), side) if args.cache_dir else None
        if kept:
            os.makedirs(kept, exist_ok=True)
            if "cold" in args.states.split(",") and os.listdir(kept):
                raise SystemExit(f"compile_time: --cache-dir: {kept} is not empty, so a cold run would start warm; "
                                 "give an empty or new directory")
            if "cold" not in args.states.split(",") and not os.listdir(kept):
                raise SystemExit(f"compile_time: --states warm: {kept} is empty, so the warm run would start cold; "
                                 "give the --cache-dir an earlier cold run kept")
        with (contextlib.nullcontext(kept) if kept else tempfile.TemporaryDirectory()) as cache:
            for state in [s for s in ("cold", "warm") if s in args.states.split(",")]:
                print(f"compile_time: {side}, {state} cache ...", file=sys.stderr, flush=True)
                rows[(side, state)] = run(args, side, cache, state)
                print(f"compile_time: {side}, {state}: {json.dumps(rows[(side, state)])}", file=sys.stderr, flush=True)

    sides = [s for s in ("plain", "dualkv") if s in args.sides.split(",")]
    if args.concurrent:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(one_side, sides))
    else:
        for side in sides:
            one_side(side)
    lines = ["| side | cold: first step s | warm: first step s | next step s | warm: FX graph cache hit / miss | "
             "warm: AOTAutograd cache hit / miss |", "|---|---:|---:|---:|---:|---:|"]
    for side in sides:
        cold, warm = rows.get((side, "cold"), {}), rows.get((side, "warm"), {})
        lines.append(f"| {side} | {_cell(cold, 'first_s')} | {_cell(warm, 'first_s')} | "
                     f"{_cell(cold or warm, 'second_s', '.3f')} | "
                     f"{warm.get('fxgraph_cache_hit', '-')} / {warm.get('fxgraph_cache_miss', '-')} | "
                     f"{warm.get('autograd_cache_hit', '-')} / {warm.get('autograd_cache_miss', '-')} |")
    lines += ["", "Where the first step's time goes (s; torch's compile-time metrics: Dynamo frames with their backends, "
              "Dynamo's bytecode tracing, AOTAutograd's tracing, Inductor's codegen, cache loads; restarts: Dynamo "
              "analyses traced again):", "",
              "| side | state | first step | compile | Dynamo tracing | AOTAutograd tracing | Inductor codegen | "
              "cache loads | restarts | cache bypasses |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for side in sides:
        for state in ("cold", "warm"):
            if (side, state) not in rows:
                continue
            r = rows[(side, state)]
            cells = [f"{r[k]:.2f}" if k in r else "-" for k in ("first_s", *PHASES)]
            lines.append(f"| {side} | {state} | {' | '.join(cells)} | {r.get('restarts', '-')} | "
                         f"{r.get('cache_bypass', '-')} |")
    notes = sorted({f"{side}/{state}: {n}" for (side, state), r in rows.items() for n in r.get("notes", ())})
    if notes:
        lines += ["", "torch's log: " + "; ".join(notes)]
    if len(sides) == 2 and len(rows) == 4:
        ratio = rows[("dualkv", "cold")]["first_s"] / rows[("plain", "cold")]["first_s"]
        warm_ratio = rows[("dualkv", "warm")]["first_s"] / rows[("plain", "warm")]["first_s"]
        lines.append(f"\ndualkv's first step / plain Inductor's: cold {ratio:.2f}x, warm {warm_ratio:.2f}x; dualkv "
                     f"packed: {rows[('dualkv', 'cold')]['packed']}")
    elif "dualkv" in sides:
        lines.append(f"\ndualkv packed: {(rows.get(('dualkv', 'cold')) or rows[('dualkv', 'warm')])['packed']}")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        stamp = harness.stamp("compile_time", device=args.device, script=__file__, argv=argv)
        meta = {"date": stamp["date"], "torch": stamp["versions"]["torch"], "device": stamp["device"],
                "model": args.model, "layers": args.layers, "shape": args.shape,
                "concurrent": args.concurrent, "sides": sides, "states": args.states,
                "packed_compile": args.packed_compile}
        harness.write_json(os.path.join(args.out, "compile_time.json"), harness.record(
            stamp, meta=meta, rows=[dict(side=s, state=t, **r) for (s, t), r in rows.items()]), indent=2)
        with open(os.path.join(args.out, "compile_time.md"), "w") as f:
            f.write("\n".join([f"# Compile time ({meta})", "", *harness.markdown_stamp(stamp), "", text]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
