"""dualkv under DDP and FSDP2 on CPU (2 processes, gloo): parity with the plain path, split-group detection, the example.

Each test spawns two ranks; assertions run inside the ranks (a failure there
fails ``mp.spawn`` with the rank's traceback). The model is the tiny Qwen3 of
the backend tests (2 layers, hidden 32), one thread per rank.
"""

from __future__ import annotations

import copy
import functools
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available")

from tests.gloo_ranks import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, *args):
    spawn(fn, *args, world=WORLD)


def _rank_batch(rank):
    """Each rank its own groups, every rollout of a prompt on one rank."""
    from tests.helpers import grpo_batch

    groups = [[(7, [3, 5, 4, 2])], [(6, [2, 4]), (5, [3, 1, 2])]][rank]
    return grpo_batch(groups, 101, seed=10 + rank)


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _step(model, ids, mask):
    """Logits at valid positions and a scalar loss through them, backward done."""
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    valid = mask.bool()
    proj = torch.randn(logits.shape[-1], generator=torch.Generator().manual_seed(1))
    loss = (logits[valid] @ proj).square().mean()
    loss.backward()
    return logits[valid].detach(), loss.detach()


def _local_grads(model):
    return {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) for n, p in model.named_parameters()}


def _check_parity(rank, wrap, expect_packed, expect_reason=None, tol=1e-5, per_layer=False):
    import dualkv_compile
    from dualkv_compile.backend import dualkv_backend
    from tests.helpers import hf_model

    torch._dynamo.reset()
    base = hf_model("qwen3", "sdpa", layers=2)
    plain, ours = wrap(copy.deepcopy(base)), wrap(base)
    compiled = torch.compile(ours, backend=functools.partial(dualkv_backend, options={"inner": "aot_eager"}))
    ids, mask, _ = _rank_batch(rank)
    start = len(dualkv_compile.reports())
    out, loss = _step(compiled, ids, mask)
    ref_out, ref_loss = _step(plain, ids, mask)
    assert rel(out, ref_out) <= tol
    assert rel(loss, ref_loss) <= tol
    a, b = _local_grads(ours), _local_grads(plain)
    assert a.keys() == b.keys()
    for name in b:
        assert (a[name] is None) == (b[name] is None), name
        if b[name] is not None and b[name].numel():
            assert rel(a[name], b[name]) <= tol, (name, rel(a[name], b[name]))
    # The reduction really happened: the gradient is the mean over ranks, not this rank's own.
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, loss.item())
    assert gathered[0] != gathered[1]
    reports = dualkv_compile.reports()[start:]
    packed = [r for r in reports if r.rewritten and r.packed_calls >= 1]
    if expect_packed:
        assert packed and packed[0].last_stats.rho > 1.5, [str(r) for r in reports]
    elif expect_packed is not None:
        assert not any(r.packed_calls for r in reports), [str(r) for r in reports]
    if expect_reason is not None:
        assert any(expect_reason in (r.reason or "") for r in reports), [r.reason for r in reports]
    if per_layer:
        # One graph per decoder layer call (the same graph for both layers), each call packed: the first on a
        # layout detected from its hidden states and mask, the second on it, carried; the lm_head's graph too.
        layers = [r for r in reports if r.num_attention]
        assert layers and all(r.rewritten for r in layers), [str(r) for r in reports]
        assert sum(r.packed_calls for r in layers) == 2, [str(r) for r in reports]
        assert any(r.layout_source and r.layout_source.startswith("carried from graph") for r in layers), [str(r) for r in reports]
        assert any(not r.num_attention and r.packed_calls for r in reports), [str(r) for r in reports]


def _ddp(model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model)


def _fsdp(model, per_layer=False, bf16=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    if per_layer:
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp_policy)
    return fully_shard(model, mp_policy=mp_policy)


def _ddp_and_fsdp_worker(rank):
    # DDP, one gradient bucket (tiny model): one graph, packed.
    _check_parity(rank, _ddp, expect_packed=True)
    # FSDP2 on the root: the whole forward is one graph, packed; gradients are reduce-scattered shards.
    _check_parity(rank, _fsdp, expect_packed=True)
    # FSDP2 per layer: its hooks run outside Dynamo, a graph break around every layer; no graph but the loss's
    # holds the token ids, so the layer graphs pack on a layout detected from their inputs and carried.
    _check_parity(rank, functools.partial(_fsdp, per_layer=True), expect_packed=True, per_layer=True)


def _split_ddp_worker(rank):
    # DDP with several buckets: Dynamo's DDP optimizer splits the graph, the pieces lack input_ids. Exact; pieces
    # that a layout can be carried to run packed, and a refused piece's reason names the fix.
    dist._DEFAULT_FIRST_BUCKET_BYTES = 1024
    split_ddp = lambda m: __import__("torch.nn.parallel", fromlist=["DistributedDataParallel"]).DistributedDataParallel(m, bucket_cap_mb=0.01)
    _check_parity(rank, split_ddp, expect_packed=None, expect_reason="optimize_ddp = False")
    with torch._dynamo.config.patch(optimize_ddp=False):
        _check_parity(rank, split_ddp, expect_packed=True)


def _fsdp_bf16_worker(rank):
    # FSDP2 with bf16 parameters in forward/backward and fp32 gradient reduction: parity at bf16 precision
    # (both paths run in bf16; measured relative differences are about 1e-2).
    _check_parity(rank, functools.partial(_fsdp, bf16=True), expect_packed=True, tol=4e-2)
    # The same per layer: every layer still packed (the shared copies stay bitwise equal in bf16).
    _check_parity(rank, functools.partial(_fsdp, per_layer=True, bf16=True), expect_packed=True, per_layer=True, tol=4e-2)


