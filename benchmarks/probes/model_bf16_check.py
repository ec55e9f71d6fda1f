"""bf16 accuracy of the rewritten model (issue 4): no worse than the original model in bf16.

    python benchmarks/probes/model_bf16_check.py [--layers 28] [--backends auto,triton,flex,reference] [--out DIR]
    python benchmarks/probes/model_bf16_check.py --device cpu --tiny          # smoke test

Requirement: for a tiny Qwen3 and a Qwen3-0.6B-shaped model (random weights;
hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim 128, MLP 3072, vocab
151936), the error of the dualkv-rewritten model in bf16 against a float32
run of the original model is at most 1.5x the error of the original model run
in bf16 on the duplicated batch.

Error is measured on the logits at valid (non-padding) positions, against
the fp32 original (eager, duplicated batch, TF32 off), two ways:
    max_rel   max |x - ref| / max |ref|          (max-norm relative)
    norm_rel  ||x - ref||_2 / ||ref||_2          (norm-wise relative)
The check passes when both ratios (dualkv error / bf16-original error) are <= 1.5.

The batch is one GRPO group, N responses to a P-token prompt, left padded by
16, with ragged responses (lengths over [R/4, R]) right padded, and
position_ids = cumsum(mask) - 1 as RL frameworks pass them. Forward only,
under torch.no_grad (the requirement is about logits).

Each attention backend is compiled and checked on its own
(``options={"attention_backend": b}``, inner Inductor unless ``--inner``);
a failure is caught, reported in the table and the JSON, and the script goes
on. "auto" is always run first; the others run when given in ``--backends``
(default: all four on the tiny model, less the one "auto" resolved to; for
the 0.6B model "auto", then the others only if auto fails, unless
``--all-backends``). Optional backends are skipped once ``--budget-s`` has
passed, so a run stays within ~4 minutes.
Writes ``model_bf16_check.json`` to ``--out`` (default ``$OUT``, else
``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import dualkv_compile  # noqa: E402
from benchmarks import harness  # noqa: E402

T0 = time.time()


def progress(msg: str) -> None:
    print(f"[bf16_check {time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


MODELS = {
    # name: hidden, layers, heads, kv heads, head_dim, intermediate, vocab
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=256, vocab_size=1024),
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936),
}


def build_model(shape: dict, seed=0, device="cpu"):
    import transformers

    cfg = transformers.Qwen3Config(**shape, max_position_embeddings=40960, use_cache=False, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):  # random init on the device: seconds instead of a minute for 0.6B on CPU
        model = transformers.Qwen3ForCausalLM(cfg)
    # HF's init has std 0.02 everywhere; that is fine for random-weight numerics.
    return model.eval(), cfg


def make_batch(N, P, R, vocab, left_pad=16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(R // 4, 1), R + 1, (N,), generator=g).tolist()
    lens[0] = R  # the longest response sets S
    S = left_pad + P + R
    ids = torch.zeros(N, S, dtype=torch.long)
    mask = torch.zeros(N, S, dtype=torch.long)
    prompt = torch.randint(1, vocab, (P,), generator=g)
    for b, r in enumerate(lens):
        ids[b, left_pad : left_pad + P] = prompt
        ids[b, left_pad + P : left_pad + P + r] = torch.randint(1, vocab, (r,), generator=g)
        mask[b, left_pad : left_pad + P + r] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), pos.to(device), lens


def errors(x: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (x.float() - ref).abs()
    return {
        "max_rel": (d.max() / ref.abs().max()).item(),
        "norm_rel": (d.norm() / ref.norm()).item(),
        "max_abs": d.max().item(),
    }


def forward(m, ids, mask, pos, use_pos):
    kw = {"position_ids": pos} if use_pos else {}
    return m(input_ids=ids, attention_mask=mask, **kw).logits


def check_model(name, shape, args, device) -> dict:
    progress(f"{name}: building {shape}")
    model32, cfg = build_model(shape, device=device)
    ids, mask, pos, lens = make_batch(args.N, args.P, args.R, cfg.vocab_size, device=device)
    valid = mask.bool()
    layout = dualkv_compile.detect(ids, mask, pos)
    stats = layout.stats()
    progress(f"{name}: batch {list(ids.shape)}, responses {lens}; {stats}")
    rec = {
        "model": name, "config": shape, "batch": {"N": args.N, "P": args.P, "R": args.R, "response_lens": lens,
                                                   "shape": list(ids.shape), "position_ids": args.position_ids},
        "layout": str(stats), "backends": {},
    }
    with torch.no_grad():
        ref = forward(model32, ids, mask, pos, args.position_ids)[valid].float()
        progress(f"{name}: fp32 reference done")
        model16 = copy.deepcopy(model32).to(torch.bfloat16)
        del model32
        base = errors(forward(model16, ids, mask, pos, args.position_ids)[valid], ref)
        rec["bf16_original"] = base
        progress(f"{name}: bf16 original: {base}")

        backends = args.backends
        for backend in backends:
            if backend != "auto" and not args.all_backends and not args.explicit_backends:
                auto = rec["backends"].get("auto", {})
                if auto.get("ok"):
                    continue
            auto = rec["backends"].get("auto", {})
            if backend != "auto" and auto.get("ok") and auto.get("resolved") == backend:
                rec["backends"][backend] = {"ok": False, "skipped": True, "error": "skipped: the same kernel as auto"}
                continue
            if backend != "auto" and time.time() - T0 > args.budget_s:
                rec["backends"][backend] = {"ok": False, "skipped": True, "error": f"skipped: past --budget-s {args.budget_s}"}
                progress(f"{name}: backend {backend} skipped (time budget)")
                continue
            r = {"ok": False}
            rec["backends"][backend] = r
            t0 = time.time()
            try:
                from dualkv_compile.ops.attention import resolve_backend

                probe = torch.empty(1, cfg.num_attention_heads, 1, cfg.head_dim, dtype=torch.bfloat16, device=device)
                r["resolved"] = resolve_backend(backend, probe)
                torch._dynamo.reset()
                start = len(dualkv_compile.reports())
                compiled = torch.compile(
                    model16, backend="dualkv", options={"attention_backend": backend, "inner": args.inner}
                )
                out = forward(compiled, ids, mask, pos, args.position_ids)
                reps = dualkv_compile.reports()[start:]
                r["graphs"] = [str(x) for x in reps]
                r["packed_calls"] = sum(x.packed_calls for x in reps if x.rewritten)
                if not r["packed_calls"]:
                    raise RuntimeError("the model did not run packed: " + " | ".join(r["graphs"]))
                e = errors(out[valid], ref)
                del out
                r.update(e)
                r["ratio_max_rel"] = e["max_rel"] / max(base["max_rel"], 1e-30)
                r["ratio_norm_rel"] = e["norm_rel"] / max(base["norm_rel"], 1e-30)
                r["pass"] = r["ratio_max_rel"] <= 1.5 and r["ratio_norm_rel"] <= 1.5
                r["ok"] = True
            except Exception as ex:  # report per backend, go on
                r["error"] = f"{type(ex).__name__}: {str(ex).splitlines()[0][:500] if str(ex) else ''}"
                r["traceback"] = traceback.format_exc()[-3000:]
            r["seconds"] = round(time.time() - t0, 1)
            progress(f"{name}: backend {backend}: " + (
                f"max_rel {r['max_rel']:.3e} (x{r['ratio_max_rel']:.2f}), norm_rel {r['norm_rel']:.3e} "
                f"(x{r['ratio_norm_rel']:.2f}) {'PASS' if r['pass'] else 'FAIL'}" if r["ok"] else f"ERROR {r['error']}"
            ) + f" [{r['seconds']} s]")
        del model16
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny model only, small batch (CPU smoke test)")
    ap.add_argument("--layers", type=int, default=28, help="layers of the 0.6B-shaped model")
    ap.add_argument("--N", type=int, default=8)
    ap.add_argument("--P", type=int, default=512)
    ap.add_argument("--R", type=int, default=128)
    ap.add_argument("--backends", default=None, help="comma list; default auto,triton,flex,reference")
    ap.add_argument("--all-backends", action="store_true", help="run every backend on the 0.6B model too")
    ap.add_argument("--budget-s", type=float, default=180, help="start no optional backend after this many seconds")
    ap.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager", "eager"])
    ap.add_argument("--no-position-ids", dest="position_ids", action="store_false")
    ap.add_argument("--out", default=os.environ.get("OUT"),
                    help="default: benchmarks/results/model_bf16_check/<device>-<date>/ (benchmarks/harness.py)")
    args = ap.parse_args()
    logging.getLogger("dualkv_compile").setLevel(logging.WARNING)
    args.explicit_backends = args.backends is not None
    args.backends = (args.backends or "auto,triton,flex,reference").split(",")
    if "auto" in args.backends:
        args.backends.remove("auto")
    args.backends.insert(0, "auto")
    if args.tiny and "--N" not in sys.argv:
        args.N, args.P, args.R = 4, 64, 32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    device = torch.device(args.device)

    stamp = harness.stamp("model_bf16_check", device=device, script=__file__)
    args.out = args.out or harness.result_dir(stamp)
    versions = stamp["versions"]
    env = {
        "date": stamp["date"], "device": stamp["device"], "torch": versions["torch"],
        "transformers": versions["transformers"], "triton": versions["triton"], "cuda": versions["cuda"],
        "inner": args.inner,
    }
    progress(f"env {env}")
    results = []
    shapes = [("tiny", dict(MODELS["tiny"]), True)]
    if not args.tiny:
        big = dict(MODELS["qwen3-0.6b"], num_hidden_layers=args.layers)
        shapes.append((f"qwen3-0.6b-shape ({args.layers} layers)", big, False))
    for name, shape, all_backends in shapes:
        saved = args.all_backends
        args.all_backends = saved or all_backends
        try:
            results.append(check_model(name, shape, args, device))
        except Exception as ex:
            results.append({"model": name, "error": f"{type(ex).__name__}: {ex}", "traceback": traceback.format_exc()[-3000:]})
            progress(f"{name}: FAILED before the backends: {ex}")
        args.all_backends = saved
        if device.type == "cuda":
            torch.cuda.empty_cache()

    lines = [f"device {env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}, inner {args.inner}",
             "",
             f"{'model':34} {'run':22} {'max_rel':>10} {'norm_rel':>10} {'x max':>7} {'x norm':>7}  result"]
    for rec in results:
        if "error" in rec:
            lines.append(f"{rec['model']:34} ERROR {rec['error']}")
            continue
        b = rec["bf16_original"]
        lines.append(f"{rec['model']:34} {'bf16 original (dup)':22} {b['max_rel']:10.3e} {b['norm_rel']:10.3e} {'1.00':>7} {'1.00':>7}  baseline")
        for backend, r in rec["backends"].items():
            label = f"dualkv {backend}" + (f"->{r['resolved']}" if r.get("resolved") and r["resolved"] != backend else "")
            if r["ok"]:
                lines.append(f"{'':34} {label:22} {r['max_rel']:10.3e} {r['norm_rel']:10.3e} {r['ratio_max_rel']:7.2f} "
                             f"{r['ratio_norm_rel']:7.2f}  {'PASS' if r['pass'] else 'FAIL'} ({r['seconds']} s)")
            elif r.get("skipped"):
                lines.append(f"{'':34} {label:22} {r['error']}")
            else:
                lines.append(f"{'':34} {label:22} ERROR {r['error']}")
    table = "\n".join(lines)
    print(table)
    path = harness.write_json(os.path.join(args.out, "model_bf16_check.json"),
                              harness.record(stamp, meta=env, rows=results, results={"table": table}))
    progress(f"wrote {path}")


if __name__ == "__main__":
    main()
