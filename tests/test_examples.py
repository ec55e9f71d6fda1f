"""The example scripts run end to end with tiny settings and report equivalence."""

from __future__ import annotations

import os
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
    out = run("grpo_tiny.py", "--steps", "1", "--prompts", "1", "--rollouts", "4", "--max-new", "8")
    assert "grpo_tiny: OK" in out
    assert "step 1/1" in out and "rho" in out
