"""Whole-model GRPO step on this year's attention variants, dualkv against the strongest baseline that runs:
gpt-oss (learnable sinks, a 128-token sliding window on alternate layers), DeepSeek-V2-Lite (multi-head latent
attention: q/k head dim 192, v head dim 128) and the dense Qwen3.5 hybrid (three gated delta rule layers to each
full-attention one; flash-linear-attention's kernels on both sides).

Models: ``GptOssForCausalLM`` / ``DeepseekV2ForCausalLM`` from the released configs (random weights, bf16),
``--layers`` layers, transformers' default experts (``grouped_mm``). Batch: ``--groups`` prompts (lengths uniform in
``--prompt LO..HI``, per group) x ``--rollouts`` responses (``--response LO..HI``), shuffled, as veRL's
remove-padding row (``model_remove_padding.make_batch``'s keys) or padded (prompts left, responses right); each side
in the layout where it runs best (``WHY``, repeated in the output). The loss: ``clipped_token_mean``, old log-probs at
-log(vocab); baselines with chunked log-probs under ``torch.compile``, dualkv through ``@policy_loss`` on full logits.

A baseline out of memory is recorded and run again in twice the micro-batches (gradients accumulated, each loss
weighted by its share of response tokens: the same loss and gradients). Per side: step ms (median of CUDA events
after warm-up, ``model_gpu.time_step``), peak GB, loss, packed calls; the speedup against the fastest baseline that
ran, the FLOP-ideal speedup (``model_gpu``'s model over the active experts; a sliding layer's pairs bounded by its
window) and their ratio; dualkv's report (``explain()``'s summary, attention backends included) to stdout. Writes
``model_variants.{json,md}`` to ``--out``, merging this model into the file's others.

    python benchmarks/model/model_variants.py --model gpt-oss-20b          # --layers 4 --groups 2 --rollouts 8
    python benchmarks/model/model_variants.py --model deepseek-v2-lite
    python benchmarks/model/model_variants.py --model qwen3.5 --layers 8  # the varlen baseline where fla trains
    python benchmarks/model/model_variants.py --device cpu --model tiny-gpt-oss --layers 2 --rollouts 3 --compiler none
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import dualkv_compile  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.ops import varlen_attention, varlen_recurrent  # noqa: E402  (registers torch_varlen)
from benchmarks.model.model_gpu import log, time_step  # noqa: E402
from benchmarks.model.model_remove_padding import (chunked_next_token_logp, clipped_token_mean, next_token_logp,  # noqa: E402
                                  remove_padding_loss, varlen_loss)
from benchmarks.ops.window_attention import packed_pairs, window_pairs  # noqa: E402

_YARN = dict(rope_type="yarn", beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096)
_GPT_OSS = dict(max_position_embeddings=131072, rope_parameters=dict(_YARN, rope_theta=150000.0, factor=32.0,
                                                                         truncate=False))
_DEEPSEEK = dict(q_lora_rank=None, first_k_dense_replace=1, topk_method="greedy", norm_topk_prob=False,
                 routed_scaling_factor=1.0, max_position_embeddings=163840,
                 rope_parameters=dict(_YARN, rope_theta=10000.0, factor=40.0, mscale=0.707, mscale_all_dim=0.707))
# The released configs (openai/gpt-oss-20b, deepseek-ai/DeepSeek-V2-Lite) but for the layer count; tiny ones for CPU.
# gpt-oss's layer_types default is the released one: sliding on even layers, full on odd ones.
MODELS = {
    "gpt-oss-20b": ("gpt_oss", dict(_GPT_OSS, hidden_size=2880, num_attention_heads=64, num_key_value_heads=8,
                    head_dim=64, sliding_window=128, num_local_experts=32, num_experts_per_tok=4,
                    intermediate_size=2880, vocab_size=201088)),
    "tiny-gpt-oss": ("gpt_oss", dict(_GPT_OSS, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                     vocab_size=512)),
    "deepseek-v2-lite": ("deepseek_v2", dict(_DEEPSEEK, hidden_size=2048, num_attention_heads=16,
                         num_key_value_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                         v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
                         moe_intermediate_size=1408, intermediate_size=10944, vocab_size=102400)),
    "tiny-deepseek-v2": ("deepseek_v2", dict(_DEEPSEEK, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                         kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                         num_experts_per_tok=2, n_shared_experts=2, moe_intermediate_size=32, intermediate_size=128,
                         vocab_size=512)),
    # transformers' default Qwen3_5TextConfig (the dense Qwen3.5 shape: hidden 4096, 16 query / 4 kv heads of 256
    # on the full layers, GDN with 16 key / 32 value heads of 128), three GDN layers to each full one.
    "qwen3.5": ("qwen3_5_text", dict()),
    "tiny-qwen3.5": ("qwen3_5_text", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=512)),
}
WHY = {
    "gpt_oss": "transformers offers gpt-oss eager attention (sinks in the softmax, [B, H, S, S] scores), "
    "flex_attention (sinks by renormalising with the LSE; CUDA only: on CPU it raises) and Hub flash kernels with "
    "sinks (vllm-flash-attn3, FA4: not installed on these machines); no sdpa (_supports_sdpa = False). The strongest "
    "that runs: flex on the remove-padding row (no padding; blocks outside a sequence or the window skipped). "
    "GptOssModel builds its masks without position_ids, so transformers' own masks on a row let the sequences attend "
    "to each other: the BlockMasks come from cu_seqlens, built before timing. On CPU only eager runs (the padded "
    "batch). dualkv runs the padded batch: on the row its mask check refuses the graph for that reason (the masks do "
    "not separate the sequences) and the original program would run.",
    "deepseek_v2": "The strongest: remove padding through torch's varlen flash attention (varlen_attention.py, in "
    "FlashAttention-2's place), V zero-padded 128 -> 192 and the output cropped, as transformers' flash_attention_2 "
    "path does for MLA (torch_varlen alone assumes one head dim: on CPU it fails on MLA). SDPA runs the padded batch "
    "with its padding mask (the memory-efficient kernel, the padding computed: --baselines sdpa) or a [T, T] "
    "block-diagonal mask on the row. dualkv runs the row (SDPA in the traced model).",
}
WHY["qwen3_5_text"] = (
    "The strongest for a hybrid: remove padding with the sequences kept apart in every layer, the full-attention "
    "layers through torch's varlen flash attention and the GDN layers through flash-linear-attention's varlen chunked "
    "kernel (cu_seq_lens passed to the model, as veRL's and TRL's flattening paths do: transformers hands them to "
    "fla as cu_seqlens). Where fla does not train (not installed, or fla 0.6 refusing its GDN backward on Hopper with "
    "Triton < 3.7.1), the GDN layers and their short convolutions run dualkv's own torch kernels on the flat forest, "
    "each sequence a root (benchmarks/ops/varlen_recurrent.py): the kernels dualkv's packed run uses there, so the "
    "ratio is the sharing's. dualkv runs the padded batch (a row without cu_seq_lens would join the sequences in the "
    "GDN layers, which the original program does too), its GDN layers through fla a launch per forest level where "
    "fla is the layer's kernel, else through its torch forest reference.")
MLA_VARLEN = "torch_varlen_mla"


def _varlen_mla(module, query, key, value, attention_mask, **kwargs):
    """``torch_varlen`` with V zero-padded to the q/k head dim and the output cropped back (transformers'
    flash_attention_2 path where they differ: MLA); V's zero columns give zero output columns, exactly."""
    D, Dv = query.shape[-1], value.shape[-1]
    out, _ = varlen_attention.torch_varlen_attention(
        module, query, key, torch.nn.functional.pad(value, (0, D - Dv)), attention_mask, **kwargs)
    return out[..., :Dv], None


