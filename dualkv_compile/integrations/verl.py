"""dualkv in veRL 0.9's FSDP engine (``FSDPEngineWithLMHead``): one config line.

    actor_rollout_ref.model.external_lib=dualkv_compile.integrations.verl

veRL imports ``external_lib`` in every worker when it builds the model config (``HFModelConfig.__post_init__``);
importing this module calls ``enable()``, which replaces ``FSDPEngineWithLMHead.forward_step`` for the process. In
a loop of your own, call ``dualkv_compile.integrations.verl.enable(**options)`` (options as for the backend)
before the engine's first step.

Assumes veRL's remove-padding path (``use_remove_padding=True``, its default): its own ``prepare_model_inputs``
still builds the row of back-to-back sequences, the labels rolled by one and the pad size. Guarantees: the model
call and the log-prob and entropy computation run as one ``torch.compile(..., backend="dualkv")`` graph, the
backbone on the packed stream (each shared prompt once), the log-probs picked at veRL's rolled labels
(``gather_unpacked``), only per-token values leaving the graph; the result goes back into veRL's flow (un-padding,
nested tensors, loss, outputs) unchanged and equals veRL's own path to rounding (docs/design.md, semantics 14).
Under veRL's Ulysses (``ulysses_sequence_parallel_size > 1``) every rank of its sp group takes the whole row (veRL
slices it only after) and dualkv splits the packed stream over that group itself (``sequence_parallel``), the values
whole on every rank, the gradients in veRL's convention. What it leaves to veRL (a value head,
``use_remove_padding=False``, ``use_fused_kernels``, Ulysses on a vision-language model, top-k distillation,
``calculate_sum_pi_squared``, multimodal inputs, a per-sample temperature) runs veRL's ``forward_step``, the reason
logged once. Sharing is found within a micro-batch: with ``use_dynamic_bsz`` the
engine's ``prepare_micro_batches`` is replaced too, its budget and count rules kept, so that rows with equal prompts
land in one micro-batch (``layout.micro_batches``; ``last_micro_batches()`` explains the last plan). The lm_head
inside its FSDP unit, the math against veRL's, the micro-batch settings: docs/design.md, "Trainer integrations".
"""

from __future__ import annotations

import contextvars
import functools
import logging
from contextlib import contextmanager, nullcontext
from typing import Any, Optional

import torch

from ..backend import dualkv_backend
from ..config import DualKVConfig
from ..layout.micro_batches import MicroBatches, balance_micro_batches, min_micro_batches, prompt_groups
from ..shared_batch import shared_batch
from .hf_checkpointing import checkpoint_inside_hooks

log = logging.getLogger("dualkv_compile")

__all__ = ["enable", "disable", "last_micro_batches", "log_probs_and_entropy", "sdpa_for_flash_attention"]

_STATE: dict[str, Any] = {"original": None, "prepare": None, "batch": None, "options": {}, "config": DualKVConfig(),
                          "declined": set(), "micro_batches": None}
# The engine whose forward_backward_batch is running (prepare_micro_batches is a module function: it is not told).
_ENGINE: contextvars.ContextVar = contextvars.ContextVar("dualkv_verl_engine", default=None)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """veRL's entropy: ``logsumexp(z) - sum(softmax(z) * z)`` over the vocabulary."""
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def log_probs_and_entropy(module, input_ids, position_ids, rolled, temperature: float, calculate_entropy: bool):
    """The compiled region: the model on veRL's remove-padding row, then per-token log-probs (and entropy).

    ``input_ids``/``position_ids`` ``[1, T]``; ``rolled`` ``[T]`` (the labels); returns ``[T]`` tensors."""
    logits = module(input_ids=input_ids, attention_mask=None, position_ids=position_ids, use_cache=False).logits
    return _from_logits(logits, rolled, temperature, calculate_entropy)


def _from_logits(logits, rolled, temperature: float, calculate_entropy: bool):
    logits = logits.squeeze(0)
    if temperature != 1.0:
        logits = logits / temperature
    # veRL's entropy reads the logits in their own dtype; under its autocast softmax and logsumexp run in float32
    # anyway, so reading the float32 copy the log-softmax reads gives the same values, and one value for the
    # fusion to take whole (log-probs and entropy from the lm_head in chunks).
    logits = logits.float()
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, rolled.unsqueeze(-1)).squeeze(-1)
    return log_probs, (entropy_from_logits(logits) if calculate_entropy else None)


