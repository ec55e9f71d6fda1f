"""The example scripts run end to end with tiny settings and report equivalence."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", script), *args],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_demo_summary():
    out = run("demo.py", "--steps", "2")
    assert "demo: OK" in out
    assert "tokens" in out and "rho" in out and "speedup" in out and "max |grad diff|" in out


def test_grpo_tiny_summary():
    out = run("grpo_tiny.py", "--steps", "1", "--prompts", "1", "--rollouts", "4", "--max-new", "8", "--layers", "1",
              "--timing-reps", "1")
    assert "grpo_tiny: OK" in out
    assert "step 1/1" in out and "rho" in out and "speedup" in out and "max |grad diff|" in out


def test_hf_compile_summary():
    out = run("hf_compile.py", "--family", "llama", "--layers", "1", "--prompt-lens", "12,8", "--responses", "3")
    assert "hf_compile: OK" in out
    assert "rewritten" in out and "rho" in out


def test_verl_style_batch_summary():
    out = run("verl_style_batch.py", "--layers", "1", "--max-prompt-length", "16", "--max-response-length", "8")
    assert "verl_style_batch: OK" in out
    assert "rewritten" in out and "position_ids" in out


@pytest.mark.parametrize("form", ["roll", pytest.param("slice-masked", marks=pytest.mark.slow)])
def test_verl_style_batch_remove_padding(form):
    """veRL's use_remove_padding: the shuffled rows' valid tokens in one row, packed by the backend."""
    out = run("verl_style_batch.py", "--remove-padding", "--rmpad-form", form, "--layers", "1",
              "--max-prompt-length", "16", "--max-response-length", "8")
    assert "verl_style_batch: OK" in out
    assert "rows shuffled" in out and "input_ids [1, " in out and "no attention mask" in out
    tokens = re.search(r"(\d+) with padding -> (\d+) after remove padding -> (\d+) packed \(rho ([\d.]+)x\)", out)
    assert tokens, out
    padded, unpadded, packed, rho = int(tokens[1]), int(tokens[2]), int(tokens[3]), float(tokens[4])
    assert padded > unpadded > packed and rho > 1.5
    assert re.search(r"8 sequences in 2 trees of depth 2", out)
    calls = re.search(r"1 graph\(s\): 1 rewritten, 0 refused; (\d+) of (\d+) calls of rewritten graphs ran packed", out)
    assert calls and int(calls[1]) == int(calls[2]) >= 1, out
    if form == "slice-masked":
        assert "next-token log-probs computed from the lm_head in chunks" in out


def test_fsdp_grpo_mfu_counts_each_side_on_its_flops():
    """The example's MFU, on the GPU benchmarks' FLOP model (6 FLOPs per linear parameter per token plus 14 x
    head_dim x heads per attention pair per layer): the baseline and dualkv on the duplicated batch's (logical)
    FLOPs, dualkv also on its packed ones; a sequence-parallel group of 2 ranks shares one batch, so each rank is
    credited half of it."""
    from types import SimpleNamespace

    from benchmarks.model.model_gpu import flops
    from examples.fsdp_grpo_report import mfu

    cfg = {"hidden_size": 4, "num_hidden_layers": 2, "head_dim": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
           "intermediate_size": 6}
    per_token = 2 * (4 * 2 * 8 + 2 * 4 * 1 * 8 + 2 * 8 * 4 + 3 * 4 * 6) + 4 * 10  # q, k and v, o, MLP; lm_head
    stats = {"tokens_before": 1000, "tokens_after": 250, "attention_pairs_before": 8000, "attention_pairs_after": 1000}
    logical = 6 * per_token * 1000 + 14 * 8 * 2 * 2 * 8000
    executed = 6 * per_token * 250 + 14 * 8 * 2 * 2 * 1000
    assert flops(cfg, SimpleNamespace(**stats), vocab=10) == pytest.approx((logical, executed))
    rank = {"stats": stats, "flops": {"logical": logical, "executed": executed}, "plain": {"ms": 4.0}, "dualkv": {"ms": 1.0}}
    got = mfu({"sp": 2, "ranks": [rank, rank]}, peak_tflops=1e-9)  # 1,000 FLOP/s a GPU
    assert got["plain_logical"] == pytest.approx(logical / 2 / 4e-3 / 1e3)
    assert got["dualkv_logical"] == pytest.approx(logical / 2 / 1e-3 / 1e3)
    assert got["dualkv_executed"] == pytest.approx(executed / 2 / 1e-3 / 1e3)