def _fla_trains(cuda: bool) -> bool:
    """Whether flash-linear-attention's GDN trains here: installed, on CUDA, and not refusing its backward (fla 0.6
    raises on Hopper with Triton >= 3.4, < 3.7.1: wrong gated gradients there, its issue #640)."""
    if not cuda:
        return False
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return False
    x = [torch.randn(1, 64, 1, 64, device="cuda", requires_grad=True) for _ in range(3)]
    g, beta = torch.zeros(1, 64, 1, device="cuda", requires_grad=True), torch.ones(1, 64, 1, device="cuda")
    try:
        chunk_gated_delta_rule(*x, g, beta)[0].sum().backward()
    except RuntimeError as e:
        log(f"flash-linear-attention does not train here: {str(e)[:200]}")
        return False
    return True


def build_model(name: str, layers: int, device: str, dtype):
    import transformers
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    transformers.AttentionInterface.register(MLA_VARLEN, _varlen_mla)
    ALL_MASK_ATTENTION_FUNCTIONS.register(MLA_VARLEN, flash_attention_mask)
    family, fields = MODELS[name]
    prefix = {"gpt_oss": "GptOss", "deepseek_v2": "DeepseekV2", "qwen3_5_text": "Qwen3_5"}[family]
    config_class = "Qwen3_5TextConfig" if family == "qwen3_5_text" else f"{prefix}Config"
    config = getattr(transformers, config_class)(**fields, num_hidden_layers=layers, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    return model.to(dtype).train()


def sequences(groups, rollouts, prompt, response, vocab, seed=0):
    """``[(group, prompt ids, response ids, advantage)]``, shuffled; lengths uniform in ``(lo, hi)``."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))  # noqa: E731
    seqs = []
    for k in range(groups):
        p, adv = torch.randint(2, vocab, (draw(*prompt),), generator=g), float(torch.randn((), generator=g))
        seqs += [(k, p, torch.randint(2, vocab, (draw(*response),), generator=g), adv) for _ in range(rollouts)]
    return [seqs[i] for i in torch.randperm(len(seqs), generator=g).tolist()]


def row_batch(seqs, device, length=None, old_logp=-11.9):
    """veRL's remove-padding row (``make_batch``'s keys), to ``length`` tokens by a filler (no response tokens)."""
    parts = [(torch.cat([p, r]), len(p), a) for _, p, r, a in seqs]
    T = sum(len(ids) for ids, _, _ in parts)
    if length is not None and length > T:
        parts.append((torch.ones(length - T, dtype=torch.long), length - T, 0.0))
    lens = torch.tensor([len(ids) for ids, _, _ in parts])
    batch = {
        "input_ids": torch.cat([ids for ids, _, _ in parts])[None],
        "position_ids": torch.cat([torch.arange(len(ids)) for ids, _, _ in parts])[None],
        "response_mask": torch.cat([(torch.arange(len(ids)) >= P).float() for ids, P, _ in parts])[None],
        "advantages": torch.cat([torch.full((len(ids),), a) for ids, _, a in parts])[None],
        "old_logp": torch.full((1, int(lens.sum()) - 1), old_logp),
        "cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32),
    }
    return {**{k: v.to(device) for k, v in batch.items()}, "max_len": int(lens.max())}


def padded_batch(seqs, device, width=None, old_logp=-11.9):
    """Rows ``[left-padded prompt | right-padded response]``; ``width``: (prompt, response) columns."""
    P, R = width or (max(len(p) for _, p, _, _ in seqs), max(len(r) for _, _, r, _ in seqs))
    ids, mask = torch.zeros(len(seqs), P + R, dtype=torch.long), torch.zeros(len(seqs), P + R, dtype=torch.long)
    resp, adv = torch.zeros(len(seqs), P + R), torch.zeros(len(seqs), P + R)
    for b, (_, p, r, a) in enumerate(seqs):
        ids[b, P - len(p):P + len(r)] = torch.cat([p, r])
        mask[b, P - len(p):P + len(r)] = 1
        resp[b, P:P + len(r)] = 1
        adv[b] = a
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
             "response_mask": resp, "advantages": adv, "old_logp": torch.full((len(seqs), P + R - 1), old_logp)}
    return {k: v.to(device) for k, v in batch.items()}


def flex_masks(batch, window):
    """gpt-oss's masks on the row as BlockMasks: each sequence (its document id from ``cu_seqlens``) causal within
    itself, on the sliding layers within the window too (``kv > q - window``, transformers' rule)."""
    from torch.nn.attention.flex_attention import create_block_mask

    cu, T = batch["cu_seqlens"].long(), batch["input_ids"].shape[1]
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device), cu[1:] - cu[:-1])
    causal = lambda b, h, q, kv: (doc[q] == doc[kv]) & (kv <= q)  # noqa: E731
    sliding = lambda b, h, q, kv: causal(b, h, q, kv) & (q - kv < window)  # noqa: E731
    make = lambda mod: create_block_mask(mod, None, None, T, T, device=cu.device, _compile=True)  # noqa: E731
    return {"full_attention": make(causal), "sliding_attention": make(sliding)}