# Causal LMs whose forward is ``lm_head(model(...).last_hidden_state)`` and nothing more for veRL's call (no logit
# softcap or scale): their backbone and lm_head are called apart (``_ScoringForward``).
_PLAIN_HEADS = frozenset({"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})


class _ScoringForward:
    """The engine module's ``forward`` while the compiled call runs: the model's own forward, then the log-probs and
    entropy (``log_probs_and_entropy``). They run inside the root FSDP unit's forward, so the lm_head and the
    log-softmax land in one graph (fused, in chunks) instead of ``[T, V]`` logits crossing FSDP's root hook.
    One object per engine: Dynamo guards on the attribute's identity."""

    def __init__(self, module, original):
        self.module, self.original = module, original
        plain = getattr(getattr(module, "config", None), "model_type", None) in _PLAIN_HEADS
        self.split = plain and callable(getattr(module, "get_decoder", None)) and callable(getattr(module, "get_output_embeddings", None))

    def __call__(self, input_ids, position_ids, rolled, temperature, calculate_entropy):
        if not self.split:
            return log_probs_and_entropy(self.original, input_ids, position_ids, rolled, temperature, calculate_entropy)
        # The backbone is a call of its own (FSDP's per-layer hooks break it into graphs, and Dynamo then resumes
        # this frame after it): the lm_head must be called here, in the frame that computes the log-probs, for the
        # two to share a graph. Through the model's forward the [T, V] logits would cross that break.
        # veRL shards the lm_head as an FSDP unit of its own (when untied): its hooks break the graph around its call
        # too, so the log-probs are computed inside its forward (``_LogProbHead``, installed with this one).
        hidden = self.module.get_decoder()(input_ids=input_ids, attention_mask=None, position_ids=position_ids,
                                           use_cache=False).last_hidden_state
        return self.module.get_output_embeddings()(hidden, rolled, temperature, calculate_entropy)


class _LogProbHead:
    """The lm_head's ``forward`` while the compiled call runs: ``linear`` on its (unsharded) weight, then the
    log-probs and entropy, in the frame (and the FSDP unit) of the lm_head."""

    def __init__(self, head):
        self.head = head

    def __call__(self, hidden, rolled, temperature, calculate_entropy):
        logits = torch.nn.functional.linear(hidden, self.head.weight, self.head.bias)
        return _from_logits(logits, rolled, temperature, calculate_entropy)


@contextmanager
def _instance_forward(module, forward):
    """``module.forward`` is ``forward`` inside the block, then what it was (an instance attribute or the class's)."""
    had, previous = "forward" in module.__dict__, module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if had:
            module.forward = previous
        else:
            del module.forward


@contextmanager
def _scoring_forward(engine):
    module = engine.module
    wrappers = engine.__dict__.get("_dualkv_forwards")
    if wrappers is None:  # once per engine: Dynamo guards on the attributes' identity
        wrapper = _ScoringForward(module, module.forward)
        head = module.get_output_embeddings() if wrapper.split else None
        wrappers = engine.__dict__["_dualkv_forwards"] = (wrapper, head, _LogProbHead(head) if head is not None else None)
    wrapper, head, head_forward = wrappers
    with _instance_forward(module, wrapper):
        if head is None:
            yield
        else:
            with _instance_forward(head, head_forward):
                yield


def _call_module(module, **kwargs):
    return module(**kwargs)


@contextmanager
def sdpa_for_flash_attention(module):
    """``flash_attention_2`` (veRL's default) reads as ``sdpa`` while the compiled call traces and runs.

    dualkv matches SDPA's and eager attention in the graph and replaces either with its kernel on the packed
    stream; FlashAttention's varlen call is opaque to it. A graph dualkv refuses then runs SDPA, exact (HF
    separates the sequences of the row by their restarting position ids) but with a ``[T, T]`` mask."""
    config = getattr(module, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl != "flash_attention_2":
        yield
        return
    config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = impl


def _decline(reason: str, what: str = "forward_step") -> None:
    if (what, reason) not in _STATE["declined"]:
        _STATE["declined"].add((what, reason))
        log.info("dualkv (veRL): this step runs veRL's own %s: %s", what, reason)


def _why_not(engine, micro_batch) -> Optional[str]:
    """What leaves a (micro-)batch's step to veRL's ``forward_step``, None if nothing."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead

    if isinstance(engine, FSDPEngineWithValueHead):
        return "a value head (the critic's outputs are values, not log-probs)"
    if _sp_group(engine) is not None and hasattr(_unwrapped(engine.module).config, "vision_config"):
        return "veRL's Ulysses on a vision-language model (its inputs sliced after the embedding)"

    def flag(key, default=False):
        return tu.get_non_tensor_data(data=micro_batch, key=key, default=default)

    if not flag("use_remove_padding", True):
        return "use_remove_padding is off"
    for key in ("use_fused_kernels", "distillation_use_topk", "distillation_only", "calculate_sum_pi_squared"):
        if flag(key):
            return f"{key} is on"
    if len(micro_batch.get("multi_modal_inputs", [])):
        return "multimodal inputs"
    if isinstance(micro_batch["temperature"], torch.Tensor):
        return "a per-sample temperature tensor"
    return None


def _autocast_dtype(engine) -> torch.dtype:
    """The dtype veRL's ``forward_step`` autocasts to (float32: no autocast), as veRL reads it."""
    return getattr(engine, "_autocast_dtype", torch.bfloat16)


def _logits_dtype(engine) -> torch.dtype:
    autocast_dtype = _autocast_dtype(engine)
    return autocast_dtype if autocast_dtype != torch.float32 else next(engine.module.parameters()).dtype


def _unwrapped(module):
    return getattr(module, "module", module)


def _sp_group(engine):
    """veRL's Ulysses sequence-parallel group (its device mesh's ``sp`` dimension), None without Ulysses."""
    if not getattr(engine, "use_ulysses_sp", False):
        return None
    return engine.ulysses_device_mesh["sp"]


@contextmanager
def _whole_rows(engine):
    """veRL's ``prepare_model_inputs`` and ``_gather_and_unpad_packed`` as without Ulysses: the whole row on every
    rank of the sp group (each holds the micro-batch before veRL would slice it), for dualkv to split itself."""
    if not getattr(engine, "use_ulysses_sp", False):
        yield
        return
    engine.use_ulysses_sp = False
    try:
        yield
    finally:
        engine.use_ulysses_sp = True


def _compiled(engine):
    fn = engine.__dict__.get("_dualkv_compiled")
    if fn is None:
        # veRL switches Hugging Face checkpointing on and shards each layer: on transformers that checkpoint a
        # layer's __call__ (hooks included) its layers would never be compiled, so never packed.
        checkpoint_inside_hooks(engine.module)
        options = dict(_STATE["options"])
        group = _sp_group(engine)
        if group is not None:  # dualkv's Ulysses over veRL's group (what veRL's own would have used)
            if options.get("sequence_parallel") is not None:
                raise ValueError("options['sequence_parallel']: veRL's Ulysses group is used under "
                                 "ulysses_sequence_parallel_size > 1; leave the option unset")
            options["sequence_parallel"] = group
        fn = torch.compile(
            functools.partial(_call_module, engine.module),
            backend=functools.partial(dualkv_backend, options=options),
            dynamic=True,
        )
        # Dynamo does not specialise FSDP2's modules: under dynamic=True their int attributes (an MoE router's
        # top_k) would enter each layer's graph as symbols, and a layout rule needs them as numbers (a symbolic
        # top_k is no provable divisor of the routing's sort). They are constants of the model: specialised.
        fn = torch._dynamo.config.patch(specialize_int=True)(fn)
        engine.__dict__["_dualkv_compiled"] = fn
    return fn


def _forward_step(engine, micro_batch, loss_function, forward_only):
    """``FSDPEngineWithLMHead.forward_step`` with the model and its log-probs/entropy as one dualkv graph."""
    why = _why_not(engine, micro_batch)
    if why is not None:
        _decline(why)
        return _STATE["original"](engine, micro_batch, loss_function, forward_only)
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_id, get_device_name

    micro_batch = micro_batch.to(get_device_id())
    with _whole_rows(engine):
        model_inputs, output_args = engine.prepare_model_inputs(micro_batch=micro_batch)
    # veRL divides by its per-token temperature cast to the logits' dtype: the same number, as a Python float.
    temperature = float(torch.tensor(float(micro_batch["temperature"])).clamp(min=1e-8).to(_logits_dtype(engine)))
    calculate_entropy = bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False))
    autocast_dtype = _autocast_dtype(engine)
    autocast = nullcontext() if autocast_dtype == torch.float32 else torch.autocast(get_device_name(), dtype=autocast_dtype)
    # FSDP2's hooks break the model's graph at every sharded module, and the piece that embeds the ids sees them
    # as a positional argument: the layout is detected here, from the row veRL built (shared_batch).
    cfg = _STATE["config"]
    batch = shared_batch(model_inputs["input_ids"], None, model_inputs["position_ids"], group_size=cfg.group_size,
                         min_shared=cfg.min_shared)
    with batch, autocast, sdpa_for_flash_attention(engine.module), _scoring_forward(engine):
        log_probs, entropy = _compiled(engine)(
            input_ids=model_inputs["input_ids"], position_ids=model_inputs["position_ids"],
            rolled=output_args["input_ids_rmpad_rolled"], temperature=temperature, calculate_entropy=calculate_entropy,
        )
        pad, offsets = output_args["pad_size"], micro_batch["input_ids"].offsets()
        with _whole_rows(engine):  # the values come back whole on every rank of the sp group: only the pad goes
            unpad = functools.partial(engine._gather_and_unpad_packed, pad_size=pad)
            model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(unpad(log_probs), offsets)}
            if calculate_entropy:
                model_output["entropy"] = torch.nested.nested_tensor_from_jagged(unpad(entropy), offsets)
        if loss_function is not None:
            loss, metrics = loss_function(model_output=model_output, data=micro_batch, dp_group=engine.get_data_parallel_group())
        else:
            if not forward_only:
                raise ValueError("forward_step: loss_function is None, which veRL allows only with forward_only=True")
            loss, metrics = torch.tensor(1.0, device=get_device_name()), {}
    detached = {k: v.detach() for k, v in model_output.items()}
    return loss, {"model_output": detached, "loss": loss.detach().item(), "metrics": metrics}


