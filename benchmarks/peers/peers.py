"""Peers (issue 36): dualkv beside the other shared-prefix methods, one model, one GRPO batch, one process.

One Hugging Face Qwen3 model built from its config (random weights), ``--shape``: tiny (the default; CPU),
``tiny-moe`` (``model_moe.py``'s tiny MoE, 2 layers; CPU), ``qwen3-0.6b``, ``qwen3-1.7b`` (full depth),
``qwen3-8b`` (4 of its 36 layers unless ``--layers``) and ``qwen3-30b-a3b`` (``model_moe.py``'s Qwen3-MoE config,
128 experts top-8, 4 of its 48 layers unless ``--layers``); the report says the depth run. Shape flags given override
the preset. The MoE step leaves the router's aux loss out (``output_router_logits`` off): the peers' layouts weight
that loss by their own token multiplicities, so it would not be the same loss on every side. One GRPO batch:
``--groups`` prompts of ``--prompt-len`` tokens, ``--rollouts`` responses each of ``--response-len`` tokens
(``--ragged``: lengths uniform in [R/2, R], right padded). A step is forward + backward of the token-mean GRPO loss
``mean(-logp * advantage)`` over the response tokens (fixed random advantage per response). Each side
(``peers_sides.py``) runs that step on the same weights and batch, in the layout its method asks for:

- ``plain``: the HF model on the duplicated padded batch (SDPA); ``plain_compiled`` the same under Inductor
  (``--compile``); ``plain_varlen``: the batch's sequences as one remove-padding row through torch's varlen
  attention with chunked log-probs (``model_remove_padding.py``'s strongest baseline, what veRL users run; under
  Inductor with ``--compile``). ``plain_varlen`` is the strongest baseline the speedups are taken against.
- ``dualkv``: the same loss function as ``plain`` under ``@dualkv_compile.policy_loss``.
- ``prefix_grouper``: PrefixGrouper through its transformers integration (``register_attention``), the
  [prefix | suffixes] layout from its ``concat_input`` / ``split_output``, positions as its README prescribes; its
  inner attention has FlashAttention-2's contract: ``flash_attention_2`` where ``flash_attn`` is installed, else
  ``--standin`` (``varlen``, the default on CUDA: torch's varlen flash attention; ``sdpa``). Its layout work is timed.
- ``trl_prefix_tree``: TRL 1.16's ``trl.experimental.async_grpo.packing`` (``TreeRow`` prefix trie,
  ``tree_attention``) with its FlashAttention-3 kernel from the Hub through ``kernels``;
  ``trl_prefix_tree_standin``: the same with that kernel's call answered by the ``--standin`` kernel. TRL packs in its
  collator, outside the step, so the packing is not timed.
- ``flash_pref``: flash-pref's ``shared_prefix`` context (written for transformers < 4.52).

For each: loss and largest parameter-gradient difference relative to the reference (``plain``; where it cannot run,
e.g. out of memory, the first of ``plain_compiled``, ``plain_varlen`` that ran; float32 on CPU, bf16 on GPU), the
tokens its layers run on, whether that is packed, the median step time over ``--iters`` after 2 warm-up steps
(``model_gpu.time_step``), peak CUDA memory, and the FLOP model of its step: ``model_gpu.flops`` (dense) or
``model_moe.flops`` (MoE: the top-k experts' MLPs and the router per token) on the tokens and the attention pairs its
layout computes (``peers_sides.Side``). Against the strongest baseline: ideal = baseline FLOPs / side FLOPs,
speedup = baseline ms / side ms, of ideal = speedup / ideal. A side that is not installed or fails gives
``cannot run: <reason>``. Writes ``peers.json`` and ``peers.md`` to ``--out`` after every side (a run cut short keeps
what it measured).

    python benchmarks/peers/peers.py --device cpu --out /tmp/peers                      # tiny, about 10 s on 2 cores
    python benchmarks/peers/peers.py --device cpu --shape tiny-moe --out /tmp/peers_moe
    python benchmarks/peers/peers.py --device cuda --shape qwen3-0.6b --groups 2 --rollouts 8 --prompt-len 1024 \\
        --response-len 512 --ragged --compile --iters 5 --out benchmarks/results/peers_h100   # peers_rows.sh: all rows
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
import dualkv_compile  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.model import model_gpu  # noqa: E402
from benchmarks.model import model_moe  # noqa: E402
from benchmarks.model.model_gpu import MODELS, TINY_VOCAB, VOCAB, time_step  # noqa: E402
from benchmarks.peers.peers_sides import SIDES, make_batch, unmet_requirements, version  # noqa: E402

# name: (MoE, model config fields, layers unless --layers, the published model's depth). The MoE configs are
# model_moe.py's (its MODELS carry the vocab; layers come from here).
SHAPES = {
    "tiny-moe": (True, model_moe.MODELS["tiny"], 2, None),
    "qwen3-0.6b": (False, MODELS["0.6b"], MODELS["0.6b"]["num_hidden_layers"], 28),
    "qwen3-1.7b": (False, MODELS["1.7b"], MODELS["1.7b"]["num_hidden_layers"], 28),
    "qwen3-8b": (False, MODELS["8b"], 4, MODELS["8b"]["num_hidden_layers"]),
    "qwen3-30b-a3b": (True, model_moe.MODELS["30b-a3b"], 4, 48),
}
MODEL_FLAGS = dict(hidden="hidden_size", heads="num_attention_heads", kv_heads="num_key_value_heads",
                   head_dim="head_dim", intermediate="intermediate_size")
MOE_FLAGS = dict(experts="num_experts", top_k="num_experts_per_tok", moe_intermediate="moe_intermediate_size")


def log(msg):
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def step_flops(cfg: dict, layers: int, vocab: int, moe: bool, tokens: int, pairs: int) -> float:
    """fwd+bwd FLOPs of one step on ``tokens`` rows and ``pairs`` attention pairs, by the benchmarks' FLOP models
    (``model_gpu.flops``; MoE: ``model_moe.flops``, active experts and router), read off their duplicated side."""
    layout = SimpleNamespace(tokens_before=tokens, attention_pairs_before=pairs, tokens_after=tokens,
                             attention_pairs_after=pairs)
    if moe:
        return model_moe.flops({**cfg, "vocab_size": vocab}, layers, layout)[0]
    return model_gpu.flops({**cfg, "num_hidden_layers": layers}, layout, vocab)[0]


def loss_and_grads(fn, model, batch, ref=None):
    """One step's loss and, against ``ref`` (the reference side's ``(loss, grads)``), its differences; without
    ``ref``, the gradients themselves, kept on the host so that no side's peak memory holds them."""
    model.zero_grad(set_to_none=True)
    loss = fn(model, batch)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if ref is None:
        out = loss.item(), {n: g.detach().to("cpu", copy=True) for n, g in grads.items()}
    else:
        # Largest over parameters of max |g - g_ref| / max |g_ref|; a parameter left without a gradient counts 1.
        worst = 0.0
        for name, r in ref[1].items():
            g, r = grads.get(name), r.to(loss.device).float()
            worst = max(worst, 1.0 if g is None else float((g.float() - r).abs().max() / r.abs().max().clamp_min(1e-30)))
        out = dict(loss=loss.item(), loss_rel=abs(loss.item() - ref[0]) / max(abs(ref[0]), 1e-30), grad_rel=worst)
    model.zero_grad(set_to_none=True)
    return out