def flex_loss(model, batch):
    """FlexAttention on the row, ``flex_masks``' BlockMasks as the model's mask mapping; chunked log-probs."""
    hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                         attention_mask=batch["flex_masks"]).last_hidden_state
    return clipped_token_mean(chunked_next_token_logp(hidden, model.lm_head, batch["input_ids"]), batch)


def padded_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits
    return clipped_token_mean(next_token_logp(logits, batch["input_ids"]), batch)


def padded_chunked_loss(model, batch):
    """``padded_loss``, the log-probs in chunks over the flattened rows (a row's last one, dropped, reads the next)."""
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         position_ids=batch["position_ids"]).last_hidden_state
    B, S = batch["input_ids"].shape
    logp = chunked_next_token_logp(hidden.reshape(1, B * S, -1), model.lm_head, batch["input_ids"].reshape(1, -1))
    return clipped_token_mean(torch.nn.functional.pad(logp, (0, 1)).view(B, S)[:, :-1], batch)


SIDES = {  # name: (layout, attn_implementation, loss, what it is); a model's baselines, then dualkv
    "gpt_oss": {
        "flex": ("row", "flex_attention", flex_loss, "remove padding, FlexAttention with sinks, BlockMasks from "
                 "cu_seqlens (document, causal, window), chunked log-probs"),
        "eager": ("padded", "eager", padded_chunked_loss, "padded batch, eager attention with sinks, chunked "
                  "log-probs"),
        "dualkv": ("padded", "eager", padded_loss, "dualkv (@policy_loss), padded batch, eager attention traced"),
    },
    "qwen3_5_text": {
        "varlen": ("row", "torch_varlen", varlen_loss, "remove padding, cu_seq_lens to every layer: varlen flash "
                   "attention, fla's varlen GDN; chunked log-probs"),
        "sdpa": ("padded", "sdpa", padded_chunked_loss, "padded batch, SDPA with the padding mask, the GDN layers' "
                 "kernel (fla's, else the torch chunked form: dualkv's opaque op, which importing dualkv substitutes "
                 "for transformers' fallback under torch.compile), chunked log-probs"),
        "dualkv": ("padded", "sdpa", padded_loss, "dualkv (@policy_loss), padded batch, SDPA traced, the GDN layers' "
                   "kernel on the forest (explain() names it)"),
    },
    "deepseek_v2": {
        "varlen": ("row", MLA_VARLEN, varlen_loss, "remove padding, varlen flash attention (V zero-padded 128 -> 192), "
                   "chunked log-probs"),
        "sdpa": ("padded", "sdpa", padded_chunked_loss, "padded batch, SDPA with the padding mask, chunked log-probs"),
        "dualkv": ("row", "sdpa", remove_padding_loss, "dualkv (@policy_loss), remove-padding row, SDPA traced"),
    },
}


