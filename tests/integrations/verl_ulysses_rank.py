"""One rank of veRL's FSDP engine under its Ulysses sequence parallelism, on CPU (gloo), with or without dualkv.

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.integrations.verl_ulysses_rank \
        OUT_PREFIX --sp S [--dualkv] [--model qwen3|qwen3_moe] [--dynamic-bsz TOKENS]

veRL's engine with ``ulysses_sequence_parallel_size = S`` over ``n`` ranks (``n / S`` data-parallel groups): each
data-parallel group reads its own batch of shuffled GRPO groups, the ranks of one sequence-parallel group the same
one (as veRL's dispatch gives them). Without dualkv the step is veRL's own Ulysses path: its input slicing, its
all-to-all around the attention kernel (``_ulysses_flash_attention_forward``, veRL's patch of transformers'
FlashAttention path), its gather of the outputs. FlashAttention does not run on a CPU, so the kernel under veRL's
all-to-all is a stand-in (``cpu_varlen_attention``: causal SDPA per sequence, the sequences read from the gathered
position ids, as FlashAttention's varlen path reads them); the model's ``attn_implementation`` is that name, which
routes through transformers' own ``flash_attention_forward``. With dualkv the engine's model config carries the
one line and the model runs SDPA (dualkv's packed stream, split over veRL's sp group by dualkv itself).
Saves ``OUT_PREFIX.<rank>.pt``: the outputs, each parameter's full gradient, dualkv's reports and packed counts.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "examples"), ROOT]

CPU_FLASH = "cpu_varlen_attention"
# (prompt length, response lengths) per group; data-parallel group d reads them from seed d, shuffled.
GROUPS = [(9, [4, 6, 3]), (6, [5, 2, 7, 3]), (12, [3, 4])]
HEADS_SEEN: set = set()  # the query heads each kernel call saw: H / sp under veRL's all-to-all
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
           norm_topk_prob=True, output_router_logits=False)


def cpu_flash_forward(query, key, value, attention_mask, query_length, is_causal=True, dropout=0.0,
                      position_ids=None, softmax_scale=None, **kwargs):
    """transformers' ``_flash_attention_forward`` contract (``[1, S, H, D]``, sequences restarting where position
    ids return to 0) by causal SDPA over each sequence; the reference kernel under veRL's all-to-all on a CPU."""
    if query.shape[0] != 1 or position_ids is None:
        raise ValueError("cpu_flash_forward: expected one packed row with its position ids")
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).flatten().tolist() + [pos.numel()]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [H, S, D]
    HEADS_SEEN.add(q.shape[0])
    out = []
    for a, b in zip(starts[:-1], starts[1:]):
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True, scale=softmax_scale, enable_gqa=True))
    return torch.cat(out, dim=1).transpose(0, 1)[None]


def install_cpu_flash() -> None:
    """``cpu_flash_forward`` as the kernel veRL's Ulysses wrapper calls, under an attention name of its own."""
    import verl.models.transformers.monkey_patch as monkey_patch
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    monkey_patch._flash_attention_forward = cpu_flash_forward
    AttentionInterface.register(CPU_FLASH, flash_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CPU_FLASH, flash_attention_mask)


def batch(seed: int):
    """veRL's [left-padded prompt | right-padded response] rows of GROUPS, shuffled by ``seed``; each row's group."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for k, (p, rs) in enumerate(GROUPS):
        prompt = torch.cat([torch.tensor([1 + k + 10 * seed]), torch.randint(30, 101, (p - 1,), generator=g)])
        rows += [(k, prompt, torch.cat([torch.tensor([60 + j]), torch.randint(30, 101, (r - 1,), generator=g)]))
                 for j, r in enumerate(rs)]
    return padded_rows([rows[i] for i in torch.randperm(len(rows), generator=g).tolist()])


def padded_rows(rows):
    """``[(group, prompt, response)]`` as veRL's rollout rows: ids, mask, position ids, response mask, groups."""
    P, R = max(len(p) for _, p, _ in rows), max(len(r) for _, _, r in rows)
    ids, mask = torch.zeros(len(rows), P + R, dtype=torch.long), torch.zeros(len(rows), P + R, dtype=torch.long)
    response_mask = torch.zeros(len(rows), R, dtype=torch.long)
    for b, (_, prompt, resp) in enumerate(rows):
        ids[b, P - len(prompt):P], ids[b, P:P + len(resp)] = prompt, resp
        mask[b, P - len(prompt):P + len(resp)] = 1
        response_mask[b, :len(resp)] = 1
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0), response_mask, [k for k, _, _ in rows]


def record_packed_steps() -> list:
    """A list that the engine's ``forward_step`` (dualkv's) fills with each micro-batch's (tokens before, after
    packing) in its first packed graph (the first layer's)."""
    import dualkv_compile
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    steps, step = [], FSDPEngineWithLMHead.forward_step

    def recorded(self, micro_batch, **kwargs):
        result = step(self, micro_batch, **kwargs)
        first = min((r for r in dualkv_compile.reports() if r.packed_calls), key=lambda r: r.graph_id)
        steps.append((first.last_stats.tokens_before, first.last_stats.tokens_after))
        return result

    FSDPEngineWithLMHead.forward_step = recorded
    return steps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--sp", type=int, required=True)
    ap.add_argument("--dualkv", action="store_true")
    ap.add_argument("--model", default="qwen3", choices=["qwen3", "qwen3_moe"])
    ap.add_argument("--dynamic-bsz", type=int, default=0, help="use_dynamic_bsz at this max_token_len_per_gpu")
    args = ap.parse_args(argv)
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    import verl_cpu_platform
    from verl.utils import tensordict_utils as tu
    from verl_engine_step import build_engine, loss_function, verl_batch

    verl_cpu_platform.install()
    if not args.dualkv:
        install_cpu_flash()
    tiny = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    if args.model == "qwen3_moe":
        tiny.update(MOE)
    engine = build_engine(tiny, dualkv=args.dualkv, attn="sdpa" if args.dualkv else CPU_FLASH, bf16=False,
                          sp=args.sp, model=args.model)
    ids, mask, pos, response_mask, group = batch(seed=rank // args.sp)
    data = verl_batch(ids, mask, pos, response_mask)
    if args.dynamic_bsz:
        tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=args.dynamic_bsz)
    steps = record_packed_steps() if args.dualkv else []
    outputs = engine.forward_backward_batch(data, loss_function=loss_function, forward_only=False)
    result = {"outputs": outputs, "group": group, "world": world, "sp": args.sp,
              "attn_implementation": engine.module.config._attn_implementation, "heads_seen": sorted(HEADS_SEEN),
              "grads": {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                        for n, p in engine.module.named_parameters()}}
    if args.dualkv:
        import dualkv_compile
        import dualkv_compile.integrations.verl as dualkv_verl

        reports = dualkv_compile.reports()
        result.update(reports=[str(r) for r in reports], packed=steps,
                      unpacked=[str(r) for r in reports if r.rewritten and r.packed_calls < r.calls])
        plan = dualkv_verl.last_micro_batches()
        if plan is not None:
            result.update(plan=plan.rows, explain=plan.explain())
    torch.save(result, f"{args.out}.{rank}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