def test_ddp_and_fsdp2_parity():
    """Loss, logits and every (local shard of every) gradient equal the plain DDP / FSDP2 step within 1e-5.

    FSDP2 (fully_shard) runs on CPU with gloo in the installed torch. With
    fully_shard on the decoder layers too (FSDP2 hooks are
    torch._dynamo.disable'd, a graph break per layer) every layer's graph
    and the lm_head's run packed, on a layout carried from graph to graph.
    """
    _spawn(_ddp_and_fsdp_worker)


@pytest.mark.slow  # the suite's time; `make test-slow` runs it
def test_ddp_split_by_buckets_parity():
    """DDP with several buckets (Dynamo's DDP optimizer splits the graph): exact, packed once optimize_ddp is off."""
    _spawn(_split_ddp_worker)


@pytest.mark.slow  # the suite's time budget; `make test-slow` runs it
def test_fsdp2_bf16_mixed_precision_parity():
    """FSDP2 with bf16 mixed precision, on the root and per layer: packed, parity at bf16 precision (4e-2)."""
    _spawn(_fsdp_bf16_worker)


def _split_worker(rank):
    from dualkv_compile.distributed import check_groups_on_rank
    from tests.helpers import grpo_batch

    # Kept on one rank: rank 0 holds prompt A (4 rows), rank 1 prompt B (3 rows).
    ids, mask, _ = [grpo_batch([(7, [3, 5, 4, 2])], 101, seed=1), grpo_batch([(6, [2, 4, 3])], 101, seed=2)][rank]
    report = check_groups_on_rank(ids, mask)
    assert report.ok and report.world_size == 2 and report.rank == rank, str(report)

    # Prompt A's four rollouts split 3 + 1 over the ranks: found, with each rank's row count.
    a_ids, a_mask, _ = grpo_batch([(7, [3, 5, 4, 2])], 101, seed=1)
    b_ids, b_mask, _ = grpo_batch([(6, [2, 4, 3])], 101, seed=2)
    if rank == 0:
        ids, mask = a_ids[:3], a_mask[:3]
    else:  # the fourth rollout of A, then prompt B's rows, padded to one width
        S = max(a_ids.shape[1], b_ids.shape[1])
        pad = lambda t: torch.nn.functional.pad(t, (0, S - t.shape[1]))
        ids, mask = torch.cat([pad(a_ids[3:]), pad(b_ids)]), torch.cat([pad(a_mask[3:]), pad(b_mask)])
    report = check_groups_on_rank(ids, mask)
    assert len(report.split) == 1, str(report)
    s = report.split[0]
    assert s.rows_per_rank == {0: 3, 1: 1} and s.prefix_len == 7, str(s)

    # A 1 + 1 split (one row per rank) has no shared prefix on either rank: found only with response_mask.
    ids, mask = a_ids[rank : rank + 1], a_mask[rank : rank + 1]
    assert check_groups_on_rank(ids, mask).ok
    resp = torch.zeros_like(mask)
    resp[0, mask[0].nonzero().flatten()[7:]] = 1
    report = check_groups_on_rank(ids, mask, response_mask=resp)
    assert [s.rows_per_rank for s in report.split] == [{0: 1, 1: 1}], str(report)


def test_split_group_detection():
    _spawn(_split_worker)


def test_check_groups_single_process_and_bad_argument():
    from dualkv_compile.distributed import check_groups_on_rank
    from tests.helpers import grpo_batch

    ids, mask, _ = grpo_batch([(7, [3, 5])], 101)
    report = check_groups_on_rank(ids, mask)
    assert report.ok and report.world_size == 1 and report.local_groups == 1
    with pytest.raises(ValueError, match="response_mask"):
        check_groups_on_rank(ids, mask, response_mask=mask[:, 1:])


# The example's three modes under torchrun, in `make test-slow` (the suite's time budget);
# test_ddp_and_fsdp2_parity checks the parity of each in-process in `make test`.
@pytest.mark.parametrize(
    "extra",
    [pytest.param(x, marks=pytest.mark.slow) for x in (
        [], ["--checkpoint"], ["--per-layer"], ["--sp", "2", "--per-layer"],
        ["--sp", "2", "--baseline", "ulysses", "--logprobs-in-model", "--fixed-lengths"],
    )],
    ids=["plain", "checkpoint", "per_layer", "sp2_per_layer", "sp2_against_ulysses"],
)
def test_example_fsdp_grpo_torchrun(tmp_path, extra):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
        os.path.join(ROOT, "examples", "fsdp_grpo.py"), "--device", "cpu", "--mode", "fsdp", "--iters", "1", "--out", str(tmp_path),
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "fsdp_grpo: OK" in proc.stdout
    assert "[rank 0] layout:" in out and "[rank 1] layout:" in out
    assert (tmp_path / "fsdp_grpo.json").exists() and (tmp_path / "fsdp_grpo.md").exists()
    import json

    summary = json.loads((tmp_path / "fsdp_grpo.json").read_text())
    assert summary["parity"] and summary["packed_on_every_rank"] and len(summary["ranks"]) == 2
    # --checkpoint: per-layer activation checkpointing, still rewritten and packed on every rank.
    assert summary["checkpoint"] == ("--checkpoint" in extra) and summary["per_layer"] == ("--per-layer" in extra)
