"""veRL 0.9's own FSDP engine with ``external_lib=dualkv_compile.integrations.verl``: packed and exact on CPU.

Runs in ``make test-verl`` (``.venv-verl``: veRL 0.9.1 over the suite's environment, see the Makefile);
under plain ``make test`` veRL is not installed and this module is skipped. Each side runs
``examples/verl_engine_step.py`` in a fresh process (one gloo rank, FSDP2 over every decoder layer); the dynamic
batch size test runs this module as that process (``python -m tests.integrations.test_verl OUT.pt [--dualkv]``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("verl", reason="veRL is installed in .venv-verl only: `make test-verl` runs this module")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")

# The balancer against veRL's own rearrange_micro_batches, collected here so that `make test-verl` runs it.
from tests.test_micro_batches import test_balance_within_a_factor_of_verls_rearrange_micro_batches  # noqa: E402,F401


def _run(tmp_path, *flags, port):
    out = tmp_path / f"step{'_'.join(f.strip('-') for f in flags) or '_plain'}.pt"
    env = dict(os.environ, MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "verl_engine_step.py"), str(out), *flags],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def test_engine_step_with_external_lib_is_packed_and_exact(tmp_path):
    plain = _run(tmp_path, port=29611)
    dualkv = _run(tmp_path, "--dualkv", port=29612)
    assert plain["attn_implementation"] == dualkv["attn_implementation"] == "sdpa"
    p_out, d_out = plain["outputs"]["model_output"], dualkv["outputs"]["model_output"]
    for key in ("log_probs", "entropy"):
        a, b = p_out[key], d_out[key]
        a, b = (a.values() if a.is_nested else a), (b.values() if b.is_nested else b)
        assert a.shape == b.shape and _rel(b, a) <= 1e-5, key
    assert dualkv["outputs"]["loss"] == pytest.approx(plain["outputs"]["loss"], rel=1e-5)
    assert plain["grads"].keys() == dualkv["grads"].keys()
    for name, g in plain["grads"].items():
        assert _rel(dualkv["grads"][name], g) <= 1e-5, name
    # Every decoder layer's graph (and the lm_head's) ran on the packed stream: 57 tokens -> 32.
    packed = dualkv["packed"]
    assert len(packed) >= 3 and all(after < before for _, before, after in packed), dualkv["reports"]
    assert not dualkv["unpacked"], dualkv["unpacked"]
    # The log-probs and the entropy come from the lm_head in chunks, inside its FSDP unit: no [T, V] logits.
    assert dualkv["fused_log_probs"] == 1 and dualkv["fused_entropy"] == 1, dualkv["reports"]


def test_engine_step_in_bfloat16_fuses_under_autocast(tmp_path):
    """veRL's default mixed precision (bf16 parameters under FSDP2, bf16 autocast around the step): the log-probs
    and the entropy are still fused with the lm_head, and dualkv's step agrees with the plain one to bf16's
    rounding (the tolerance of examples/fsdp_grpo.py's bf16 runs)."""
    plain = _run(tmp_path, "--bf16", port=29613)
    dualkv = _run(tmp_path, "--bf16", "--dualkv", port=29614)
    assert dualkv["fused_log_probs"] == 1 and dualkv["fused_entropy"] == 1 and not dualkv["unpacked"], dualkv["reports"]
    p_out, d_out = plain["outputs"]["model_output"], dualkv["outputs"]["model_output"]
    for key in ("log_probs", "entropy"):
        assert _rel(d_out[key].values(), p_out[key].values()) <= 5e-2, key
    for name, g in plain["grads"].items():
        assert _rel(dualkv["grads"][name], g) <= 5e-2, name


def test_gpu_benchmark_runs_both_sides_with_the_ray_stub(tmp_path):
    """``benchmarks/distributed/verl_engine_gpu.py``'s CPU smoke form, with ray replaced by its named stub (as on the
    GPU machine, where ray cannot be carried): both sides run veRL's engine with gradient checkpointing, the plain one
    on the ``torch_varlen`` attention (and profiled: that step is left out of its times), dualkv's packed with its
    log-probs and entropy fused; the comparison runs."""
    root = os.path.dirname(EXAMPLES)
    stubs = os.path.join(root, "benchmarks", "distributed", "verl_gpu_stubs")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([stubs, root]), OMP_NUM_THREADS="1")
    shape = ["--device", "cpu", "--layers", "1", "--hidden", "64", "--intermediate", "128", "--heads", "4",
             "--kv-heads", "2", "--head-dim", "16", "--vocab", "300", "--groups", "2", "--rollouts", "2",
             "--prompt-len", "12", "--response-len", "4", "--iters", "1", "--out", str(tmp_path)]
    script = os.path.join(root, "benchmarks", "distributed", "verl_engine_gpu.py")
    printed = {}
    for side, port, extra in (("plain", "29615", ["--profile"]), ("dualkv", "29616", [])):
        proc = subprocess.run([sys.executable, script, "--side", side, *shape, *extra], env=dict(env, MASTER_PORT=port),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        printed[side] = proc.stdout
    # --profile adds a step whose time is printed, not averaged: the step times are the 1 + --iters unprofiled ones
    profiled = re.findall(r"plain step \d+: ([0-9.]+) s \(profiled\)", printed["plain"])
    step_s = torch.load(tmp_path / "plain.pt", weights_only=False)["step_s"]
    assert len(profiled) == 1 and len(step_s) == 2 and float(profiled[0]) not in [round(t, 3) for t in step_s]
    assert (tmp_path / "profile_plain.txt").exists()
    proc = subprocess.run([sys.executable, script, "--compare", str(tmp_path), "--report", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "speedup" in proc.stdout, proc.stderr[-4000:]
    dualkv = torch.load(tmp_path / "dualkv.pt", weights_only=False)
    assert any("1 attention - rewritten" in r and "packed" in r for r in dualkv["reports"]), dualkv["reports"]
    assert any("entropy fused" in r for r in dualkv["reports"]), dualkv["reports"]
    assert "torch_varlen" in open(tmp_path / "verl_engine_gpu.md").read()


# Shuffled rows of 5 groups (prompt length, response lengths) under a budget of 72 valid tokens per micro-batch:
# the last group (85 valid tokens) is over it, a micro-batch of its own; the other four (40, 41, 31, 26) fit two by
# two. veRL's own rearrangement makes 4 micro-batches of it and splits groups.
DYNAMIC_GROUPS = [(9, [4, 6, 3]), (6, [5, 2, 7, 3]), (12, [3, 4]), (5, [6, 1, 4]), (14, [8, 7, 8, 6])]
BUDGET = 72


def dynamic_batch(seed=0):
    """[left-padded prompt | right-padded response] rows of DYNAMIC_GROUPS in a shuffled order, and each row's group.
    Prompts begin with their group's own token and a group's responses with tokens of their own, so the forest
    shares exactly each group's prompt."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for k, (p, rs) in enumerate(DYNAMIC_GROUPS):
        prompt = torch.cat([torch.tensor([1 + k]), torch.randint(10, 101, (p - 1,), generator=g)])
        rows += [(k, prompt, torch.cat([torch.tensor([50 + j]), torch.randint(10, 101, (r - 1,), generator=g)]))
                 for j, r in enumerate(rs)]
    from tests.integrations.verl_ulysses_rank import padded_rows

    return padded_rows([rows[i] for i in torch.randperm(len(rows), generator=g).tolist()])


def dynamic_bsz_step(out, dualkv):
    """One forward/backward of veRL's engine with ``use_dynamic_bsz=True`` at BUDGET; saves outputs, gradients and,
    with dualkv, its plan and each micro-batch's packed token count (the first layer's graph)."""
    sys.path[:0] = [EXAMPLES, os.path.dirname(EXAMPLES)]
    from verl_engine_step import build_engine, loss_function, verl_batch

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.distributed.init_process_group("gloo")
    import verl_cpu_platform
    from verl.utils import tensordict_utils as tu

    verl_cpu_platform.install()
    tiny = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    engine = build_engine(tiny, dualkv=dualkv, attn="sdpa", bf16=False)
    ids, mask, pos, response_mask, group = dynamic_batch()
    data = verl_batch(ids, mask, pos, response_mask)
    tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=BUDGET)
    packed = []
    if dualkv:
        import dualkv_compile
        import dualkv_compile.integrations.verl as dualkv_verl
        from tests.integrations.verl_ulysses_rank import record_packed_steps

        packed = record_packed_steps()
    outputs = engine.forward_backward_batch(data, loss_function=loss_function, forward_only=False)
    result = {"outputs": outputs, "group": group, "packed": packed,
              "grads": {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                        for n, p in engine.module.named_parameters()}}
    if dualkv:
        plan = dualkv_verl.last_micro_batches()
        result.update(plan=plan.rows, explain=plan.explain(), unpacked=[str(r) for r in dualkv_compile.reports()
                                                                        if r.rewritten and r.packed_calls < r.calls])
    torch.save(result, out)
    torch.distributed.destroy_process_group()


def test_dynamic_batch_size_keeps_groups_whole_packed_and_exact(tmp_path):
    """``use_dynamic_bsz=True`` at a budget that makes several micro-batches, rows of each prompt shuffled: dualkv's
    plan keeps every group in one micro-batch (the one over the budget alone), each micro-batch packs to its groups'
    prompts once plus their responses, and the log-probs, entropy (in the batch's order), loss and every gradient
    equal the engine's own, which splits groups, to 1e-5."""
    runs = {}
    for side, port in (("plain", 29617), ("dualkv", 29618)):
        out = tmp_path / f"dynamic_{side}.pt"
        env = dict(os.environ, MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-m", "tests.integrations.test_verl", str(out), *(["--dualkv"] if side == "dualkv" else [])],
                              env=env, cwd=os.path.dirname(EXAMPLES), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[side] = torch.load(out, weights_only=False)
    plain, dualkv = runs["plain"], runs["dualkv"]
    group, plan = dualkv["group"], dualkv["plan"]
    assert len(plan) == 3 and sorted(i for part in plan for i in part) == list(range(len(group))), dualkv["explain"]
    where = {}
    for m, part in enumerate(plan):
        for i in part:
            where.setdefault(group[i], set()).add(m)
    assert all(len(ms) == 1 for ms in where.values()), dualkv["explain"]
    assert [group[i] for i in plan[next(m for m, part in enumerate(plan) if group[part[0]] == 4)]] == [4] * 4
    assert "over the budget of 72: a micro-batch of its own" in dualkv["explain"]
    # veRL's own rearrangement: 4 micro-batches, of which the group of 85 valid tokens must be split over two.
    assert len(plain["outputs"]["loss"]) == 4
    # Each micro-batch packed to its groups' prompts once plus their responses: what the forest allows.
    expected = [sum(p + sum(rs) for k, (p, rs) in enumerate(DYNAMIC_GROUPS) if k in {group[i] for i in part}) for part in plan]
    assert [after for _, after in dualkv["packed"]] == expected and not dualkv["unpacked"], dualkv["packed"]
    p_out, d_out = plain["outputs"]["model_output"], dualkv["outputs"]["model_output"]
    offsets = p_out["log_probs"].offsets()
    # A row's last log-prob is read at veRL's label rolled over the whole micro-batch: the next row's first token,
    # which the arrangement decides (veRL's loss never reads it). Every other one is compared.
    read = torch.ones(int(offsets[-1]), dtype=torch.bool)
    read[offsets[1:] - 1] = False
    for key in ("log_probs", "entropy"):
        assert d_out[key].offsets().equal(offsets), key
        a, b = p_out[key].values(), d_out[key].values()
        a, b = (a[read], b[read]) if key == "log_probs" else (a, b)
        assert _rel(b, a) <= 1e-5, key
    assert sum(dualkv["outputs"]["loss"]) == pytest.approx(sum(plain["outputs"]["loss"]), rel=1e-5)
    for name, g in plain["grads"].items():
        assert _rel(dualkv["grads"][name], g) <= 1e-5, name


if __name__ == "__main__":
    dynamic_bsz_step(sys.argv[1], dualkv="--dualkv" in sys.argv[2:])
