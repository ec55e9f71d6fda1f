"""Whole-model GRPO step on a vision-language model: dualkv (each distinct image once through the vision tower, the
language model packed) against the unmodified model.

Model: ``Qwen2_5_VLForConditionalGeneration`` at the Qwen2.5-VL-7B shape (the full vision tower: 32 blocks, 1280
wide, windowed attention with 4 full blocks; the language model 3584 wide, 28/4 heads, ``--layers`` layers), random
weights, bf16, SDPA. Batch: ``--groups`` prompts x ``--rollouts`` responses; each prompt is ``--text`` tokens around
one image of ``--image`` x ``--image`` pixels (``--image / 14`` patches a side, a quarter of them as merged tokens),
responses of ``--response LO..HI`` tokens; rows right-padded, every row carrying its group's image again (as TRL and
veRL pass ``pixel_values``). The loss: the clipped GRPO token mean over the responses' next-token log-probs
(``model_remove_padding.clipped_token_mean``).

The tower's attention (both sides): ``--vision-attn varlen`` (one non-causal varlen call a block, as with
flash-attention 2; the default on CUDA) or ``sdpa`` (transformers' loop of one SDPA call a window and image).
Sides: ``plain`` the unmodified model under ``torch.compile`` (Inductor), chunked log-probs from the last hidden
state (no [B, S, V] logits kept), micro-batched in halves while out of memory (gradients accumulated, each part's
loss weighted by its share of response tokens: the same step); ``dualkv`` ``images_once(model)`` and the loss
through ``@policy_loss`` (``backbone_logits_loss``: its fused log-probs). Remove-padding is not a baseline here: transformers packs
Qwen2.5-VL's rows only with flash-attention 2 (not installed on the GPU machine). Per side: step ms (median of CUDA
events after warm-up), peak GB, loss, the vision tower's patches per step, packed calls; the vision tower's own
forward + backward time on all rows' images and on the distinct ones; the speedup, the FLOP ideal (below) and
their ratio. Writes ``model_vlm.{json,md}`` to ``--out``.

FLOP model (forward + backward = 3x forward; 2 per multiply-add): every linear layer on every token (patch) it
runs on, attention 4 * pairs * head_dim * heads per layer (causal pairs of the valid tokens; the tower's windowed
blocks ``(window / 14)**2`` keys a patch, its full blocks a whole image), the lm_head on every position.

    python benchmarks/model/model_vlm.py                       # --layers 4 --groups 2 --rollouts 8 --image 1036
    python benchmarks/model/model_vlm.py --device cpu --tiny --reps 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import dualkv_compile  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.model.model_gpu import log, time_step  # noqa: E402
from benchmarks.model.model_variants import accumulated  # noqa: E402
from benchmarks.model.model_remove_padding import chunked_next_token_logp, clipped_token_mean, next_token_logp  # noqa: E402
from benchmarks.ops import varlen_attention  # noqa: E402  (registers the vision tower's varlen attention)

IMAGE, START, END = 151655, 151652, 151653
SHAPES = {  # Qwen2.5-VL-7B-Instruct's config (language layers set by --layers); a tiny one for CPU
    "7b": dict(vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=3584,
                           fullatt_block_indexes=[7, 15, 23, 31], in_channels=3),
               text=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                         num_key_value_heads=4, rms_norm_eps=1e-6,
                         rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24]))),
    "tiny": dict(vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                             spatial_merge_size=2, temporal_patch_size=2, window_size=56, out_hidden_size=64,
                             fullatt_block_indexes=[1], in_channels=3),
                 text=dict(vocab_size=152064, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2,
                           rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[2, 3, 3]))),
}


def build_model(shape: str, layers: int, device: str, dtype, vision_attn: str = "sdpa"):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    s = SHAPES[shape]
    cfg = Qwen2_5_VLConfig(text_config=dict(s["text"], num_hidden_layers=layers), vision_config=s["vision"],
                           image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(cfg).to(dtype)
    model.config.vision_config._attn_implementation = vision_attn
    return model.train()


def make_batch(groups, rollouts, text, image, response, vcfg, device, dtype, seed=0):
    """Rows ``[text/2 | <start> image tokens <end> | text/2 | response]``, right-padded; one image per group."""
    g = torch.Generator().manual_seed(seed)
    side = image // vcfg["patch_size"]
    side -= side % vcfg["spatial_merge_size"]
    patches, merged = side * side, side * side // vcfg["spatial_merge_size"] ** 2
    dim = vcfg["in_channels"] * vcfg["temporal_patch_size"] * vcfg["patch_size"] ** 2
    rows, pix = [], []
    for _ in range(groups):
        img = torch.randn(patches, dim, generator=g)
        prompt = (torch.randint(10, 150000, (text // 2,), generator=g).tolist() + [START] + [IMAGE] * merged + [END]
                  + torch.randint(10, 150000, (text - text // 2,), generator=g).tolist())
        for _ in range(rollouts):
            n = int(torch.randint(response[0], response[1] + 1, (1,), generator=g))
            rows.append((prompt, torch.randint(10, 150000, (n,), generator=g).tolist()))
            pix.append(img)
    S = max(len(p) + len(r) for p, r in rows)
    B = len(rows)
    ids = torch.zeros(B, S, dtype=torch.long)
    mask, resp = torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        mask[i, : len(p) + len(r)] = 1
        resp[i, len(p): len(p) + len(r)] = 1
    adv = torch.randn(B, 1, generator=g).expand(B, S).contiguous()
    batch = dict(input_ids=ids, attention_mask=mask, response_mask=resp, advantages=adv,
                 old_logp=torch.full((B, S - 1), -11.9), mm_token_type_ids=(ids == IMAGE).long(),
                 pixel_values=torch.cat(pix).to(dtype), image_grid_thw=torch.tensor([[1, side, side]] * B))
    info = dict(rows=B, seq_len=S, patches_per_image=patches, image_tokens=merged, prompt_tokens=len(rows[0][0]),
                lengths=[(len(p), len(r)) for p, r in rows])
    return {k: v.to(device) for k, v in batch.items()}, info


def _model_inputs(batch):
    return {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")}


def plain_loss(model, batch):
    hidden = model.model(**_model_inputs(batch)).last_hidden_state
    B, S = batch["input_ids"].shape
    logp = chunked_next_token_logp(hidden.reshape(1, B * S, -1), model.lm_head, batch["input_ids"].reshape(1, -1))
    return clipped_token_mean(torch.nn.functional.pad(logp, (0, 1)).view(B, S)[:, :-1], batch)


def backbone_logits_loss(model, batch):
    """The backbone, then the lm_head and the log-probs in the loss: the model's forward breaks into graphs (the
    image merge), and called whole it hands [B, S, V] logits from one graph to the next; here the hidden states
    cross instead, and the lm_head, log-softmax and gather meet in one graph (dualkv fuses them)."""
    hidden = model.model(**_model_inputs(batch)).last_hidden_state
    return clipped_token_mean(next_token_logp(model.lm_head(hidden), batch["input_ids"]), batch)


def split(batch, n):
    """``n`` micro-batches of rows, each with its rows' images, weighted by its share of response tokens."""
    B = batch["input_ids"].shape[0]
    per = batch["image_grid_thw"].prod(-1).tolist()
    offsets = [0]
    for p in per:
        offsets.append(offsets[-1] + p)
    total = batch["response_mask"][:, 1:].sum().item()
    parts = []
    for rows in torch.arange(B).chunk(n):
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        part = {k: (v[lo:hi] if k not in ("pixel_values",) else v[offsets[lo]: offsets[hi]]) for k, v in batch.items()}
        parts.append((part, part["response_mask"][:, 1:].sum().item() / total))
    return parts