def _prompt_lengths(data) -> Optional[list[int]]:
    """Each row's prompt tokens, as veRL's ``no_padding_2_padding`` reads them (nested ``prompts``, or the
    attention mask over the ``prompts`` columns); None where the batch has neither."""
    prompts, mask = data.get("prompts", None), data.get("attention_mask", None)
    if isinstance(prompts, torch.Tensor) and prompts.is_nested:
        return prompts.offsets().diff().tolist()
    if isinstance(prompts, torch.Tensor) and isinstance(mask, torch.Tensor) and not mask.is_nested:
        return mask[:, : prompts.shape[1]].sum(1).tolist()
    return None


def _prepare_micro_batches(data, dp_group=None, num_batches_divided_by=None, same_micro_num_in_dp=True,
                           min_num_micro_batch=None, use_dynamic_bsz_balance=True):
    """veRL's ``prepare_micro_batches`` (``verl.workers.engine.utils``) with ``use_dynamic_bsz``: its budget
    (``max_token_len_per_gpu`` x sp valid tokens) and its count rules (the data-parallel ranks' maximum), over whole
    groups (``layout.micro_batches``); returns veRL's pair, the micro-batches and the row indices that restore the
    order. Without ``use_dynamic_bsz``, or for a batch whose steps run veRL's ``forward_step``, veRL's own."""
    from verl.utils import tensordict_utils as tu

    kwargs = dict(dp_group=dp_group, num_batches_divided_by=num_batches_divided_by,
                  same_micro_num_in_dp=same_micro_num_in_dp, min_num_micro_batch=min_num_micro_batch,
                  use_dynamic_bsz_balance=use_dynamic_bsz_balance)
    engine = _ENGINE.get()
    if engine is None or not tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
        return _STATE["prepare"](data, **kwargs)
    sp = int(tu.get_non_tensor_data(data=data, key="sp_size", default=1))
    ids, prompts = data["input_ids"], _prompt_lengths(data)
    why = _why_not(engine, data) or (
        "force_group_size > 1" if tu.get_non_tensor_data(data=data, key="force_group_size", default=1) > 1 else None
    ) or ("input_ids are not nested" if not ids.is_nested else None) or (
        "no prompts to group the rows by" if prompts is None else None)
    if why is not None:
        _decline(why, "token-balanced micro-batches (it may split a group)")
        return _STATE["prepare"](data, **kwargs)
    lengths = ids.offsets().diff().tolist()
    groups, shared = prompt_groups(ids.values(), lengths, prompts)
    budget = int(data["max_token_len_per_gpu"]) * sp
    count, rows = min_micro_batches(lengths, groups, budget, shared=shared), len(lengths)
    if min_num_micro_batch is not None:
        count = max(count, min_num_micro_batch)
    if torch.distributed.is_initialized() and same_micro_num_in_dp and dp_group is not None:
        from verl.utils.device import get_device_name

        # One collective for both, before any rank may raise: the common count, and the fewest rows of a rank.
        agreed = torch.tensor([count, -rows], dtype=torch.long, device=get_device_name())
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=dp_group)
        count, rows = int(agreed[0]), -int(agreed[1])
    if num_batches_divided_by is not None:
        count = -(-count // num_batches_divided_by) * num_batches_divided_by
    if count > rows:
        raise ValueError(f"dynamic batch size: {count} micro-batches for the data-parallel ranks, a rank holds {rows} rows")
    plan = balance_micro_batches(lengths, groups, budget, shared=shared, count=count)
    _STATE["micro_batches"] = plan
    for kind in ("over the budget", "split across"):
        first = next((r for r in plan.reasons if kind in r), None)
        if first is not None and ("micro-batches", kind) not in _STATE["declined"]:
            _STATE["declined"].add(("micro-batches", kind))
            log.info("dualkv (veRL): dynamic batch size: %s (last_micro_batches().explain() has the plan)", first)
    return [tu.index_select_tensor_dict(data, list(part)) for part in plan.rows], [list(part) for part in plan.rows]


def _forward_backward_batch(engine, data, loss_function, forward_only=False):
    """The engine's own ``forward_backward_batch``, with the engine known to ``_prepare_micro_batches``."""
    token = _ENGINE.set(engine)
    try:
        return _STATE["batch"](engine, data, loss_function, forward_only)
    finally:
        _ENGINE.reset(token)


def last_micro_batches() -> Optional[MicroBatches]:
    """The last plan the dynamic batch sizing made in this process (``.explain()`` says why), None before any."""
    return _STATE["micro_batches"]


def enable(**options: Any) -> None:
    """Route every ``FSDPEngineWithLMHead`` of this process through dualkv (module docstring); idempotent.

    ``options``: as ``torch.compile(..., backend="dualkv", options=...)``; ``ValueError`` names a bad one."""
    config = DualKVConfig.from_options(dict(options))  # validate now, not at the first step
    import verl.workers.engine.fsdp.transformer_impl as impl

    _STATE["options"], _STATE["config"] = dict(options), config
    if _STATE["original"] is None:
        _STATE["original"] = impl.FSDPEngineWithLMHead.forward_step
        impl.FSDPEngineWithLMHead.forward_step = _forward_step
        # The engine's forward_backward_batch reads prepare_micro_batches from its module's globals at each call;
        # the engine's own (FSDPEngine's) runs inside ours, which tells it the engine.
        _STATE["prepare"], impl.prepare_micro_batches = impl.prepare_micro_batches, _prepare_micro_batches
        _STATE["batch"] = impl.FSDPEngineWithLMHead.forward_backward_batch
        impl.FSDPEngineWithLMHead.forward_backward_batch = _forward_backward_batch
        log.info("dualkv (veRL): FSDPEngineWithLMHead.forward_step runs the model and its log-probs through dualkv; "
                 "dynamic batch sizing keeps each prompt's rows in one micro-batch")


def disable() -> None:
    """Restore veRL's ``forward_step`` and ``prepare_micro_batches``."""
    import verl.workers.engine.fsdp.transformer_impl as impl

    if _STATE["original"] is not None:
        impl.FSDPEngineWithLMHead.forward_step = _STATE["original"]
        impl.FSDPEngineWithLMHead.forward_backward_batch = _STATE["batch"]
        impl.prepare_micro_batches = _STATE["prepare"]
        _STATE["original"] = _STATE["prepare"] = _STATE["batch"] = None


# Imported by veRL as ``external_lib``: that import is the switch.
if __name__ != "__main__":
    try:
        import verl.workers.engine.fsdp.transformer_impl  # noqa: F401
    except ImportError:  # veRL not installed: enable() raises when called
        pass
    else:
        enable()
