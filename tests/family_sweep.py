"""A sweep of every decoder-only ``*ForCausalLM`` family of the installed transformers through dualkv (issue 49).

Each family's model is built from a tiny config (random weights, float32, CPU, 2 layers, hidden 32, vocab 101,
windows and chunks of 4 where the family has them, so that they bind) and run through
``torch.compile(model, backend="dualkv")`` on one fixed GRPO batch (2 groups of 3 and 2 rows, prompts
left-padded to one length, ``position_ids`` from the mask as trainers pass them), forward and backward, against
the unmodified model on the same batch. Its outcome is one of

* ``packed and exact``: a packed call counted; logits at valid positions and every parameter gradient within
  1e-5 of the unmodified model (detail: the packed tokens, before -> after);
* ``refused``: no call packed (detail: the reason dualkv's report gives); the logits and gradients are still
  checked against the unmodified model (the original program ran);
* ``torch.compile alone fails``: dualkv's compile raised, and so does ``torch.compile(backend="aot_eager")``
  without dualkv (detail: that error);
* ``not buildable``: the tiny config or the model's forward on a text batch fails without any compiling
  (detail: the error);

and two that would be bugs of dualkv, never expected in the committed table: ``INEXACT`` (packed, or refused,
but outside 1e-5 of the unmodified model: the detail names the worst output or gradient) and ``dualkv raises``
(dualkv's compile failed where ``aot_eager`` alone runs).

``python -m tests.family_sweep --write docs/families.md`` runs every family (each in a subprocess of its own,
with a time limit) and writes the table; ``tests/test_family_sweep.py`` runs them again, in process, and asserts
each row. Families come from transformers' auto mapping (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) less the
excluded kinds (``excluded``: encoder-decoders' decoders, multimodal ``ForConditionalGeneration`` entries).
Configs are built generically: ``AutoConfig.for_model(model_type, **kwargs)`` with the common kwargs the
family's config has (names through its ``attribute_map``), dropout set to 0 (RL trainers turn it off; in
training mode dropout is refused), and ``OVERRIDES`` where a family needs more.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import inspect
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py: before any kernel module is imported

import dualkv_compile  # noqa: E402
from dualkv_compile.backend import dualkv_backend  # noqa: E402

from .helpers import grpo_batch, rel  # noqa: E402

import transformers  # noqa: E402
from transformers import AutoConfig  # noqa: E402
from transformers.models.auto import modeling_auto  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "families.md"

VOCAB = 101
GROUPS = [(6, [3, 5, 2]), (4, [4, 1])]  # prompts 6 and 4 (left-padded to one length), responses 3+5+2 and 4+1
WINDOW = 4  # sliding windows and attention chunks: shorter than the prompts, so that they bind
TOL = 1e-5
ZERO_GRAD = 1e-3  # a gradient below this fraction of the largest one is compared against that fraction (_worst):
# Qwen3-Next's A_log gradient is ~1e-7 of the largest and moves 3% with one more padding column in the unmodified
# model alone (float32 rounding of a sum that cancels), so only a floor above rounding compares it meaningfully

PACKED, REFUSED, COMPILE_FAILS, NOT_BUILDABLE = "packed and exact", "refused", "torch.compile alone fails", "not buildable"
INEXACT, DUALKV_RAISES, DUALKV_HANGS = "INEXACT", "dualkv raises", "dualkv does not finish"
OUTCOMES = (PACKED, REFUSED, COMPILE_FAILS, NOT_BUILDABLE, INEXACT, DUALKV_RAISES, DUALKV_HANGS)

# Applied to every family whose config has the attribute (the standard names reach the family's own through
# its attribute_map: hidden_size -> n_embd).
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=128, sliding_window=WINDOW,
    attention_chunk_size=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # MoE: few, small experts; one expert group (group-limited routing needs experts divisible by groups)
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=32, n_group=1, topk_group=1, n_shared_experts=1,
    # latent attention (MLA) and its sparse indexer (DSA)
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_head_dim=16,
    index_n_heads=2, index_topk=8,
    num_shared_experts=1, num_expert_group=1, num_experts_per_token=2, moe_shared_expert_intermediate_size=32,
    # other names of the MLP's width and the heads' size
    ffn_dim=48, decoder_ffn_dim=48, shared_intermediate_size=32, dff=48, dim_ff=48, ffn_hidden_size=48, d_inner=48, dim_head=8, swa_head_dim=8,
    swa_num_attention_heads=4, swa_num_key_value_heads=2, sliding_window_size=WINDOW,
    rotary_dim=4,  # GPT-J, CodeGen: rotary on part of the head
    # linear attention (gated delta net) and state-space layers (the Mamba mixers of the hybrids)
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_head_dim=8, linear_num_heads=4,
    mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8,
    mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=8, state_size=8,
    # encoders' LM heads as causal decoders (BertLMHeadModel and kin: is_decoder=True is their causal use)
    is_decoder=True,
)
ALWAYS = dict(use_cache=False)

# Where a tiny config needs more than COMMON (a family's own names, sizes that must divide, layer lists).
_QWEN4 = dict(hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8,
              indexer_compress_ratio=2)
_DOTS3 = dict(num_key_value_heads=4, swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=16,
              swa_kv_lora_rank=16, swa_head_dim=16, swa_qk_nope_head_dim=8, swa_v_head_dim=8,
              shared_experts_intermediate_size=32)
OVERRIDES: dict[str, dict] = {
    # hybrids whose default places no attention layer among the first two: one of each kind
    "bamba": dict(attn_layer_indices=[1]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "dots3_note": _DOTS3,
    "dots3_note_text": _DOTS3,
    "blt": dict(encoder_hash_byte_group_vocab=64, encoder_hash_byte_group_size=[3, 4], local_attention_window_len=WINDOW,
                encoder_config=dict(hidden_size_global=32), decoder_config=dict(hidden_size_global=32)),
    "cohere_compass_text": dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0,
                                                                        mrope_section=[2, 1, 1])}),
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, clip_qkv=8.0)),  # its attention clamps by clip_qkv
    "dory": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_hidden_layers=3,
                 n_input_layers=1, n_output_layers=1),
    "falcon_h1": dict(mamba_d_ssm=64),
    # pad_token_id None: the padding row of the embedding is not zeros (the unmodified model's altup takes
    # mean(h ** 2) ** 0.5 at every position; at a zero padding embedding its backward is 0 * inf = NaN)
    "gemma3n_text": dict(pad_token_id=None, num_kv_shared_layers=0, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                         laurel_rank=4),
    "gemma4_text": dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, global_head_dim=16),
    "gemma4_unified_text": dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, global_head_dim=16),
    "gemma4_assistant": dict(text_config=dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                                              global_head_dim=16)),
    "deepseek_v4": dict(o_lora_rank=8, o_groups=2),
    "rembert": dict(input_embedding_size=32, output_embedding_size=32),
    "zaya": dict(num_experts_per_tok=1, router_hidden_size=16),
    "phi4_multimodal": dict(audio_config=dict(ext_pw_out_channel=32, depthwise_separable_out_channel=32,
                                              nemo_conv_channels=32, num_blocks=1)),
    "qwen4_exp": _QWEN4, "qwen4_exp_text": _QWEN4,
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=WINDOW),
    "inkling2_text": dict(unpadded_vocab_size=VOCAB),
    "inkling2_loop_text": dict(unpadded_vocab_size=VOCAB),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "longcat_flash": dict(num_layers=2, zero_expert_num=2, expert_ffn_hidden_size=16, moe_topk=2),
    "mamba2": dict(num_heads=4, head_dim=16, state_size=8, time_step_rank=8),
    "minimax_m3_vl_text": dict(dense_intermediate_size=48, shared_intermediate_size=32, index_block_size=WINDOW,
                               index_topk_blocks=2),
    "reformer": dict(attn_layers=["local", "lsh"], attention_head_size=8, feed_forward_size=48, axial_pos_embds=False,
                     local_attn_chunk_length=7, lsh_attn_chunk_length=7, num_buckets=2),
    "roc_bert": dict(shape_vocab_size=16, shape_embed_dim=8, pronunciation_vocab_size=16, pronunciation_embed_dim=8),
    "xlnet": dict(d_head=8),
    "xmod": dict(default_language="en_XX"),
    "zamba": dict(num_hidden_layers=4, layers_block_type=["linear_attention", "hybrid"] * 2, attn_layer_period=2, attn_layer_offset=1, mamba_dt_rank=4, n_mamba_heads=2),
    "zamba2": dict(hybrid_layer_ids=[1], n_mamba_heads=4, adapter_rank=8),
}

# The table's generator runs each family in a subprocess of its own, stopped after this many seconds (the
# slowest family that finishes takes about 30 s on 2 cores; torch.compile alone, about 20 s).
TIME_LIMIT = 300


@dataclasses.dataclass
class Outcome:
    family: str
    outcome: str
    detail: str
    model_class: str = ""
    attn: str = ""
    params: int = 0
    seconds: float = 0.0

    def key(self) -> tuple[str, str]:
        return self.outcome, self.detail


# --- which families -------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def excluded() -> dict[str, str]:
    """Entries of the causal-LM auto mapping that are not decoder-only language models, with why."""
    seq2seq = set(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES) | set(
        modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES)
    out = {}
    for family, cls in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if family in seq2seq or _config_is_encoder_decoder(family):
            out[family] = f"encoder-decoder: `{cls}` is the decoder of a sequence-to-sequence model (cross-attention)"
        elif cls.endswith("ForConditionalGeneration"):
            text = f"{family}_text"
            row = f"; its text decoder is the `{text}` row" if text in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else ""
            out[family] = f"multimodal: `{cls}` is the model with its image or audio encoder{row}"
    return out


def _config_is_encoder_decoder(family: str) -> bool:
    try:
        return bool(getattr(AutoConfig.for_model(family), "is_encoder_decoder", False))
    except Exception:
        return False


def families() -> list[str]:
    """Every decoder-only causal-LM family (model type) of the installed transformers, sorted."""
    skip = excluded()
    return sorted(f for f in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if f not in skip)


# --- building a tiny model -------------------------------------------------------------------------------------


def model_class(family: str):
    return getattr(transformers, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])


def tiny_config(family: str):
    """``AutoConfig.for_model(family, **kwargs)`` with ``tiny_kwargs`` of its default config. A composite
    (multimodal) config whose ForCausalLM takes its text config: the text config, built the same way."""
    cls = model_class(family)
    overrides = OVERRIDES.get(family, {})
    try:
        default = AutoConfig.for_model(family)
    except Exception:  # a default config that does not validate: the family's overrides (not its sub-configs') in
        default = AutoConfig.for_model(family, **overrides)
    if cls.config_class is not type(default) and getattr(default, "text_config", None) is not None:
        return type(default.text_config)(**tiny_kwargs(default.text_config, overrides))
    return AutoConfig.for_model(family, **tiny_kwargs(default, overrides))


def tiny_kwargs(default, overrides: dict) -> dict:
    """COMMON where ``default`` (a config) has the attribute, dropout 0, ALWAYS, each sub-config (a nested
    ``PreTrainedConfig``: a vision tower, a per-part config) the same way, then ``overrides`` (a dict's
    entries for a sub-config are merged into that sub-config's)."""
    as_dict = default.to_dict()
    names = set(as_dict) | set(getattr(type(default), "__dataclass_fields__", ()))
    amap = getattr(default, "attribute_map", {})
    # by the config's own names (hidden_size -> n_embd): a __post_init__ that copies one reads the value given
    kwargs = {amap.get(k, k): v for k, v in COMMON.items() if amap.get(k, k) in names}
    kwargs.update({k: 0.0 for k, v in as_dict.items()
                   if isinstance(v, float) and v > 0 and re.search(r"dropout|pdrop|drop_rate|drop_prob", k)})
    if "kv_lora_rank" in names:  # latent attention: keys and values per query head (no grouping)
        kwargs["num_key_value_heads"] = COMMON["num_attention_heads"]
    kwargs.update(_one_layer_of_each_type(as_dict, kwargs, amap.get("num_hidden_layers", "num_hidden_layers")))
    kwargs.update(ALWAYS)
    subs = {}
    for key in getattr(type(default), "sub_configs", {}) or {}:
        sub = getattr(default, key, None)
        if isinstance(sub, transformers.PreTrainedConfig):
            subs[key] = tiny_kwargs(sub, overrides.get(key, {}) if isinstance(overrides.get(key), dict) else {})
    kwargs.update(subs)
    kwargs.update({k: v for k, v in overrides.items() if k not in subs})
    return kwargs


def _one_layer_of_each_type(default: dict, kwargs: dict, layers: str) -> dict:
    """A family whose config lists a type per layer (``layer_types``, ``mlp_layer_types``, ...): one layer of each
    type it has, in the order they first appear (a hybrid keeps its attention layer; gpt-oss its sliding and its
    full layer), the lists padded with their last type to one length; more layers where there are more types."""
    lists = {k: list(dict.fromkeys(v)) for k, v in default.items()
             if re.fullmatch(r"(\w+_)?layer_types|layers_block_type|block_types|attention_layers", k)
             and isinstance(v, list) and v and all(isinstance(x, str) for x in v)}
    if not lists or layers not in kwargs:
        return {}
    n = max(kwargs[layers], *map(len, lists.values()))
    out = {k: v + v[-1:] * (n - len(v)) for k, v in lists.items()}
    out[layers] = n
    return out


MAX_PARAMS = 2_000_000  # a config that builds larger has a size COMMON did not reach: it needs an override


def tiny_model(family: str):
    cfg = tiny_config(family)
    with torch.device("meta"):  # sized first: an untouched default size would fill the memory
        n = sum(p.numel() for p in model_class(family)(copy.deepcopy(cfg)).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"the tiny config builds {n:,} parameters (a size the common kwargs do not reach)")
    torch.manual_seed(0)
    model = model_class(family)(cfg)
    return model.float().train()


def batch_kwargs(model) -> tuple[dict, torch.Tensor]:
    """The fixed GRPO batch as the model's forward takes it (position ids from the mask where it takes them);
    returns the kwargs and the mask of valid positions."""
    ids, mask, pos = grpo_batch(GROUPS, VOCAB)
    params = inspect.signature(model.forward).parameters
    kwargs = {"input_ids": ids}
    if "attention_mask" in params:
        kwargs["attention_mask"] = mask
    if "position_ids" in params:
        kwargs["position_ids"] = pos
    return kwargs, mask.bool()


# --- running one family ----------------------------------------------------------------------------------------


def _err(e: BaseException) -> str:
    """An exception as one normalised line: its type and the first line of its message (a backend's error
    unwrapped to the error it wraps)."""
    inner = getattr(e, "inner_exception", None)
    if inner is not None:
        e = inner
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return normalise(f"{type(e).__name__}: {msg}" if msg else type(e).__name__)


def normalise(text: str, limit: int = 240) -> str:
    """One table cell: one line, no addresses, no pipes, at most ``limit`` characters."""
    text = re.sub(r"0x[0-9a-fA-F]+", "0x..", text)
    text = re.sub(r"\s+", " ", text.replace("|", "/")).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _forward_backward(model, kwargs, valid):
    """Logits at valid positions and each parameter's gradient (a fixed projection of the logits summed)."""
    torch.manual_seed(0)  # any random draw the program makes is the same on both sides
    logits = model(**kwargs).logits[valid]
    proj = torch.randn(logits.shape[-1], generator=torch.Generator().manual_seed(1))
    (logits @ proj).sum().backward()
    grads = {n: p.grad for n, p in getattr(model, "_orig_mod", model).named_parameters()}
    return logits.detach(), grads


def _worst(out, grads, ref_out, ref_grads) -> Optional[str]:
    """None when every value is within TOL of the reference, else the first that is not and its error.

    Each gradient is compared by norm, relative to its own reference norm, or to ``ZERO_GRAD`` of the largest
    reference gradient norm where its own is smaller: a gradient that is zero but for rounding (a key bias's:
    the softmax ignores a shift common to all keys) is noise on both sides, equal only to within that scale.
    """
    err = rel(out, ref_out)
    if not err <= TOL:
        return f"logits off by {err:.1e}"
    scale = max((g.norm().item() for g in ref_grads.values() if g is not None), default=0.0)
    for name, g in ref_grads.items():
        p = grads[name]
        if g is None:
            if p is not None and p.abs().max() != 0:
                return f"gradient of {name}: nonzero where the unmodified model has none"
            continue
        if p is None:
            return f"gradient of {name}: none where the unmodified model has one"
        err = ((p - g).norm() / max(g.norm().item(), ZERO_GRAD * scale, 1e-30)).item()
        if not err <= TOL:
            return f"gradient of {name} off by {err:.1e}"
    return None


def _reason(reports) -> str:
    """Why no call packed: the graphs' refusals, else the reasons their calls ran unpacked."""
    if not reports:
        return "no graph reached the backend"
    reasons = [r.reason or "the dualkv backend raised an error on a graph" for r in reports if not r.rewritten]
    reasons += [x for r in reports if r.rewritten for x in r.fallback_reasons]
    reasons = list(dict.fromkeys(normalise(x, 10_000) for x in reasons))
    if not reasons:
        reasons = ["rewritten, no call packed, no reason given"]
    graphs = f"{len(reports)} graphs: " if len(reports) > 1 else ""
    return normalise(graphs + "; ".join(reasons))


def run_family(family: str) -> Outcome:
    """Build ``family`` tiny, run it through dualkv and unmodified on the batch, and classify the result."""
    start = time.perf_counter()
    cls_name = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(family, "?")

    def done(outcome, detail, model=None):
        attn = getattr(getattr(model, "config", None), "_attn_implementation", "") or "" if model is not None else ""
        params = sum(p.numel() for p in model.parameters()) if model is not None else 0
        return Outcome(family, outcome, normalise(detail), cls_name, attn, params, time.perf_counter() - start)

    torch._dynamo.reset()
    try:
        model = tiny_model(family)
        kwargs, valid = batch_kwargs(model)
        ref = copy.deepcopy(model)
        ref_out, ref_grads = _forward_backward(ref, kwargs, valid)
    except Exception as e:
        return done(NOT_BUILDABLE, _err(e))
    bad = [n for n, g in ref_grads.items() if g is not None and not torch.isfinite(g).all()]
    if not torch.isfinite(ref_out).all() or bad:
        return done(NOT_BUILDABLE, "the unmodified model's logits or gradients are not finite on the batch"
                    + (f" (the gradient of {bad[0]})" if bad else ""), model)
    before = len(dualkv_compile.reports())
    compiled = torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    try:
        out, grads = _forward_backward(compiled, kwargs, valid)
    except Exception as e:
        dualkv_error = _err(e)
        torch._dynamo.reset()
        plain = copy.deepcopy(ref)
        plain.zero_grad(set_to_none=True)
        try:
            _forward_backward(torch.compile(plain, backend="aot_eager"), kwargs, valid)
        except Exception as e2:
            return done(COMPILE_FAILS, _err(e2), model)
        return done(DUALKV_RAISES, dualkv_error, model)
    finally:
        torch._dynamo.reset()
    reports = dualkv_compile.reports()[before:]
    packed = [r for r in reports if r.packed_calls]
    wrong = _worst(out, grads, ref_out, ref_grads)
    if packed:
        stats = packed[-1].last_stats
        detail = f"{stats.tokens_before} -> {stats.tokens_after} tokens"
        if len(reports) > 1:
            detail += f"; {len(packed)} of {len(reports)} graphs packed"
            if len(packed) < len(reports):
                detail += f"; the others: {_reason([r for r in reports if not r.packed_calls])}"
        if wrong:
            return done(INEXACT, f"packed ({detail}) but {wrong}", model)
        return done(PACKED, detail, model)
    reason = _reason(reports)
    if wrong:
        return done(INEXACT, f"refused ({reason}) but {wrong}", model)
    return done(REFUSED, reason, model)


# --- the table ---------------------------------------------------------------------------------------------------

_ROW = re.compile(r"^\| `(?P<family>[^`]+)` \| `(?P<cls>[^`]*)` \| (?P<outcome>[^|]+?) \| (?P<detail>[^|]*?) \|$")
_EXCLUDED_ROW = re.compile(r"^\| `(?P<family>[^`]+)` \| (?P<why>.*) \|$")


def read_table(path: Path = TABLE) -> dict[str, tuple[str, str]]:
    """The committed table's rows: family -> (outcome, detail)."""
    rows = {}
    for line in path.read_text().splitlines():
        m = _ROW.match(line)
        if m:
            rows[m["family"]] = (m["outcome"], m["detail"])
    return rows


def _read_outcomes(path: Path) -> dict[str, Outcome]:
    """The table's rows as outcomes (family, outcome, detail, model class), for ``--update``."""
    rows = {}
    for line in path.read_text().splitlines():
        m = _ROW.match(line)
        if m:
            rows[m["family"]] = Outcome(m["family"], m["outcome"], m["detail"], m["cls"])
    return rows


def read_excluded(path: Path = TABLE) -> set[str]:
    rows = set()
    section = False
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            section = line.startswith("## Not in the sweep")
        m = _EXCLUDED_ROW.match(line)
        if section and m:
            rows.add(m["family"])
    return rows


# What was found about the bug rows (kept beside the table's bug section; a row that is no longer a bug drops it).
BUG_NOTES: dict[str, str] = {}


def write_table(results: list[Outcome], path: Path) -> None:
    counts = {o: sum(r.outcome == o for r in results) for o in OUTCOMES}
    bugs = [r for r in sorted(results, key=lambda r: r.family) if r.outcome in (INEXACT, DUALKV_RAISES, DUALKV_HANGS)]
    lines = [
        "# Model families through dualkv",
        "",
        f"Every decoder-only `*ForCausalLM` family of transformers {transformers.__version__} (torch "
        f"{torch.__version__}), generated {datetime.date.today().isoformat()} by "
        "`python -m tests.family_sweep --write docs/families.md` and asserted row by row by "
        "`tests/test_family_sweep.py` (a few families in `make test`, the rest in `make test-slow`); "
        "`python -m tests.family_sweep --only llama,gpt2` runs some and prints their rows.",
        "",
        "Each family is built from a tiny config (`AutoConfig.for_model(family, ...)`: random weights, float32, "
        f"CPU; 2 layers, or one of each type for a family that lists layer types (a hybrid keeps an attention layer); "
        f"hidden 32, 4 heads, vocab {VOCAB}, MoE with 4 experts, top-2; sliding windows and attention chunks of "
        f"{WINDOW} where the family has them, shorter than the prompts, so that they bind; dropout 0; an encoder's "
        "LM head with `is_decoder=True`; overrides in `tests/family_sweep.py` where a family needs more) and run "
        "forward and backward through `torch.compile(model, backend=\"dualkv\", options={\"inner\": "
        f"\"aot_eager\"}})` on one GRPO batch (groups {GROUPS}: (prompt, [responses]); prompts left-padded to "
        "one length, `position_ids` from the mask where the forward takes them), against the unmodified model on "
        "the same batch. Outcomes:",
        "",
        f"- **{PACKED}**: a call ran packed; logits at valid positions and every parameter gradient within "
        f"{TOL:g} of the unmodified model (by norm, relative; a gradient under {ZERO_GRAD:g} of the largest, such "
        "as a key bias's, which the softmax makes zero but for rounding, relative to that). Detail: tokens before "
        "-> after packing (and the graphs, if a graph break split the model).",
        f"- **{REFUSED}**: no call packed; the detail is the reason in dualkv's report (`explain()`), of each "
        "graph where there are several. The original program ran; its logits and gradients were checked against "
        "the unmodified model too.",
        f"- **{COMPILE_FAILS}**: dualkv's compile failed, and so does `torch.compile(model, "
        "backend=\"aot_eager\")` without dualkv; the detail is that error.",
        f"- **{NOT_BUILDABLE}**: the tiny config, or the unmodified model on this text batch, fails without any "
        "compiling; the detail is the error.",
        f"- dualkv bugs: **{INEXACT}** (a result outside the tolerance), **{DUALKV_RAISES}** (where "
        f"`aot_eager` alone runs), **{DUALKV_HANGS}** (where `aot_eager` alone finishes): listed again below.",
        "",
        "Counts: " + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts[o] or o in OUTCOMES[:4]) + ".",
        "",
        "| family | model class | outcome | detail |",
        "| --- | --- | --- | --- |",
    ]
    for r in sorted(results, key=lambda r: r.family):
        lines.append(f"| `{r.family}` | `{r.model_class}` | {r.outcome} | {r.detail} |")
    if bugs:
        lines += ["", "## dualkv bugs the sweep found", "",
                  "Each reproduces with `python -m tests.family_sweep --only <family>`; its test fails "
                  "(without running it again) until the bug is fixed and the table regenerated.", ""]
        for r in bugs:
            note = BUG_NOTES.get(r.family, "not diagnosed yet")
            lines.append(f"- `{r.family}` ({r.outcome}): {note}")
    lines += [
        "",
        "## Not in the sweep",
        "",
        "Entries of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` that are not decoder-only language models:",
        "",
        "| family | why |",
        "| --- | --- |",
    ]
    for family, why in sorted(excluded().items()):
        lines.append(f"| `{family}` | {why} |")
    path.write_text("\n".join(lines) + "\n")