VARLEN_TORCH_GDN = ("remove padding, cu_seq_lens to every layer: varlen flash attention; the GDN layers and their "
                    "short convolutions restart at each sequence through dualkv's forest ops on the flat forest "
                    "(varlen_recurrent.py: the torch kernels dualkv runs here, flash-linear-attention not training "
                    "here); chunked log-probs")


def micro_batches(seqs, layout, n, device, window, old_logp):
    """``n`` parts of ``seqs`` as ``[(batch, weight)]``: balanced by tokens, of one shape (the row: a filler; padded:
    the whole batch's width), each weighted by its share of response tokens; ``window``: with ``flex_masks``."""
    size = lambda q: sum(len(x[1]) + len(x[2]) for x in q)  # noqa: E731
    parts = [[] for _ in range(n)]
    for s in sorted(seqs, key=lambda s: -len(s[1]) - len(s[2])):
        min(parts, key=size).append(s)
    total, longest = sum(len(r) for _, _, r, _ in seqs), max(size(q) for q in parts)
    width = (max(len(p) for _, p, _, _ in seqs), max(len(r) for _, _, r, _ in seqs))
    out = []
    for q in parts:
        b = row_batch(q, device, longest, old_logp) if layout == "row" else padded_batch(q, device, width, old_logp)
        if window is not None:
            b["flex_masks"] = flex_masks(b, window)
        out.append((b, sum(len(x[2]) for x in q) / total))
    return out


