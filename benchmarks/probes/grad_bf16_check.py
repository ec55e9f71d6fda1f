"""bf16 accuracy of dualkv's *gradients*: no worse than the original model's, both against float32 truth.

    python benchmarks/probes/grad_bf16_check.py --device cpu                          # 28 narrow layers, a few minutes
    python benchmarks/probes/grad_bf16_check.py --device cuda --shape qwen3-0.6b      # the GPU form

A bf16 run of a deep model differs from a float32 run by rounding, so a bf16 gradient difference between
dualkv and the plain model (the veRL and FSDP2 GPU runs read 5e-2 to 9e-2 on one small parameter at 28
layers) says nothing by itself. This measures what does: each side's error against a float32 run of the
original model, per parameter (``||g - g32|| / ||g32||``), and their ratio. dualkv passes when the error
of all gradients together is at most 1.5x the original model's bf16 error (the forward criterion of
``model_bf16_check.py``, applied to the backward); the worst per-parameter ratio is reported beside it.

Precision (``--precision``): ``autocast`` keeps float32 parameters and runs under
``torch.autocast(bfloat16)`` (veRL's ``forward_step``); ``bf16`` casts the model to bfloat16 (what FSDP2's
``param_dtype=bf16`` computes with). Loss: a GRPO-style token loss, mean over response tokens of
``-advantage * log p(token)``, fixed advantages. Batch: one group of ``--N`` responses (ragged lengths,
left padding, position ids) to a ``--P``-token prompt, as in ``model_bf16_check.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import time

import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import dualkv_compile  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.probes.model_bf16_check import MODELS, build_model, make_batch  # noqa: E402

T0 = time.time()
SHAPES = {
    **MODELS,
    # the depth of the GPU runs at a width a CPU runs in minutes
    "deep-narrow": dict(hidden_size=128, num_hidden_layers=28, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, intermediate_size=384, vocab_size=2048),
}


def progress(msg: str) -> None:
    print(f"[grad_bf16 {time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def grpo_loss(logits, ids, mask, P, left_pad, adv):
    """Mean over response tokens of ``-adv[row] * log p(next token)``, float32 log-softmax."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    response = mask[:, 1:].bool().clone()
    response[:, : left_pad + P - 1] = False  # predictions of response tokens only
    return -(logp * adv[:, None] * response).sum() / response.sum()


def grads_of(model, run, batch, P, left_pad, adv, ctx):
    ids, mask, pos = batch
    model.zero_grad(set_to_none=True)
    with ctx():
        logits = run(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        loss = grpo_loss(logits, ids, mask, P, left_pad, adv)
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(g: torch.Tensor, ref: torch.Tensor) -> float:
    return ((g - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="deep-narrow", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    ap.add_argument("--precision", default="autocast", choices=["autocast", "bf16"])
    ap.add_argument("--N", type=int, default=8)
    ap.add_argument("--P", type=int, default=256)
    ap.add_argument("--R", type=int, default=64)
    ap.add_argument("--inner", default=None, help="dualkv's inner compiler (default: inductor on cuda, aot_eager on cpu)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    shape = dict(SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {}))
    left_pad = 16
    model32, cfg = build_model(shape, device=dev)
    model32.train()
    ids, mask, pos, lens = make_batch(args.N, args.P, args.R, cfg.vocab_size, left_pad=left_pad, device=dev)
    adv = torch.linspace(-1, 1, args.N, device=dev)
    batch = (ids, mask, pos)
    progress(f"{args.shape} {shape}, batch {list(ids.shape)}, responses {lens}, precision {args.precision}")

    loss32, truth = grads_of(model32, model32, batch, args.P, left_pad, adv, contextlib.nullcontext)
    progress(f"float32 original: loss {loss32:.6f}")
    if args.precision == "bf16":
        model = copy.deepcopy(model32).to(torch.bfloat16)
        ctx = contextlib.nullcontext
    else:
        model = copy.deepcopy(model32)
        ctx = lambda: torch.autocast(dev.type, dtype=torch.bfloat16)  # noqa: E731
    del model32
    loss_plain, plain = grads_of(model, model, batch, args.P, left_pad, adv, ctx)
    progress(f"bf16 original: loss {loss_plain:.6f}")
    inner = args.inner or ("inductor" if dev.type == "cuda" else "aot_eager")
    start = len(dualkv_compile.reports())
    compiled = torch.compile(model, backend="dualkv", options={"inner": inner})
    loss_dkv, dkv = grads_of(model, compiled, batch, args.P, left_pad, adv, ctx)
    reps = dualkv_compile.reports()[start:]
    packed = sum(r.packed_calls for r in reps if r.rewritten)
    progress(f"bf16 dualkv: loss {loss_dkv:.6f}, packed calls {packed}")

    names = sorted(truth)
    flat = lambda d: torch.cat([d[n].reshape(-1) for n in names])  # noqa: E731
    total_plain, total_dkv = rel(flat(plain), flat(truth)), rel(flat(dkv), flat(truth))
    per = {n: (rel(plain[n], truth[n]), rel(dkv[n], truth[n])) for n in names}
    ratios = {n: d / max(p, 1e-30) for n, (p, d) in per.items()}
    worst = max(ratios, key=ratios.get)
    worst_dkv = max(per, key=lambda n: per[n][1])
    worst_plain = max(per, key=lambda n: per[n][0])
    over = sum(r > 1.5 for r in ratios.values())
    stamp = harness.stamp("grad_bf16_check", device=dev, script=__file__, argv=argv)
    meta = {"date": stamp["date"], "torch": stamp["versions"]["torch"], "device": args.device,
            "gpu": stamp["device"] if dev.type == "cuda" else None, "shape": args.shape, "config": shape,
            "precision": args.precision, "inner": inner, "batch": {"N": args.N, "P": args.P, "R": args.R, "lens": lens}}
    result = {
        "packed_calls": packed, "loss": {"float32": loss32, "plain_bf16": loss_plain, "dualkv_bf16": loss_dkv},
        "all_grads_rel": {"plain": total_plain, "dualkv": total_dkv, "ratio": total_dkv / max(total_plain, 1e-30)},
        "worst_ratio": {"param": worst, "plain": per[worst][0], "dualkv": per[worst][1], "ratio": ratios[worst]},
        "largest_dualkv_error": {"param": worst_dkv, "plain": per[worst_dkv][0], "dualkv": per[worst_dkv][1]},
        "largest_plain_error": {"param": worst_plain, "plain": per[worst_plain][0], "dualkv": per[worst_plain][1]},
        "params_over_1.5x": f"{over} of {len(names)}",
        "pass": packed > 0 and total_dkv <= 1.5 * total_plain,
    }
    text = (f"all gradients vs float32: plain bf16 {total_plain:.3e}, dualkv bf16 {total_dkv:.3e} "
            f"(x{result['all_grads_rel']['ratio']:.2f}); largest dualkv error {per[worst_dkv][1]:.3e} on {worst_dkv} "
            f"(plain {per[worst_dkv][0]:.3e}); largest plain error {per[worst_plain][0]:.3e} on {worst_plain} "
            f"(dualkv {per[worst_plain][1]:.3e}); worst ratio x{ratios[worst]:.2f} on {worst}; "
            f"{over} of {len(names)} parameters over 1.5x; packed calls {packed}: {'PASS' if result['pass'] else 'FAIL'}")
    print(text, flush=True)
    if args.out:
        harness.write_json(os.path.join(args.out, f"grad_bf16_check_{args.shape}_{args.precision}.json"),
                           harness.record(stamp, meta=meta, results=result), indent=2)
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