def _run_in_subprocess(family: str, timeout: float, plain: bool = False) -> Outcome:
    """``run_family`` in a subprocess, stopped after ``timeout`` seconds; a family stopped there is run again
    with ``torch.compile(backend="aot_eager")`` alone (``plain``), which tells who does not finish."""
    cls = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]
    cmd = [sys.executable, "-m", "tests.family_sweep", "--plain" if plain else "--one", family]
    start = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        if plain:
            return Outcome(family, COMPILE_FAILS, f"does not finish in {timeout:.0f} s", cls, seconds=timeout)
        alone = _run_in_subprocess(family, timeout, plain=True)
        if alone.outcome == COMPILE_FAILS:
            return dataclasses.replace(alone, seconds=timeout + alone.seconds)
        return Outcome(family, DUALKV_HANGS, f"not finished in {timeout:.0f} s; torch.compile alone: "
                       f"{alone.detail} in {alone.seconds:.0f} s", cls, seconds=timeout + alone.seconds)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return Outcome(**json.loads(line))
    lines = [x for x in (p.stderr or p.stdout).strip().splitlines() if not x.startswith("[transformers]")]
    died = f"the process died (rc {p.returncode}: {normalise(' '.join(lines[-2:]), 120)})"
    if plain or "--forward" in cmd:
        return Outcome(family, COMPILE_FAILS if plain else DUALKV_RAISES, died, cls, seconds=time.perf_counter() - start)
    # The forward alone, without gradients, tells whether what it computed was right before the process died.
    fwd = subprocess.run([sys.executable, "-m", "tests.family_sweep", "--forward", family], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    fwd_out = next((Outcome(**json.loads(x)) for x in reversed(fwd.stdout.splitlines()) if x.startswith("{")), None)
    if fwd_out is not None and fwd_out.outcome == INEXACT:
        return Outcome(family, INEXACT, f"{fwd_out.detail}; with the backward, {died}", cls,
                       seconds=time.perf_counter() - start)
    alone = _run_in_subprocess(family, timeout, plain=True)
    if alone.outcome == COMPILE_FAILS:
        return dataclasses.replace(alone, seconds=time.perf_counter() - start)
    return Outcome(family, DUALKV_RAISES, died, cls, seconds=time.perf_counter() - start)


def run_forward(family: str) -> Outcome:
    """The forward alone, under ``no_grad``: ``INEXACT`` where a packed call's logits are off (detail: by how
    much), else ``PACKED`` or ``REFUSED`` with no detail. The generator runs it where the whole run's process
    died (a crash in the backward)."""
    start = time.perf_counter()
    torch._dynamo.reset()
    model = tiny_model(family)
    kwargs, valid = batch_kwargs(model)
    ref = copy.deepcopy(model)
    before = len(dualkv_compile.reports())
    with torch.no_grad():
        want = ref(**kwargs).logits[valid]
        compiled = torch.compile(model, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
        got = compiled(**kwargs).logits[valid]
    packed = any(r.packed_calls for r in dualkv_compile.reports()[before:])
    err = rel(got, want)
    if not err <= TOL:
        return Outcome(family, INEXACT, f"{'packed' if packed else 'refused'}, logits off by {err:.1e} (the forward "
                       "alone, no_grad)", seconds=time.perf_counter() - start)
    return Outcome(family, PACKED if packed else REFUSED, "", seconds=time.perf_counter() - start)


def run_plain(family: str) -> Outcome:
    """``torch.compile(model, backend="aot_eager")`` alone, forward and backward: outcome ``COMPILE_FAILS``
    with the error, or ``"ok"``."""
    start = time.perf_counter()
    torch._dynamo.reset()
    model = tiny_model(family)
    kwargs, valid = batch_kwargs(model)
    try:
        _forward_backward(torch.compile(model, backend="aot_eager"), kwargs, valid)
    except Exception as e:
        return Outcome(family, COMPILE_FAILS, _err(e), seconds=time.perf_counter() - start)
    return Outcome(family, "ok", "ok", seconds=time.perf_counter() - start)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="run every family and write the table here")
    ap.add_argument("--only", help="comma-separated families (default: all)")
    ap.add_argument("--update", help="comma-separated families to run again; with --write, the other rows are kept "
                                     "from the table there")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # run one family in this process, print its outcome as JSON
    ap.add_argument("--plain", help=argparse.SUPPRESS)  # the same with torch.compile(backend="aot_eager") alone
    ap.add_argument("--forward", help=argparse.SUPPRESS)  # the forward alone through dualkv (run_forward)
    ap.add_argument("--cache", type=Path, help="JSON lines of outcomes already run (read, then appended to)")
    ap.add_argument("--timeout", type=float, default=TIME_LIMIT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.one or args.plain or args.forward:
        try:
            r = run_family(args.one) if args.one else run_plain(args.plain) if args.plain else run_forward(args.forward)
        except Exception:
            traceback.print_exc()
            raise
        print(json.dumps(dataclasses.asdict(r)), flush=True)
        return 0
    names = args.only.split(",") if args.only else families()
    cached = {}
    if args.update:
        if not args.write or args.only:
            ap.error("--update needs --write (the table whose other rows it keeps) and no --only")
        again = set(args.update.split(","))
        kept = _read_outcomes(args.write)
        cached = {f: o for f, o in kept.items() if f not in again}
    if args.cache and args.cache.exists():
        for line in args.cache.read_text().splitlines():
            o = Outcome(**json.loads(line))
            cached[o.family] = o
    results = []
    for name in names:
        r = cached.get(name) or _run_in_subprocess(name, args.timeout)
        if name not in cached and args.cache:
            with args.cache.open("a") as f:
                f.write(json.dumps(dataclasses.asdict(r)) + "\n")
        results.append(r)
        print(f"{r.family:28s} {r.seconds:6.1f}s {r.params:>9d} {r.attn:6s} {r.outcome}: {r.detail}", flush=True)
    if args.write:
        if args.only:
            ap.error("--write needs every family (no --only)")
        write_table(results, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
