"""veRL 0.9's own FSDP engine for one forward/backward on CPU, with and without dualkv.

    make test-verl                                  # builds .venv-verl (veRL 0.9.1), runs this both ways and compares
    .venv-verl/bin/python examples/verl_engine_step.py OUT.pt [--dualkv] [--attn sdpa] [--bf16]

With ``--dualkv`` the engine's model config carries ``external_lib="dualkv_compile.integrations.verl"``,
the one line a veRL user adds (``actor_rollout_ref.model.external_lib=dualkv_compile.integrations.verl``).

Builds ``FSDPEngineWithLMHead`` (FSDP2, one gloo rank) over a tiny random Qwen3 saved to a temporary
directory, turns a GRPO-shaped batch (2 prompts x 3 responses, left/right padded) into veRL's
remove-padding form with veRL's own ``left_right_2_no_padding``, and runs
``engine.forward_backward_batch`` with a loss on the log-probs and the entropy. Saves the loss, the
log-probs, the entropy and every parameter gradient (and dualkv's report) to OUT.pt.

Two stubs, named: ``verl_cpu_platform`` (veRL 0.9 has no CPU platform), and veRL's TRL probe in its
monkey patch is answered "no TRL" (veRL 0.9.1 imports ``AutoModelForCausalLMWithValueHead``, which
TRL 1.16 no longer has). Everything else is veRL's code.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

GROUPS = [(7, [3, 5, 2]), (5, [4, 1, 6])]
VOCAB = 101


def grpo_batch(seed=0):
    """input_ids = [left-padded prompt | right-padded response], as veRL's rollout returns them."""
    g = torch.Generator().manual_seed(seed)
    P, R = max(p for p, _ in GROUPS), max(max(rs) for _, rs in GROUPS)
    rows = []
    for p, rs in GROUPS:
        prompt = torch.randint(1, VOCAB, (p,), generator=g)
        for r in rs:
            rows.append((prompt, torch.randint(1, VOCAB, (r,), generator=g)))
    B = len(rows)
    ids = torch.zeros(B, P + R, dtype=torch.long)
    mask = torch.zeros(B, P + R, dtype=torch.long)
    response_mask = torch.zeros(B, R, dtype=torch.long)
    for b, (prompt, resp) in enumerate(rows):
        ids[b, P - len(prompt):P], ids[b, P:P + len(resp)] = prompt, resp
        mask[b, P - len(prompt):P + len(resp)] = 1
        response_mask[b, :len(resp)] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return ids, mask, pos, response_mask


def loss_function(model_output, data, dp_group=None):
    """A GRPO-style token-mean loss with an entropy bonus, on veRL's nested log-probs and entropy.

    Normalised by the batch's token count (``batch_num_tokens``, which veRL's ``forward_backward_batch`` sets before
    it splits the batch), as veRL's own token-mean losses read it, so the gradient does not depend on how the batch is
    split into micro-batches (a micro-batch's own count would weight each micro-batch equally)."""
    from verl.workers.utils.padding import no_padding_2_padding

    logp = no_padding_2_padding(model_output["log_probs"], data)  # [B, R] at the response tokens
    entropy = no_padding_2_padding(model_output["entropy"], data)
    mask = data["response_mask"].float()
    adv = data["advantages"][:, None]
    per_token = -torch.exp(logp - logp.detach()) * adv - 0.01 * entropy
    loss = (per_token * mask).sum() / data["batch_num_tokens"]
    return loss, {"loss": loss.detach().item()}