def accumulated(fn, parts, losses):
    """One step over ``parts`` for ``time_step``: each part's forward and backward (gradients accumulate), the
    step's loss appended to ``losses``; returns a zero in which ``time_step``'s backward finds nothing more."""
    def step(model, _batch):
        total = 0.0
        for part, weight in parts:
            loss = fn(model, part) * weight
            loss.backward()
            total = total + loss.detach()
        losses.append(total)
        return torch.zeros((), device=parts[0][0]["input_ids"].device, requires_grad=True)
    return step


def flop_model(name: str, layers: int, seqs) -> tuple[float, float]:
    """fwd+bwd FLOPs of every sequence's valid tokens and of the packed forest: matmuls 6x the active weights (router,
    top-k and shared experts), attention 3.5x q.k and p.v over each layer's pairs, a sliding layer's in its window."""
    family, c = MODELS[name]
    if family == "qwen3_5_text":  # the config's defaults where the entry keeps them
        from transformers import Qwen3_5TextConfig
        c = dict(Qwen3_5TextConfig().to_dict(), **c)
    h, H = c["hidden_size"], c["num_attention_heads"]
    if family == "qwen3_5_text":
        d, kv, I = c["head_dim"], c["num_key_value_heads"], c["intermediate_size"]
        hk, hv, dk, dv = (c[f"linear_{x}"] for x in ("num_key_heads", "num_value_heads", "key_head_dim",
                                                       "value_head_dim"))
        # full layers: q and its output gate, k, v, o; pairs q.k and p.v. GDN layers: q, k, v, z, b, a in, out;
        # the recurrence as 3 dk x dv products per value head and token (the state's update, its read-out, k^T S).
        attn, pair = 2 * h * H * d + 2 * h * kv * d + H * d * h, 4 * d * H
        gdn = h * (2 * hk * dk + 2 * hv * dv + 2 * hv) + hv * dv * h + 3 * hv * dk * dv
        full = [(i + 1) % 4 == 0 for i in range(layers)]
        layer = [((attn if f else gdn) + 3 * h * I, None if f else 0) for f in full]
    elif family == "gpt_oss":
        d, kv, E, I = c["head_dim"], c["num_key_value_heads"], c["num_local_experts"], c["intermediate_size"]
        attn, pair = 2 * h * H * d + 2 * h * kv * d, 4 * d * H
        mlp = h * E + c["num_experts_per_tok"] * 3 * h * I
        layer = [(attn + mlp, c["sliding_window"] if i % 2 == 0 else None) for i in range(layers)]
    else:
        nope, rope, dv, r = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        attn = h * H * (nope + rope) + h * (r + rope) + r * H * (nope + dv) + H * dv * h
        pair = 2 * (nope + rope + dv) * H
        experts = c["num_experts_per_tok"] + c["n_shared_experts"]
        moe = h * c["n_routed_experts"] + 3 * h * c["moe_intermediate_size"] * experts
        layer = [(attn + (3 * h * c["intermediate_size"] if i < c["first_k_dense_replace"] else moe), None)
                 for i in range(layers)]
    per_token = sum(m for m, _ in layer) + h * c["vocab_size"]
    groups = {}
    for g, p, r, _ in seqs:
        groups.setdefault(g, (len(p), []))[1].append(len(r))
    dup = 6 * per_token * sum(P + R for P, Rs in groups.values() for R in Rs)
    packed = 6 * per_token * sum(P + sum(Rs) for P, Rs in groups.values())
    for _, w in layer:
        if w == 0:  # a recurrent layer: no pairs
            continue
        w = w or 1 << 62
        dup += 3.5 * pair * sum(window_pairs(P + R, w) for P, Rs in groups.values() for R in Rs)
        packed += 3.5 * pair * sum(packed_pairs(P, Rs, w) for P, Rs in groups.values())
    return dup, packed


