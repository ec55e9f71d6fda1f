"""TRL's GRPOTrainer on a GPU, with and without dualkv: the training step's time, generation left out.

A Qwen3 of a given shape (default Qwen3-0.6B's: 28 layers, hidden 1024, MLP 3072, 16 / 8 heads of 128, vocabulary
151,936; random weights, bf16 autocast as TRL's ``bf16=True``), a word-level tokenizer of the vocabulary's size
built in code, ``--prompts`` prompts of ``--prompt-len`` words, ``--generations`` completions each of up to
``--max-completion`` tokens, one optimizer step per generation batch (``per_device_train_batch_size`` = the whole
batch, ``steps_per_generation`` 1), TRL's gradient checkpointing on (its default), ``--steps`` steps. The same
run twice in one process from the same weights and seed: TRL as it runs by default (eager model), then with
``dualkv_compile.integrations.trl.enable(trainer)``.

Each step's time is split: ``generate`` (TRL's ``_generate_and_score_completions``: generation, rewards,
advantages) and ``train`` (the rest of ``training_step``: the scoring forward, the loss, the backward).
CUDA is synchronised at each boundary. The first step includes compiling; the summary's means leave it out.
Rank 0 prints a table and writes ``trl_grpo_gpu.json`` / ``.md`` to ``--out``.

    python benchmarks/model/trl_grpo_gpu.py --out results/            # on a GPU, the Qwen3-0.6B shape
    python benchmarks/model/trl_grpo_gpu.py --layers 1 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --head-dim 16 \\
        --vocab 300 --prompt-len 12 --max-completion 6 --prompts 2 --generations 4 --steps 2   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import dualkv_compile  # noqa: E402
from benchmarks import harness  # noqa: E402
from examples.trl_grpo import word_tokenizer  # noqa: E402

log = logging.getLogger("trl_grpo_gpu")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128, help="Qwen3-0.6B's 128 (its 16 heads are wider than its hidden size)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=2048, help="words per prompt (one token each)")
    p.add_argument("--max-completion", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--inner", default=None, choices=["inductor", "aot_eager"], help="default: inductor on cuda, aot_eager on cpu")
    p.add_argument("--only", choices=["plain", "dualkv"], default=None, help="run one side only")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def model(args):
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        max_position_embeddings=max(4096, args.prompt_len + args.max_completion + 8), pad_token_id=0, eos_token_id=1,
        bos_token_id=1, tie_word_embeddings=True, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg)


def reward_low_ids(completions, **kwargs):
    """A toy reward: the share of words from the lower half of the vocabulary."""
    return [sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in c.split()) / max(len(c.split()), 1) for c in completions]


class StepClock:
    """Wall time of each ``training_step`` and of the generation inside it (CUDA synchronised at each edge)."""

    def __init__(self, trainer):
        self.steps: list[dict] = []
        self._gen = 0.0
        cuda = torch.cuda.is_available()
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        step, generate = trainer.training_step, trainer._generate_and_score_completions

        def timed_generate(*a, **k):
            sync()
            t = time.perf_counter()
            out = generate(*a, **k)
            sync()
            self._gen += time.perf_counter() - t
            return out

        def timed_step(*a, **k):
            self._gen = 0.0
            sync()
            t = time.perf_counter()
            out = step(*a, **k)
            sync()
            total = time.perf_counter() - t
            self.steps.append({"step_s": total, "generate_s": self._gen, "train_s": total - self._gen})
            return out

        trainer.training_step, trainer._generate_and_score_completions = timed_step, timed_generate


def run(args, use_dualkv: bool, out_dir: str):
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    tok = word_tokenizer([f"w{i}" for i in range(args.vocab - 2)])  # ids 0 .. vocab - 1
    policy = model(args)
    g = torch.Generator().manual_seed(1)
    prompts = [" ".join(f"w{j}" for j in torch.randint(0, args.vocab - 2, (args.prompt_len,), generator=g).tolist())
               for _ in range(args.prompts * args.steps)]
    rows = args.prompts * args.generations
    config = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=rows, steps_per_generation=1, gradient_accumulation_steps=1,
        num_generations=args.generations, max_completion_length=args.max_completion, max_steps=args.steps,
        logging_steps=1, report_to="none", use_cpu=not torch.cuda.is_available(), seed=0, save_strategy="no",
        bf16=torch.cuda.is_available(), gradient_checkpointing=True, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=policy, reward_funcs=reward_low_ids, args=config, processing_class=tok,
                          train_dataset=datasets.Dataset.from_dict({"prompt": prompts}))
    if use_dualkv:
        inner = args.inner or ("inductor" if torch.cuda.is_available() else "aot_eager")
        dualkv_compile.integrations.trl.enable(trainer, inner=inner)  # the one line
    clock = StepClock(trainer)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    packed = [r.last_stats for r in dualkv_compile.reports() if r.num_attention and r.packed_calls] if use_dualkv else []
    result = {"steps": clock.steps, "peak_mib": peak, "log": trainer.state.log_history,
              "layout": str(packed[-1]) if packed else None}
    del trainer, policy
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def mean_after_first(steps, key):
    xs = [s[key] for s in steps[1:]] or [s[key] for s in steps]
    return statistics.mean(xs)


def main(argv=None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("dualkv_compile").setLevel(logging.WARNING)
    sides = [s for s in ("plain", "dualkv") if args.only in (None, s)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in sides:
            log.info("trl_grpo_gpu: %s, %d steps of %d prompts x %d completions", side, args.steps, args.prompts, args.generations)
            results[side] = run(args, side == "dualkv", os.path.join(tmp, side))
            for i, s in enumerate(results[side]["steps"]):
                log.info("  %s step %d: train %.3f s, generate %.3f s", side, i + 1, s["train_s"], s["generate_s"])
    import trl

    stamp = harness.stamp("trl_grpo_gpu", device=None, script=__file__, argv=argv)
    summary = {
        "date": stamp["date"], "torch": stamp["versions"]["torch"], "transformers": stamp["versions"]["transformers"],
        "trl": trl.__version__, "gpu": stamp["device"] if torch.cuda.is_available() else None,
        "args": vars(args), "sides": {},
    }
    lines = ["| side | train s/step (steps 2+) | first step train s | generate s/step | peak MiB |", "|---|---:|---:|---:|---:|"]
    for side, r in results.items():
        tr = mean_after_first(r["steps"], "train_s")
        summary["sides"][side] = {"train_s_mean": tr, "generate_s_mean": mean_after_first(r["steps"], "generate_s"),
                                  "first_train_s": r["steps"][0]["train_s"], "peak_mib": r["peak_mib"],
                                  "steps": r["steps"], "layout": r["layout"],
                                  "step1": {k: v for k, v in r["log"][0].items()} if r["log"] else {}}
        lines.append(f"| {side} | {tr:.3f} | {r['steps'][0]['train_s']:.3f} | {summary['sides'][side]['generate_s_mean']:.3f} | "
                     f"{r['peak_mib'] if r['peak_mib'] is None else round(r['peak_mib'])} |")
    if len(results) == 2:
        speedup = summary["sides"]["plain"]["train_s_mean"] / summary["sides"]["dualkv"]["train_s_mean"]
        summary["train_speedup"] = speedup
        a, b = summary["sides"]["plain"]["step1"], summary["sides"]["dualkv"]["step1"]
        diffs = {k: abs(float(a[k]) - float(b[k])) / max(abs(float(a[k])), 1e-3) for k in ("loss", "grad_norm", "entropy") if k in a and k in b}
        summary["step1_rel_diff"] = diffs
        lines.append(f"\ntrain speedup (plain / dualkv, steps 2+): {speedup:.2f}x; step 1 metrics relative difference: "
                     + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    lines.append(f"dualkv's last packed layout: {summary['sides'].get('dualkv', {}).get('layout')}")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        meta = {k: summary[k] for k in ("date", "torch", "transformers", "trl", "gpu", "args")}
        harness.write_json(os.path.join(args.out, "trl_grpo_gpu.json"), harness.record(
            stamp, meta=meta, results={k: v for k, v in summary.items() if k not in meta}), indent=2)
        with open(os.path.join(args.out, "trl_grpo_gpu.md"), "w") as f:
            f.write(f"# TRL GRPOTrainer, with and without dualkv ({summary['date']})\n\n{summary['gpu']}; torch {summary['torch']}, "
                    f"transformers {summary['transformers']}, trl {summary['trl']}; args {vars(args)}\n"
                    f"{harness.markdown_stamp(stamp)[1]}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