def build_engine(config_kwargs: dict, *, dualkv: bool, attn: str, bf16: bool, checkpoint: bool = False,
                 inner: str = "aot_eager", seed: int = 0, fused: bool = False, sp: int = 1, model: str = "qwen3"):
    """veRL's ``FSDPEngineWithLMHead`` (FSDP2) over a random-weight Qwen3 saved from ``Qwen3Config(**config_kwargs)``,
    in train mode; with ``dualkv`` the model config carries the one line (``external_lib``); ``fused``: veRL's
    ``use_fused_kernels`` with its config's default ``impl_backend: torch`` (its chunked linear + log-prob + entropy;
    dualkv leaves such a step to veRL); ``sp``: veRL's ``ulysses_sequence_parallel_size``; ``model``: ``qwen3`` or
    ``qwen3_moe`` (``Qwen3MoeConfig``). Needs the process group (and, on CPU, ``verl_cpu_platform.install()``) first."""
    import transformers
    import verl.models.transformers.monkey_patch as monkey_patch

    monkey_patch.is_trl_available = lambda: False  # the second stub (module docstring)
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    path = tempfile.mkdtemp()
    prefix = {"qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}[model]
    cfg = getattr(transformers, f"{prefix}Config")(**config_kwargs, architectures=[f"{prefix}ForCausalLM"])
    torch.manual_seed(seed)
    if torch.distributed.get_rank() == 0:  # one copy of the weights, read by every rank
        getattr(transformers, f"{prefix}ForCausalLM")(cfg).save_pretrained(path)
    path = _shared_path(path)
    # What veRL does with actor_rollout_ref.model.external_lib: import it while building the model config.
    external_lib = "dualkv_compile.integrations.verl" if dualkv else None
    model_config = HFModelConfig(
        path=path, load_tokenizer=False, external_lib=external_lib, enable_gradient_checkpointing=checkpoint,
        override_config={"attn_implementation": attn}, use_fused_kernels=fused,
        fused_kernel_options={"impl_backend": "torch"} if fused else {},
    )
    engine = FSDPEngineWithLMHead(
        model_config, FSDPEngineConfig(
            strategy="fsdp2", use_torch_compile=False, ulysses_sequence_parallel_size=sp,
            mixed_precision=None if bf16 else {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        ), FSDPOptimizerConfig(lr=1e-3),
        CheckpointConfig(),
    )
    engine.initialize()
    if dualkv:
        import dualkv_compile.integrations.verl as dualkv_verl

        dualkv_verl.enable(inner=inner)
    engine.train_mode().__enter__()
    return engine


def _shared_path(path: str) -> str:
    """Rank 0's ``path`` on every rank (the weights it saved there), after it saved them."""
    if torch.distributed.get_world_size() == 1:
        return path
    paths = [path]
    torch.distributed.broadcast_object_list(paths, src=0)
    torch.distributed.barrier()
    return paths[0]


def verl_batch(ids, mask, pos, response_mask, micro_batch_size=None, fused=False):
    """The rollout batch in veRL's remove-padding form (its own ``left_right_2_no_padding``), as the engine reads it;
    ``fused``: the flag veRL's actor sets with ``use_fused_kernels`` (the engine must be built with it too)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    B = ids.shape[0]
    data = TensorDict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "response_mask": response_mask,
         "prompts": ids[:, : ids.shape[1] - response_mask.shape[1]], "responses": ids[:, ids.shape[1] - response_mask.shape[1]:],
         "advantages": torch.linspace(-1, 1, B, device=ids.device)},
        batch_size=[B],
    )
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(data, temperature=0.7, calculate_entropy=True, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=micro_batch_size or B, use_remove_padding=True, return_model_output=True,
                         use_fused_kernels=fused)
    return data


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dualkv", action="store_true")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--bf16", action="store_true", help="veRL's default mixed precision (bf16 parameters under FSDP2, "
                    "bf16 autocast) instead of float32 throughout")
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29541"), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.distributed.init_process_group("gloo")
    import verl_cpu_platform

    verl_cpu_platform.install()
    tiny = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    engine = build_engine(tiny, dualkv=args.dualkv, attn=args.attn, bf16=args.bf16)
    data = verl_batch(*grpo_batch())
    outputs = engine.forward_backward_batch(data, loss_function=loss_function, forward_only=False)
    result = {
        "outputs": outputs,
        "grads": {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone() for n, p in engine.module.named_parameters()},
        "attn_implementation": engine.module.config._attn_implementation,
    }
    if args.dualkv:
        import dualkv_compile

        reports = dualkv_compile.reports()
        result["reports"] = [str(r) for r in reports]
        # (packed calls, tokens before and after packing) of each graph that ran on the packed stream.
        result["packed"] = [(r.packed_calls, r.last_stats.tokens_before, r.last_stats.tokens_after) for r in reports if r.packed_calls]
        result["fused_log_probs"] = sum(r.fused_log_probs for r in reports)
        result["fused_entropy"] = sum(r.fused_entropy for r in reports)
        # Graphs dualkv rewrote that still ran some call unpacked (the lm_head's ran unpacked before the integration
        # published its layout as trusted: FSDP2's hooks hand the hidden states on through autograd functions).
        result["unpacked"] = [str(r) for r in reports if r.rewritten and r.packed_calls < r.calls]
    torch.save(result, args.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
