"""What one step of ``examples/fsdp_grpo.py`` runs: the model, the batch, the GRPO loss and the FSDP2 / DDP wrapping.

``build_model`` makes the Qwen3 of the command line's shape (the same random weights on every rank),
``make_batch`` a data rank's right-padded micro-batch with all rollouts of each prompt,
``LogProbPolicy`` the model with the log-probs computed in its forward (``--logprobs-in-model``),
``grpo_loss`` the clipped objective, ``wrap`` the FSDP2 (root or per layer) or DDP wrapping, and
``in_shared_batch`` the step inside ``dualkv_compile.shared_batch``.
"""

from __future__ import annotations

import torch

import dualkv_compile

PAD = 0


def build_model(args, device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    head_dim = args.hidden // args.heads
    cfg = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate or 2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=head_dim,
        max_position_embeddings=max(4096, args.prompt_len + args.response_len + 8), use_cache=False, pad_token_id=PAD,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)  # the same weights on every rank, as after a broadcast from rank 0
    model = Qwen3ForCausalLM(cfg).to(device).train()
    if args.checkpoint:
        # torch.utils.checkpoint around each layer: dualkv inlines the regions and keeps them recomputed.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # Up to transformers 5.22 a layer checkpoints its __call__, FSDP2's hooks included, and Dynamo then runs it
        # uncompiled: the checkpoint goes around the layer's forward instead (both sides; a no-op on newer ones).
        dualkv_compile.integrations.hf_checkpointing.checkpoint_inside_hooks(model)
    return model


def make_batch(args, rank, device):
    """Data rank ``rank``'s micro-batch: rows [prompt | response | pad], all rollouts of a prompt here, consecutive.

    Right-padded: no row starts with padding, so the plain side's fused SDPA never sees a query with every key
    masked (left-padded rows gave NaN gradients on CUDA), and the default positions (0, 1, ...) are each token's."""
    g = torch.Generator().manual_seed(1000 + rank)
    rows = []
    for _ in range(args.prompts):
        P = args.prompt_len if args.fixed_lengths else int(torch.randint(args.prompt_len // 2, args.prompt_len + 1, (1,), generator=g))
        prompt = torch.randint(1, args.vocab, (P,), generator=g)
        for _ in range(args.rollouts):
            R = args.response_len if args.fixed_lengths else int(torch.randint(1, args.response_len + 1, (1,), generator=g))
            rows.append((prompt, torch.randint(1, args.vocab, (R,), generator=g)))
    S = max(len(p) + len(r) for p, r in rows)
    B = len(rows)
    ids = torch.full((B, S), PAD)
    mask = torch.zeros(B, S, dtype=torch.long)
    resp = torch.zeros(B, S, dtype=torch.long)
    for b, (p, r) in enumerate(rows):
        P, n = len(p), len(p) + len(r)
        ids[b, :P], ids[b, P:n] = p, r
        mask[b, :n] = 1
        resp[b, P:n] = 1
    return {
        "input_ids": ids.to(device),
        "attention_mask": mask.to(device),
        "response_mask": resp.to(device),
        "old_logp": (torch.randn(B, S - 1, generator=g) * 0.1 - 5.0).to(device),
        "advantages": torch.randn(B, generator=g).to(device),
    }


class LogProbPolicy(torch.nn.Module):
    """The model with each next token's log-prob computed in its forward, as veRL's fused kernels return them.

    FSDP2's hooks run outside Dynamo, so on the module ``fully_shard`` wraps they break the graph: with the
    log-probs after the model's call, its ``[B, S, V]`` logits leave the model's graph unpacked (153 GiB at
    8 x 67K tokens and a 151,936-token vocabulary). Inside the wrapped forward, the lm_head, log-softmax and
    gather trace into the model's graph (one chunked op under dualkv) and only ``[B, S - 1]`` log-probs cross.

    The backbone and the lm_head are called from this forward, not through the causal LM's: with ``fully_shard``
    on each layer too, the graph breaks inside the backbone end Dynamo's trace of every frame around it, so the
    causal LM's own forward would run its lm_head in a graph of its own and return the logits to this frame's."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        hidden = self.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return next_token_log_probs(self.model.get_output_embeddings()(hidden), input_ids)


def next_token_log_probs(logits, input_ids):
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def token_log_probs(model, batch):
    if isinstance(model, LogProbPolicy):
        return model(batch["input_ids"], batch["attention_mask"])
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return next_token_log_probs(logits, batch["input_ids"])


def grpo_loss(model, batch, clip=0.2):
    logp = token_log_probs(model, batch)
    ratio = torch.exp(logp - batch["old_logp"])
    adv = batch["advantages"][:, None]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    mask = batch["response_mask"][:, 1:].float()
    return (per_token * mask).sum() / mask.sum()


def wrap(model, args, device):
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else MixedPrecisionPolicy()
    if args.per_layer:
        for layer in (model.model if isinstance(model, LogProbPolicy) else model).model.layers:
            fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def in_shared_batch(step, min_shared=1):
    """The step with the batch's layout detected once by the caller (``dualkv_compile.shared_batch``): under FSDP2
    per layer no graph of the model sees ``input_ids`` by name, and the first layer's would detect it from its
    hidden states on every call; the lm_head's graph sees the ids but no mask, and would count padding as tokens."""
    def run(model, batch):
        with dualkv_compile.shared_batch(batch["input_ids"], batch["attention_mask"], min_shared=min_shared):
            return step(model, batch)
    return run
