"""veRL 0.9's own FSDP engine with ``external_lib=dualkv_compile.integrations.verl``: packed and exact on CPU.

Runs in ``make test-verl`` (``.venv-verl``: veRL 0.9.1 over the suite's environment, see the Makefile);
under plain ``make test`` veRL is not installed and this module is skipped. Each side runs
``examples/verl_engine_step.py`` in a fresh process (one gloo rank, FSDP2 over every decoder layer).
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
