"""TRL's GRPOTrainer with dualkv: one line after the trainer is built.

    trainer = GRPOTrainer(model=model, reward_funcs=..., args=GRPOConfig(...), train_dataset=..., processing_class=tok)
    dualkv_compile.integrations.trl.enable(trainer)
    trainer.train()

This script trains a tiny random-weight Qwen3 (built from its config; a word-level tokenizer built in code, no
download) for ``--steps`` GRPO steps twice from the same weights and seed: once as TRL runs it, once with dualkv
enabled. TRL generates a batch of ``--prompts`` x ``--generations`` completions every ``--steps-per-generation``
steps, shuffles its rows and splits it into per-step batches, so each training forward sees the rows of several
groups interleaved, prompts left padded, completions right padded.

For every scoring forward (TRL 1.16: ``model(input_ids, attention_mask, labels=..., fused_lm_head=True)``) it
prints the batch's layout as dualkv packed it: rows, groups, tokens before and after packing, rho, and the token
count a plain set of distinct prefixes gives (the packed stream holds each distinct prefix once, whatever the row
order: the rho of the unshuffled batch). At the end it compares every metric TRL logged (loss, grad norm,
rewards, entropy, clip ratios, ...) between the two runs and ends with ``trl_grpo: OK`` when they agree
(float32: 1e-5 relative; with ``--bf16``, mixed precision, 2e-2) and every scoring forward ran packed.

With ``--vlm`` the model is a tiny Qwen2.5-VL with its processor (one random 56 x 56 image a prompt): each distinct
image runs once through the vision tower (``images_once``, which ``enable`` turns on), and the layout's oracle
counts an image's tokens as shared only between rows that show the same image.

With ``--lora`` TRL trains LoRA adapters (``GRPOTrainer(..., peft_config=LoraConfig(...))``: TRL wraps the model
with PEFT, turns on ``enable_input_require_grads`` for its gradient checkpointing, and patches the PEFT model's base
model). With ``--enable-before`` dualkv is turned on before the trainer is built, on the bare model
(``compile_scoring_forward(model)``), so TRL patches (and, with ``--lora``, wraps) a model already routed.

    python examples/trl_grpo.py [--steps 2] [--prompts 4] [--generations 4] [--bf16] [--lora] [--enable-before] [--vlm]
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dualkv_compile  # noqa: E402

WORDS = [f"w{i}" for i in range(96)]
TIMING_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos"}


VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
# A prompt's image, then its text: the layout Qwen2.5-VL's own template gives a user turn with one image.
VLM_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }} {% else %}"
                "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|> "
                "{% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %}{% endfor %}")
IMAGE_SIDE = 56  # pixels: 4 x 4 patches of 14, 4 merged tokens


def word_tokenizer(words=WORDS, special=()):
    """A word-level tokenizer built in code: ``<pad>`` 0, ``<eos>`` 1, then ``words`` from 2, then ``special``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    vocab.update({t: len(vocab) + i for i, t in enumerate(special)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = {"additional_special_tokens": list(special)} if special else {}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", **extra)


def vlm_processor():
    """Qwen2.5-VL's processor over ``word_tokenizer`` and the PIL image processor (56 x 56 images), built in code."""
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        """No video processor: transformers' needs torchvision, which this environment does not install."""

        def check_argument_for_proper_class(self, name, arg):
            return None if name == "video_processor" and arg is None else super().check_argument_for_proper_class(name, arg)

    images = Qwen2VLImageProcessorPil(min_pixels=IMAGE_SIDE ** 2, max_pixels=IMAGE_SIDE ** 2, patch_size=14,
                                      temporal_patch_size=2, merge_size=2)
    tok = word_tokenizer(special=VISION_TOKENS)
    tok.padding_side = "left"  # TRL left-pads its prompts; its processor call must pad them the same way
    return ImageOnlyProcessor(image_processor=images, tokenizer=tok, chat_template=VLM_TEMPLATE)


def tiny_qwen2_5_vl(tok, seed: int = 0, layers: int = 2):
    import transformers

    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                         eos_token_id=1, bos_token_id=1,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=56, out_hidden_size=64,
                           fullatt_block_indexes=[1], in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        pad_token_id=0, eos_token_id=1, bos_token_id=1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg)


def tiny_qwen3(vocab: int, seed: int = 0, layers: int = 2):
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
        bos_token_id=1, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(cfg)


def reward_short_words(completions, **kwargs):
    """A toy reward: the share of words among the first half of the vocabulary (text, or a conversation's last turn)."""
    def words(c):
        text = c if isinstance(c, str) else c[-1]["content"]
        text = text if isinstance(text, str) else " ".join(b.get("text", "") for b in text)
        return [w for w in text.split() if w[1:].isdigit()]

    return [sum(int(w[1:]) < len(WORDS) // 2 for w in words(c)) / max(len(words(c)), 1) for c in completions]


def distinct_prefixes(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """Tokens of a packed stream that holds each distinct prefix of the rows' valid runs once (the oracle).

    A token is its id and its column: without ``position_ids`` (TRL passes none) transformers' positions
    are the columns, so equal tokens at different columns (prompts of different lengths, left padded)
    are different tokens to the model."""
    seen = set()
    for row, keep in zip(ids.tolist(), mask.bool().tolist()):
        seq = tuple((c, t) for c, (t, k) in enumerate(zip(row, keep)) if k)
        seen.update(seq[:i] for i in range(1, len(seq) + 1))
    return len(seen)


class ScoringCalls:
    """Hooks on the model: per scoring forward, the batch and the layout dualkv packed it with (None: unpacked)."""

    def __init__(self, model: torch.nn.Module):
        self.calls: list[dict] = []
        self._before = {}
        model.register_forward_pre_hook(self._pre, with_kwargs=True)
        model.register_forward_hook(self._post, with_kwargs=True)

    def _pre(self, module, args, kwargs):
        if kwargs.get("fused_lm_head"):
            self._before = {r.graph_id: r.packed_calls for r in dualkv_compile.reports()}
            self.calls.append({"ids": image_tagged(kwargs, module.config), "mask": kwargs["attention_mask"].detach().cpu()})

    def _post(self, module, args, kwargs, output):
        if kwargs.get("fused_lm_head"):
            packed = [r for r in dualkv_compile.reports() if r.packed_calls > self._before.get(r.graph_id, 0)]
            self.calls[-1]["stats"] = packed[-1].last_stats if packed else None


def image_tagged(kwargs: dict, config) -> torch.Tensor:
    """The call's token ids, each image placeholder replaced by a number naming its image's pixels (one image a row),
    so that ``distinct_prefixes`` shares an image's tokens only between rows that show the same image."""
    ids = kwargs["input_ids"].detach().cpu().clone()
    pixels, grid = kwargs.get("pixel_values"), kwargs.get("image_grid_thw")
    if pixels is None:
        return ids
    names: dict[bytes, int] = {}
    for row, image in enumerate(torch.split(pixels.detach().cpu(), grid.prod(-1).tolist())):
        name = names.setdefault(image.numpy().tobytes(), len(names))
        ids[row][ids[row] == config.image_token_id] = -1 - name
    return ids


def interleaved(ids: torch.Tensor, mask: torch.Tensor, prompts: list[tuple[int, ...]]) -> bool:
    """Whether rows of one prompt are not contiguous in the batch (TRL's shuffle)."""
    def prompt_of(row, keep):
        seq = tuple(t for t, k in zip(row, keep) if k)
        return next((i for i, p in enumerate(prompts) if seq[: len(p)] == p), None)

    owners = [prompt_of(r, k) for r, k in zip(ids.tolist(), mask.bool().tolist())]
    runs = [o for i, o in enumerate(owners) if i == 0 or o != owners[i - 1]]
    return len(runs) != len(set(runs))


def train(args, use_dualkv: bool):
    """One run of ``args.steps`` GRPO steps from the seed's weights: the trained trainer, its scoring calls as
    ``ScoringCalls`` saw them (with dualkv), the prompts' token ids and the wall time."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    processor = vlm_processor() if args.vlm else None
    tok = processor.tokenizer if args.vlm else word_tokenizer()
    model = tiny_qwen2_5_vl(tok, layers=args.layers) if args.vlm else tiny_qwen3(len(tok), layers=args.layers)
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(4, 12, (args.prompts * args.steps,), generator=g).tolist()
    prompts = [" ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (n,), generator=g).tolist()) for n in lengths]
    columns = {"prompt": prompts}
    if args.vlm:  # one image a prompt, random pixels, and the prompt as a user turn
        from PIL import Image

        columns["image"] = [Image.fromarray((torch.rand(IMAGE_SIDE, IMAGE_SIDE, 3, generator=g) * 255).byte().numpy())
                            for _ in prompts]
        columns["prompt"] = [[{"role": "user", "content": text}] for text in prompts]
    config = GRPOConfig(
        output_dir=args.output_dir, per_device_train_batch_size=args.prompts * args.generations // args.steps_per_generation,
        steps_per_generation=args.steps_per_generation, num_generations=args.generations,
        max_completion_length=args.max_completion, max_steps=args.steps, logging_steps=1, report_to="none",
        use_cpu=not torch.cuda.is_available(), seed=args.seed, save_strategy="no", bf16=args.bf16,
        temperature=0.9, disable_tqdm=False,
    )
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    if use_dualkv and args.enable_before:
        dualkv_compile.integrations.trl.compile_scoring_forward(model, inner=args.inner)  # before TRL patches it
    trainer = GRPOTrainer(model=model, reward_funcs=reward_short_words, args=config, peft_config=peft_config,
                          train_dataset=datasets.Dataset.from_dict(columns), processing_class=processor or tok)
    calls = None
    if use_dualkv:
        if not args.enable_before:
            dualkv_compile.integrations.trl.enable(trainer, inner=args.inner)  # the one line
        calls = ScoringCalls(trainer.model)
    start = time.perf_counter()
    trainer.train()
    if args.vlm:  # the image's tokens first, tagged as image_tagged tags them (one distinct image a prompt here)
        merged = (IMAGE_SIDE // 14) ** 2 // 4
        prompt_ids = [tuple([tok.convert_tokens_to_ids("<|vision_start|>")] + [-1 - i] * merged
                            + [tok.convert_tokens_to_ids("<|vision_end|>")] + tok(text)["input_ids"])
                      for i, text in enumerate(prompts)]
    else:
        prompt_ids = [tuple(tok(text)["input_ids"]) for text in prompts]
    return trainer, (calls.calls if calls else []), prompt_ids, time.perf_counter() - start


def metric_diffs(plain: list[dict], dual: list[dict]) -> dict[str, float]:
    """Relative difference of each logged metric (largest over steps), timings left out."""
    diffs: dict[str, float] = {}
    for a, b in zip(plain, dual):
        for key in sorted(set(a) & set(b) - TIMING_KEYS):
            x, y = float(a[key]), float(b[key])
            d = 0.0 if x == y else abs(x - y) / max(abs(x), 1e-3)
            diffs[key] = max(diffs.get(key, 0.0), d)
    if len(plain) != len(dual):
        diffs["(number of log entries)"] = math.inf
    return diffs


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4, help="prompts per generation batch")
    p.add_argument("--generations", type=int, default=4, help="completions per prompt (GRPO's group size)")
    p.add_argument("--steps-per-generation", type=int, default=2, help="TRL splits (and shuffles) each generation batch")
    p.add_argument("--max-completion", type=int, default=8)
    p.add_argument("--bf16", action="store_true", help="mixed precision (autocast bfloat16), as TRL's default")
    p.add_argument("--inner", default="aot_eager", choices=["aot_eager", "inductor"])
    p.add_argument("--lora", action="store_true", help="LoRA adapters through TRL's peft_config (needs peft)")
    p.add_argument("--enable-before", action="store_true",
                   help="compile_scoring_forward(model) before the trainer is built instead of enable(trainer) after")
    p.add_argument("--vlm", action="store_true", help="a tiny Qwen2.5-VL, one image a prompt, through its processor")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.getLogger("dualkv_compile").setLevel(logging.ERROR)  # the summary below says what happened
    with tempfile.TemporaryDirectory() as tmp:
        args.output_dir = args.output_dir or tmp
        print(f"GRPOTrainer, {args.steps} steps, {args.prompts} prompts x {args.generations} completions per generation "
              f"batch ({'bf16 autocast' if args.bf16 else 'float32'}): plain TRL, then with dualkv", flush=True)
        plain_run, _, _, t_plain = train(args, use_dualkv=False)
        dual_run, calls, prompt_ids, t_dual = train(args, use_dualkv=True)
    plain, dual = plain_run.state.log_history, dual_run.state.log_history

    ok = bool(calls)
    print(f"\n{len(calls)} scoring forward(s) with dualkv (the packed stream against the distinct prefixes of the rows):")
    for i, c in enumerate(calls):
        ids, mask, stats = c["ids"], c["mask"], c["stats"]
        oracle = distinct_prefixes(ids, mask)
        shuffled = "rows of one prompt interleaved" if interleaved(ids, mask, prompt_ids) else "rows grouped"
        if stats is None:
            print(f"  call {i + 1}: [{ids.shape[0]}, {ids.shape[1]}], {shuffled}: RAN UNPACKED")
            ok = False
            continue
        match = stats.tokens_after == oracle and stats.tokens_before == int(mask.sum())
        ok &= match
        print(f"  call {i + 1}: [{ids.shape[0]}, {ids.shape[1]}], {shuffled}: {stats}; "
              f"distinct prefixes {oracle} ({'equal' if match else 'DIFFERENT'})")
    diffs = metric_diffs(plain, dual)
    tol = 2e-2 if args.bf16 else 1e-5
    worst = max(diffs, key=diffs.get) if diffs else None
    print(f"\n{len(diffs)} metrics compared over {args.steps} steps; largest relative difference: "
          f"{worst} {diffs.get(worst, 0.0):.2e} (tolerance {tol:g})")
    for key in ("loss", "grad_norm", "reward", "entropy"):
        if key in diffs:
            print(f"  {key:10s} plain {[float(h[key]) for h in plain if key in h]}  dualkv {[float(h[key]) for h in dual if key in h]}")
    graphs = dualkv_compile.reports()
    with_attention = [r for r in graphs if r.num_attention]
    print(f"dualkv saw {len(graphs)} graph(s): {sum(r.rewritten for r in with_attention)} of the {len(with_attention)} "
          f"with attention rewritten; {len(graphs) - len(with_attention)} without attention (pieces before a graph "
          f"break: with --lora, the embedding before the hook of PEFT's enable_input_require_grads) run as they are")
    if args.vlm:  # images_once's count on the policy (compile_scoring_forward turned it on), generation included
        tower = dualkv_compile.images_once(dual_run.model)
        print(f"vision tower (images_once): ran on {tower.images} of the {tower.images_in} images it was given "
              f"({tower.patches} of {tower.patches_in} patches)")
        ok &= tower.images < tower.images_in
    print(f"wall time (CPU, includes compiling): plain {t_plain:.1f} s, dualkv {t_dual:.1f} s")
    ok &= bool(diffs) and all(d <= tol for d in diffs.values())
    print("trl_grpo: OK" if ok else "trl_grpo: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