def run_side(name, model, batch, args, ref, flops_of):
    """One side's row (``flops_of(tokens, pairs)`` its FLOPs) and, without ``ref``, its ``(loss, grads)``."""
    row, side = dict(side=name), None
    try:
        side = SIDES[name](model, batch, args)
        row.update(tokens=side.tokens, pairs=side.pairs, flops=flops_of(side.tokens, side.pairs), note=side.note)
        model.config._attn_implementation = side.attn
        torch._dynamo.reset()
        start = len(dualkv_compile.reports())
        checked = loss_and_grads(side.loss, model, batch, ref)
        packed = side.packed
        if packed is None:  # dualkv: packed if one of its graphs ran rewritten on a packed call
            packed = any(r.rewritten and r.packed_calls for r in dualkv_compile.reports()[start:])
        row.update(packed=packed, **(dict(loss=checked[0]) if ref is None else checked))
        ms, peak, _ = time_step(side.loss, model, batch, args.iters, args.device)
        row.update(status="ok", ms=ms, peak_gb=peak if args.device == "cuda" else None)
        if name in args.profile:  # where the step's time goes, after the timed steps (the profiler slows it)
            from benchmarks.probes.step_profile import profile_step

            try:  # a profiler that fails costs the profile, not the row measured above
                text = profile_step(side.loss, model, batch, args.device, title=f"{name} ({side.note})")
            except Exception as e:  # noqa: BLE001
                text = f"### Profile: {name}\n\nthe profiler failed: {type(e).__name__}: {e}\n"
            with open(os.path.join(args.out, f"profile_{name}.md"), "w") as f:
                f.write(text)
        if name in args.syncs:  # which calls make the host wait for the device, by site (CUDA's sync debug mode)
            from benchmarks.probes.step_profile import sync_sites

            with open(os.path.join(args.out, f"syncs_{name}.md"), "w") as f:
                f.write(sync_sites(side.loss, model, batch, title=f"{name} ({side.note})", steps=2))
        return row, checked if ref is None else None
    except Exception as e:  # noqa: BLE001  (a peer that fails is a row, not a crash)
        where = traceback.extract_tb(e.__traceback__)[-1]
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]
        dist = getattr(side.loss, "dist", None) if side else None
        unmet = unmet_requirements(dist) if dist else ""
        row.update(status=f"cannot run: {reason} (at {os.path.basename(where.filename)}:{where.lineno})"
                          + (f"; {unmet}" if unmet else ""))
        return row, None
    finally:
        model.config._attn_implementation = "sdpa"
        model.zero_grad(set_to_none=True)
        if args.device == "cuda":  # what a side left (an out-of-memory one's tensors too) is not the next side's peak
            gc.collect()
            torch.cuda.empty_cache()