def flops(model, info, distinct_images) -> tuple[float, float]:
    """(FLOPs of the step on every row, on the distinct prefixes and images): the module docstring's model."""
    v, t = model.config.vision_config, model.config.text_config
    P = info["patches_per_image"]
    vis_lin = sum(p.numel() for n, p in model.model.visual.named_parameters() if p.dim() == 2)
    window = (v.window_size // v.patch_size) ** 2
    full = len(v.fullatt_block_indexes)
    vis_attn = 4 * v.hidden_size * P * (full * P + (v.depth - full) * min(window, P))
    per_image = 3 * (2 * vis_lin * P + vis_attn)
    lm_lin = sum(p.numel() for n, p in model.model.language_model.named_parameters()
                 if p.dim() == 2 and "embed" not in n)
    head = t.vocab_size * t.hidden_size
    hd = t.hidden_size // t.num_attention_heads
    prompt, B, S = info["prompt_tokens"], info["rows"], info["seq_len"]
    rows = [(p + r) for p, r in info["lengths"]]

    def lm(tokens, pairs, positions):
        return 3 * (2 * lm_lin * tokens + 4 * pairs * hd * t.num_attention_heads * t.num_hidden_layers
                    + 2 * head * positions)

    dup = per_image * B + lm(sum(rows), sum(n * (n + 1) / 2 for n in rows), B * S)
    resp = [r for _, r in info["lengths"]]
    packed_tokens = distinct_images * prompt + sum(resp)
    packed_pairs = distinct_images * prompt * (prompt + 1) / 2 + sum(r * prompt + r * (r + 1) / 2 for r in resp)
    return dup, per_image * distinct_images + lm(packed_tokens, packed_pairs, packed_tokens)


def tower_ms(model, batch, images, reps, device):
    """Forward + backward of the vision tower alone on the first ``images`` images of the batch (ms)."""
    P = int(batch["image_grid_thw"][0].prod())
    px, grid = batch["pixel_values"][: images * P], batch["image_grid_thw"][:images]

    def fn(m, _):
        return m.model.visual(px, grid_thw=grid).pooler_output.float().square().mean()

    ms, _, _ = time_step(fn, model, None, reps, device)
    return ms


def run_side(name, model, batch, args) -> dict:
    cuda = args.device == "cuda"
    row, n = dict(side=name, oom_at=[]), 1 if name == "dualkv" else args.micro_batches
    while True:
        torch._dynamo.reset()
        start, losses = len(dualkv_compile.reports()), []
        if name == "dualkv":
            counter = dualkv_compile.images_once(model, backend=args.compiler)  # the tower as everything else
            fn = dualkv_compile.policy_loss(backbone_logits_loss, inner=args.compiler)
        else:
            counter = None
            fn = torch.compile(plain_loss, dynamic=False, backend=args.compiler)
        parts = split(batch, n)
        step = accumulated(fn, parts, losses)

        log(f"{name}: {n} micro-batch(es): compile + warm-up + {args.reps} steps")
        try:
            before = (counter.patches if counter else 0)
            ms, peak, _ = time_step(step, model, None, args.reps, args.device)
            break
        except torch.OutOfMemoryError:
            row["oom_at"].append(n)
            log(f"{name}: out of memory in {n} micro-batch(es)")
        parts = losses = None
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.empty_cache()
        if name == "dualkv" or n >= batch["input_ids"].shape[0]:
            return dict(row, error="OOM")
        n *= 2
    steps = 2 + args.reps
    reports = dualkv_compile.reports()[start:]
    row.update(ms=ms, peak_gb=peak if cuda else None, loss=float(losses[-1]), micro_batches=n,
               tower_patches_per_step=((counter.patches - before) / steps if counter else
                                       int(batch["image_grid_thw"].prod(-1).sum())),
               packed_calls=sum(r.packed_calls for r in reports if r.rewritten) // steps if name == "dualkv" else 0)
    if name == "dualkv":
        row["explain"] = str(dualkv_compile.Explanation(reports, None))
        print(f"dualkv:\n{row['explain']}", flush=True)
    log(f"{name}: {ms:.1f} ms, peak {row['peak_gb']} GB, loss {row['loss']:.6f}")
    if cuda:
        torch.cuda.empty_cache()
    return row


def write(out, stamp, meta, rows, results):
    os.makedirs(out, exist_ok=True)
    harness.write_json(os.path.join(out, "model_vlm.json"), harness.record(stamp, meta=meta, rows=rows, results=results))
    lines = harness.markdown_stamp(stamp) + [
        f"Qwen2.5-VL-{meta['shape']} shape, {meta['layers']} language layers, full vision tower; {meta['groups']} groups "
        f"x {meta['rollouts']} rows, one {meta['image']}px image ({meta['patches_per_image']} patches, "
        f"{meta['image_tokens']} tokens) and {meta['text']} text tokens a prompt, responses {meta['response']}; the "
        f"tower's attention: {meta['vision_attn']} on both sides.", "",
        "| side | step ms | peak GB | loss | tower patches / step | packed calls | micro-batches |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        oom = f" (OOM at {r['oom_at']})" if r["oom_at"] else ""
        if "ms" not in r:
            lines.append(f"| {r['side']} | {r['error']}{oom} | | | | | |")
            continue
        gb = "-" if r["peak_gb"] is None else f"{r['peak_gb']:.1f}"
        lines.append(f"| {r['side']} | {r['ms']:.1f} | {gb} | {r['loss']:.6f} | {r['tower_patches_per_step']:.0f} | "
                     f"{r['packed_calls']} | {r['micro_batches']}{oom} |")
    lines += ["", f"Vision tower alone (forward + backward, eager): {results.get('tower_all_ms', float('nan')):.1f} ms on "
              f"every row's images (nan: out of memory), {results.get('tower_distinct_ms', float('nan')):.1f} ms on as "
              "many images as there are distinct ones."]
    if "speedup" in results:
        lines += [f"Speedup {results['speedup']:.2f}x; FLOP ideal {results['ideal']:.2f}x; speedup / ideal "
                  f"{results['of_ideal']:.2f}; losses differ by {results['loss_abs_diff']:.1e} (relative "
                  f"{results['loss_rel_diff']:.1e})."]
    with open(os.path.join(out, "model_vlm.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny shape (CPU smoke run)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--image", type=int, help="pixels a side (default 1036: 74 patches; tiny 112)")
    ap.add_argument("--text", type=int, help="text tokens a prompt (default 512; tiny 16)")
    ap.add_argument("--response", default=None, help="LO..HI tokens (default 300..1000; tiny 3..8)")
    ap.add_argument("--vision-attn", choices=["varlen", "sdpa"], default=None,
                    help="the tower's attention on both sides: varlen (one non-causal varlen call a block, "
                    "benchmarks/ops/varlen_attention.py; the default on CUDA) or sdpa (transformers' loop of one SDPA "
                    "call a window and image; the default on a CPU)")
    ap.add_argument("--micro-batches", type=int, default=1, help="the plain side's first micro-batch count")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager", "eager"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="default: benchmarks/results/model_vlm/<device>-<date>/")
    args = ap.parse_args(argv)
    stamp = harness.stamp("model_vlm", device=args.device, script=__file__, argv=argv)
    out = args.out or harness.result_dir(stamp)
    shape = "tiny" if args.tiny else "7b"
    image, text = args.image or (112 if args.tiny else 1036), args.text or (16 if args.tiny else 512)
    response = [int(x) for x in ((args.response or ("3..8" if args.tiny else "300..1000")).split("..") * 2)[:2]]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    vision_attn = args.vision_attn or ("varlen" if args.device == "cuda" else "sdpa")
    model = build_model(shape, args.layers, args.device, dtype,
                        varlen_attention.VISION_NAME if vision_attn == "varlen" else "sdpa")
    batch, info = make_batch(args.groups, args.rollouts, text, image, response, SHAPES[shape]["vision"], args.device, dtype)
    dup, packed = flops(model, info, args.groups)
    meta = dict(shape=shape, layers=args.layers, groups=args.groups, rollouts=args.rollouts, image=image, text=text,
                response=response, dtype=str(dtype), compiler=args.compiler, vision_attn=vision_attn,
                **{k: info[k] for k in ("rows", "seq_len", "patches_per_image", "image_tokens", "prompt_tokens")})
    results = dict(ideal=dup / packed, flops_plain=dup, flops_distinct=packed)
    log(f"{meta}; FLOP ideal {dup / packed:.2f}x")
    try:
        results["tower_all_ms"] = tower_ms(model, batch, info["rows"], args.reps, args.device)
    except torch.OutOfMemoryError:
        log("the vision tower alone on every row's images: out of memory")
        results["tower_all_ms"] = float("nan")
    model.zero_grad(set_to_none=True)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    results["tower_distinct_ms"] = tower_ms(model, batch, args.groups, args.reps, args.device)  # as many images
    rows = []
    for name in ("plain", "dualkv"):
        rows.append(run_side(name, model, batch, args))
        write(out, stamp, meta, rows, results)
    plain, dk = rows
    if "ms" in plain and "ms" in dk:
        results.update(speedup=plain["ms"] / dk["ms"], loss_abs_diff=abs(dk["loss"] - plain["loss"]),
                       loss_rel_diff=abs(dk["loss"] - plain["loss"]) / abs(plain["loss"]))
        results["of_ideal"] = results["speedup"] / results["ideal"]
        write(out, stamp, meta, rows, results)
    with open(os.path.join(out, "model_vlm.md")) as f:
        log(f.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