def run_side(name, side, model, seqs, args, window) -> dict:
    """Compile, warm up and time one side; a baseline out of memory runs again in twice the micro-batches."""
    layout, attn, fn, what = side
    compiled = (dualkv_compile.policy_loss(fn, inner="eager" if args.compiler == "none" else args.compiler)
                if name == "dualkv" else fn if args.compiler == "none"
                else torch.compile(fn, dynamic=False, backend=args.compiler))
    row, cuda = dict(variant=name, what=what, layout=layout, attn_implementation=attn, oom_at=[]), args.device == "cuda"
    n = 1 if name == "dualkv" else args.micro_batches
    while True:
        model.config._attn_implementation = attn
        torch._dynamo.reset()
        start, losses = len(dualkv_compile.reports()), []
        log(f"{name}: {what}; {n} micro-batch(es): compile + warm-up + {args.reps} steps")
        try:
            parts = micro_batches(seqs, layout, n, args.device, window if name == "flex" else None,
                                  -math.log(model.config.vocab_size))
            ms, peak, _ = time_step(accumulated(compiled, parts, losses), model, None, args.reps, args.device)
            break
        except torch.OutOfMemoryError:
            row["oom_at"].append(n)
            log(f"{name}: out of memory in {n} micro-batch(es)")
        except Exception as e:  # a side that cannot run is recorded with its reason; the others go on
            log(f"{name}: FAILED {type(e).__name__}: {str(e)[:1000]}")
            row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        parts = losses = None  # out of the except block, whose traceback held the step's tensors
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.empty_cache()
        if "error" in row or name == "dualkv" or n >= len(seqs):
            return dict(row, error=row.get("error", "OOM"))
        n *= 2
    parts = None  # (the allocator's cache is emptied for the next side)
    if cuda:
        torch.cuda.empty_cache()
    reports = dualkv_compile.reports()[start:]
    row.update(ms=ms, peak_gb=peak if cuda else None, loss=float(losses[-1]), micro_batches=n,
               packed_calls=sum(r.packed_calls for r in reports if r.rewritten))
    if name == "dualkv":
        row.update(refused=[r.reason for r in reports if not r.rewritten],
                   attention_backends=[b for r in reports if r.rewritten for b in r.attention_backends],
                   explain=str(dualkv_compile.Explanation(reports, None)))
        print(f"dualkv on {args.model}:\n{row['explain']}", flush=True)
    log(f"{name}: {ms:.1f} ms, peak {peak:.1f} GB, loss {row['loss']:.6f}, packed calls {row['packed_calls']}")
    return row