def against_baseline(rows) -> dict:
    """Fill each row's ``ideal`` (baseline FLOPs / its FLOPs), ``speedup`` (baseline ms / its ms) and ``of_ideal``
    against the strongest baseline, ``plain_varlen`` (else ``plain`` where it was not among the sides); returns it."""
    base = next((r for r in rows if r["side"] == "plain_varlen"), rows[0] if rows else {})
    for r in rows:
        if r.get("flops") and base.get("flops"):
            r["ideal"] = base["flops"] / r["flops"]
        if r.get("ms") and base.get("ms"):
            r["speedup"] = base["ms"] / r["ms"]
            r["of_ideal"] = r["speedup"] / r["ideal"]
    return base


def markdown(meta, rows):
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    base = against_baseline(rows)
    # Also against the fastest way to run the duplicated batch without sharing (plain, compiled, varlen).
    fastest = min((r for r in rows if r["side"].startswith("plain") and r.get("ms")), key=lambda r: r["ms"], default={})
    lines = [f"# Peers: one GRPO step, {meta['model']} ({meta['device']}, {meta['dtype']}, {meta['date']})", "",
             f"- batch: {meta['batch']}; {meta['tokens_duplicated']} valid tokens duplicated, {meta['tokens_unique']} unique",
             f"- torch {meta['torch']}, transformers {meta['transformers']}, trl {meta['trl']}, prefix-grouper "
             f"{meta['prefix_grouper']}, flash-pref {meta['flash_pref']}, kernels {meta['kernels']}, flash-attn "
             f"{meta['flash_attn']}; median of {meta['iters']} steps after 2 warm-up"
             + (f", CPU threads: {meta['threads']}" if meta.get("threads") else ""),
             f"- strongest baseline: `{base.get('side')}` ({base.get('note', 'did not run')}); vs base = its step time "
             "over the side's; ideal = its FLOPs over the side's; of ideal = vs base / ideal",
             f"- FLOPs: {meta['flop_model']}, on the tokens and the attention pairs each side's layout computes "
             "(`peers_sides.py`)",
             f"- loss / grad rel: against `{meta.get('reference', 'plain')}`; grad rel = max over parameters of "
             "max|g - g_ref| / max|g_ref|",
             f"- vs fastest plain: {fastest.get('side')}'s step time over the side's", f"- `{meta['command']}`", "",
             "| side | status | packed | tokens | GFLOP | step ms | vs base | ideal | of ideal | vs fastest plain | peak GB "
             "| loss | loss rel | grad rel | how |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        speed = f"{fastest['ms'] / r['ms']:.2f}x" if fastest and r.get("ms") else "-"
        lines.append(f"| {r['side']} | {r['status']} | {r.get('packed', '-')} | {r.get('tokens', '-')} "
                     f"| {fmt(r.get('flops') and r['flops'] / 1e9, '.4g')} | {fmt(r.get('ms'), '.1f')} "
                     f"| {fmt(r.get('speedup'), '.2f')}x | {fmt(r.get('ideal'), '.2f')}x | {fmt(r.get('of_ideal'), '.2f')} "
                     f"| {speed} | {fmt(r.get('peak_gb'), '.2f')} | {fmt(r.get('loss'), '.6f')} "
                     f"| {fmt(r.get('loss_rel'), '.1e')} | {fmt(r.get('grad_rel'), '.1e')} | {r.get('note', '')} |")
    return "\n".join(lines).replace("| -x |", "| - |") + "\n"


def build_model(args, ap):
    """The model ``--shape`` and the shape flags describe, its config fields, depth, vocab, whether MoE, its label."""
    moe, preset, default_layers, full = SHAPES[args.shape] if args.shape else (False, MODELS["tiny"], 2, None)
    flags = {**MODEL_FLAGS, **MOE_FLAGS}
    given = {key: getattr(args, flag) for flag, key in flags.items() if getattr(args, flag) is not None}
    for flag, key in MOE_FLAGS.items():
        if not moe and key in given:
            ap.error(f"--{flag.replace('_', '-')}: only for an MoE shape (tiny-moe, qwen3-30b-a3b), got "
                     + (f"--shape {args.shape}" if args.shape else "the dense tiny model (no --shape)"))
    for flag in (*flags, "layers", "vocab"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}: must be a positive integer, got {getattr(args, flag)}")
    cfg = {k: v for k, v in {**preset, **given}.items() if k not in ("vocab_size", "num_hidden_layers")}
    layers = args.layers or default_layers
    vocab = args.vocab or preset.get("vocab_size") or (VOCAB if args.shape else TINY_VOCAB)
    if moe:
        from transformers import Qwen3MoeForCausalLM

        name = next(k for k, v in model_moe.MODELS.items() if v is preset)
        model = Qwen3MoeForCausalLM(model_moe.moe_config(name, layers, vocab_size=vocab, tie_word_embeddings=False, **given))
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, max_position_embeddings=32768, use_cache=False,
                                             tie_word_embeddings=False, attn_implementation="sdpa",
                                             num_hidden_layers=layers, **cfg))
    depth = f"{layers} of {full} layers" if full and layers != full else f"{layers} layers"
    label = (f"{args.shape or 'qwen3'} ({depth}, hidden {cfg['hidden_size']}, heads {cfg['num_attention_heads']}/"
             f"{cfg['num_key_value_heads']}, head_dim {cfg['head_dim']}, "
             + (f"{cfg['num_experts']} experts top-{cfg['num_experts_per_tok']} of width {cfg['moe_intermediate_size']}"
                if moe else f"mlp {cfg['intermediate_size']}") + f", vocab {vocab})")
    return model, cfg, layers, vocab, moe, label


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a preset (qwen3-*: vocab 151936); shape flags override it")
    ap.add_argument("--layers", type=int, help="layers (default: the preset's; qwen3-8b and qwen3-30b-a3b: 4)")
    for flag in [*MODEL_FLAGS, *MOE_FLAGS, "vocab"]:  # unset: the preset's, else model_gpu.py's tiny model (vocab 512)
        ap.add_argument(f"--{flag.replace('_', '-')}", type=int)
    for flag, default in (("groups", 2), ("rollouts", 4), ("prompt-len", 48), ("response-len", 12), ("iters", 3)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--ragged", action="store_true", help="response lengths uniform in [R/2, R]")
    ap.add_argument("--compile", action="store_true", help="add plain_compiled (Inductor) and compile plain_varlen")
    ap.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads); 1 gives steady times on shared cores")
    ap.add_argument("--standin", choices=["varlen", "sdpa"], help="the kernel that answers PrefixGrouper's inner "
                    "attention and TRL's FlashAttention-3 call: torch's varlen flash attention (CUDA; the default there) or SDPA")
    ap.add_argument("--inner", default=None, help="dualkv's inner compiler (default inductor on cuda, aot_eager on cpu)")
    ap.add_argument("--packed-compile", choices=["direct", "nested"], default="direct",
                    help="dualkv's route for the packed graph (option packed_compile), for an A/B")
    ap.add_argument("--sides", default=",".join(s for s in SIDES if s not in ("plain", "plain_compiled")),
                    help="the sides beside plain (which always runs first: the reference)")
    ap.add_argument("--profile", default="", help="comma-separated sides to profile after their timing (torch.profiler: "
                    "device kernels by kind, launches, host ops; profile_<side>.md in --out)")
    ap.add_argument("--syncs", default="", help="comma-separated sides whose host-device syncs to count by call site "
                    "after their timing (torch.cuda.set_sync_debug_mode; syncs_<side>.md in --out; CUDA only)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="default: benchmarks/results/peers/<device>-<date>/ (benchmarks/harness.py)")
    args = ap.parse_args(argv)
    stamp = harness.stamp("peers", device=args.device, script=__file__, argv=argv)
    args.out = args.out or harness.result_dir(stamp)
    args.profile = [s for s in args.profile.split(",") if s]
    args.syncs = [s for s in args.syncs.split(",") if s]
    for flag in ("groups", "rollouts", "prompt_len", "response_len", "iters"):
        if getattr(args, flag) < (2 if flag == "response_len" else 1):
            ap.error(f"--{flag.replace('_', '-')}: must be at least {2 if flag == 'response_len' else 1}, got {getattr(args, flag)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.standin = args.standin or ("varlen" if args.device == "cuda" else "sdpa")
    args.inner = args.inner or ("inductor" if args.device == "cuda" else "aot_eager")
    sides = [s for s in args.sides.split(",") if s and s != "plain"]
    if args.compile and "plain_compiled" not in sides:
        sides.insert(0, "plain_compiled")
    if set(args.profile) - set(SIDES):
        ap.error(f"--profile: unknown sides {sorted(set(args.profile) - set(SIDES))}; known: {list(SIDES)}")
    if set(args.syncs) - set(SIDES):
        ap.error(f"--syncs: unknown sides {sorted(set(args.syncs) - set(SIDES))}; known: {list(SIDES)}")
    if set(sides) - set(SIDES):
        ap.error(f"--sides: unknown sides {sorted(set(sides) - set(SIDES))}; known: {list(SIDES)}")

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(args.device):  # initialised where it runs: the 30B-A3B shape's 3.1e9 parameters in seconds
        model, cfg, layers, vocab, moe, label = build_model(args, ap)
    model = model.to(device=args.device, dtype=dtype).train()
    if args.device == "cuda":  # the float32 weights' blocks are not the sides' to reuse
        torch.cuda.empty_cache()
    batch = make_batch(args.groups, args.rollouts, args.prompt_len, args.response_len, args.ragged, vocab, args.device)
    valid = int(batch["attention_mask"].sum())
    meta = dict(
        date=stamp["date"], device=stamp["device"],
        dtype=str(dtype).removeprefix("torch."), torch=torch.__version__, transformers=version("transformers"),
        trl=version("trl"), prefix_grouper=version("prefix-grouper"), flash_pref=version("flash-pref"),
        kernels=version("kernels"), flash_attn=version("flash-attn"), model=label, shape=args.shape, layers=layers,
        moe=moe, threads=torch.get_num_threads() if args.device == "cpu" else None, iters=args.iters,
        command=stamp["command"], tokens_duplicated=valid,
        tokens_unique=valid - (args.rollouts - 1) * args.groups * args.prompt_len,
        flop_model="model_moe.flops (top-k experts' MLPs and the router per token)" if moe else "model_gpu.flops",
        batch=f"{args.groups} prompts x {args.prompt_len} tokens, {args.rollouts} responses each of "
              f"{f'{args.response_len // 2}..' if args.ragged else ''}{args.response_len} tokens")
    os.makedirs(args.out, exist_ok=True)
    flops_of = lambda tokens, pairs: step_flops(cfg, layers, vocab, moe, tokens, pairs)  # noqa: E731

    log(f"{meta['model']} on {meta['device']}: {meta['batch']}; sides plain, {', '.join(sides)}")
    rows, ref = [], None
    for name in ["plain"] + sides:
        log(f"{name}: exactness, warm-up and {args.iters} steps")
        # The first of the plain sides that runs (plain unless it runs out of memory) is the reference.
        as_ref = ref is None and name.startswith("plain")
        row, checked = run_side(name, model, batch, args, None if as_ref else ref, flops_of)
        if as_ref and checked is not None:
            ref, meta["reference"] = checked, name
        rows.append(row)
        log(f"{name}: {row['status']}" + (f", {row['ms']:.1f} ms, packed {row['packed']}" if row["status"] == "ok" else "")
            + (f", grad rel {row['grad_rel']:.1e}" if "grad_rel" in row else ""))
        text = markdown(meta, rows)  # after every side: a run cut short keeps what it has
        harness.write_json(os.path.join(args.out, "peers.json"), harness.record(stamp, meta=meta, rows=rows))
        with open(os.path.join(args.out, "peers.md"), "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