def write(out: str, meta: dict, name: str, entry: dict, stamp: dict) -> None:
    """``model_variants.{json,md}`` under ``out``: this model's entry (with its run's meta) merged into the others
    (the record's ``results["models"]``, stamped by this run)."""
    os.makedirs(out, exist_ok=True)
    path, models = os.path.join(out, "model_variants.json"), {}
    if os.path.exists(path):
        with open(path) as f:
            models = harness.payload(json.load(f)).get("models", {})
    models[name] = dict(entry, meta=meta)
    harness.write_json(path, harness.record(stamp, meta=dict(models=sorted(models)), results=dict(models=models)))
    lines = ["# GRPO step on gpt-oss, DeepSeek-V2 and Qwen3.5 shapes: dualkv against the strongest baseline that runs", ""]
    for model, e in models.items():
        m, (p0, p1), (r0, r1) = e["meta"], e["prompt"], e["response"]
        lines += [f"## {model}, {e['layers']} layers ({m['device']}, torch {m['torch']}, transformers "
                  f"{m['transformers']}, triton {m['triton']}, {m['date']})", "", f"`{e['command']}`", "",
                  f"{e['groups']} prompts of {p0}..{p1} tokens x {e['rollouts']} responses of {r0}..{r1}, shuffled; "
                  f"{e['layout_stats']}. Experts: {e['experts_implementation']}; compiler: {e['compiler']}.", "",
                  e["why"], "", "| side | layout | attention | step ms | peak GB | loss | packed calls | micro-batches"
                  " |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
        for r in e["rows"]:
            oom = f" (OOM at {r['oom_at']})" if r["oom_at"] else ""
            gb = "-" if r.get("peak_gb") is None else f"{r['peak_gb']:.1f}"
            vals = (f"{r['ms']:.1f} | {gb} | {r['loss']:.6f} | {r['packed_calls']} | {r['micro_batches']}{oom}"
                    if "ms" in r else f"{r['error'][:300]}{oom} | | | |")
            lines.append(f"| {r['variant']}: {r['what']} | {r['layout']} | {r['attn_implementation']} | {vals} |")
        if "speedup" in e:
            lines += ["", f"Speedup against the fastest baseline that ran ({e['strongest']}) {e['speedup']:.2f}x; "
                      f"FLOP ideal {e['ideal']:.2f}x (windows bound the sliding layers' pairs; active experts); speedup"
                      f" / ideal {e['of_ideal']:.2f}. Losses {'agree' if e['losses_agree'] else 'DISAGREE'} (relative "
                      f"difference {e['loss_rel_diff']:.1e}, tolerance {e['loss_tolerance']:.0e})."]
        if "explain" in e["rows"][-1]:
            lines += ["", "dualkv's report:", "", "```", e["rows"][-1]["explain"], "```"]
        lines.append("")
    with open(os.path.join(out, "model_variants.md"), "w") as f:
        f.write("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-oss-20b", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--prompt", help="LO..HI tokens, drawn per group (default 6144..8192; tiny models 16..24)")
    ap.add_argument("--response", help="LO..HI tokens (default 300..1000; tiny models 3..8)")
    ap.add_argument("--baselines", help="comma-separated, gpt-oss: flex, eager; deepseek: varlen, sdpa (default the "
                    "strongest that runs on the device: flex on CUDA, eager on CPU; varlen)")
    ap.add_argument("--micro-batches", type=int, default=1, help="the baselines' first micro-batch count")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager", "eager", "none"],
                    help="every side's (dualkv's inner one); none (the baselines uncompiled, dualkv's inner "
                    "compiler eager) for a quick CPU run")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="default: benchmarks/results/model_variants/<device>-<date>/ (benchmarks/harness.py)")
    args = ap.parse_args(argv)
    stamp = harness.stamp("model_variants", device=args.device, script=__file__, argv=argv)
    args.out = args.out or harness.result_dir(stamp)
    family, cfg = MODELS[args.model]
    tiny, cuda = args.model.startswith("tiny"), args.device == "cuda"
    prompt, response = ([int(x) for x in ((text or default).split("..") * 2)[:2]] for text, default in
                        ((args.prompt, "16..24" if tiny else "6144..8192"),
                         (args.response, "3..8" if tiny else "300..1000")))
    names = args.baselines.split(",") if args.baselines else [
        ("flex" if cuda else "eager") if family == "gpt_oss" else "varlen"]
    recurrent = contextlib.nullcontext
    if family == "qwen3_5_text" and not _fla_trains(cuda):  # the varlen GDN and conv: dualkv's ops on a flat forest
        from transformers.models.qwen3_5 import modeling_qwen3_5
        recurrent = functools.partial(varlen_recurrent.flat_forest, modeling_qwen3_5)
        SIDES[family]["varlen"] = SIDES[family]["varlen"][:3] + (VARLEN_TORCH_GDN,)
    for b in names:
        if b not in SIDES[family] or b == "dualkv":
            ap.error(f"--baselines: {b!r} is not one of {list(SIDES[family])[:-1]} for {args.model}")

    model = build_model(args.model, args.layers, args.device, torch.bfloat16 if cuda else torch.float32)
    seqs = sequences(args.groups, args.rollouts, prompt, response, model.config.vocab_size)
    row = row_batch(seqs, "cpu")  # the layout as dualkv finds it (tokens, pairs; the log and the table)
    stats = dualkv_compile.detect(row["input_ids"], None, row["position_ids"], same_columns=False).stats()
    dup, packed = flop_model(args.model, args.layers, seqs)
    log(f"{args.model} x {args.layers} layers: {stats}; FLOP ideal {dup / packed:.2f}x")
    versions = stamp["versions"]
    meta = dict(date=stamp["date"], device=stamp["device"], torch=versions["torch"],
                transformers=versions["transformers"], triton=versions["triton"] if cuda else "-")
    entry = dict(command=stamp["command"],
                 layers=args.layers, groups=args.groups, rollouts=args.rollouts, prompt=prompt, response=response,
                 tokens=stats.tokens_before, tokens_after=stats.tokens_after, rho=stats.rho, layout_stats=str(stats),
                 experts_implementation=getattr(model.config, "_experts_implementation", None), compiler=args.compiler,
                 ideal=dup / packed, flops_valid_tokens=dup, flops_packed=packed, why=WHY[family],
                 loss_tolerance=1e-2 if cuda else 1e-4, rows=[])
    for name in names + ["dualkv"]:  # the files written after each side: a run cut short keeps what it measured
        with recurrent() if name == "varlen" else contextlib.nullcontext():
            entry["rows"].append(run_side(name, SIDES[family][name], model, seqs, args, cfg.get("sliding_window")))
        write(args.out, meta, args.model, entry, stamp)
    ran, dk = [r for r in entry["rows"][:-1] if "ms" in r], entry["rows"][-1]
    if ran and "ms" in dk:
        best = min(ran, key=lambda r: r["ms"])
        entry.update(strongest=best["variant"], speedup=best["ms"] / dk["ms"],
                     loss_rel_diff=abs(dk["loss"] - best["loss"]) / max(abs(best["loss"]), 1e-12))
        entry.update(of_ideal=entry["speedup"] / entry["ideal"],
                     losses_agree=entry["loss_rel_diff"] <= entry["loss_tolerance"])
        write(args.out, meta, args.model, entry, stamp)
    with open(os.path.join(args.out, "model_variants.md")) as f:
        log(f.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
