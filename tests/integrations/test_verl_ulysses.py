"""veRL's engine under its own Ulysses (``ulysses_sequence_parallel_size > 1``) with dualkv: packed and exact.

Runs in ``make test-verl``. Each side is ``tests/integrations/verl_ulysses_rank.py`` on 2 or 4 gloo ranks (CPU):
veRL's own Ulysses path with dualkv off (its slicing, all-to-all and gather around a CPU stand-in kernel), and
the same engine with the one config line, where dualkv takes the whole row on every rank of veRL's sp group and
splits the packed stream over that group itself. Log-probs, entropy, loss and every parameter gradient must agree
within 1e-5 (float32) on every rank, each micro-batch packed to its prompts once plus the responses.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("verl", reason="veRL is installed in .venv-verl only: `make test-verl` runs this module")
from tests.integrations.verl_ulysses_rank import GROUPS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Valid tokens of each group of verl_ulysses_rank.GROUPS: 40, 41 and 31. A budget of 36 per rank is veRL's 72 per
# sp group of 2: the groups fit as {40, 31} and {41}, where veRL's own arrangement splits one.
BUDGET = 36


def _launch(tmp_path, name, world, sp, port, *flags):
    """``world`` ranks of verl_ulysses_rank.py; every rank's result."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    out = tmp_path / name
    procs = [subprocess.Popen([sys.executable, "-m", "tests.integrations.verl_ulysses_rank", str(out), "--sp", str(sp),
                               *flags], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(world)]
    errors = [p.communicate(timeout=900)[1] for p in procs]
    for p, err in zip(procs, errors):
        assert p.returncode == 0, err[-4000:]
    return [torch.load(f"{out}.{r}.pt", weights_only=False) for r in range(world)]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


CASES = [  # (model, world, sp, use_dynamic_bsz)
    ("qwen3", 2, 2, False),
    ("qwen3_moe", 2, 2, False),
    ("qwen3", 2, 2, True),
    ("qwen3_moe", 2, 2, True),
    ("qwen3", 4, 2, True),
    ("qwen3_moe", 4, 2, True),
]


@pytest.mark.parametrize("model,world,sp,dynamic", CASES, ids=[f"{m}-dp{w // s}xsp{s}{'-dynamic' if d else ''}"
                                                             for m, w, s, d in CASES])
def test_verl_ulysses_is_packed_and_exact(tmp_path, model, world, sp, dynamic):
    port = 29800 + 10 * CASES.index((model, world, sp, dynamic))
    flags = ["--model", model] + (["--dynamic-bsz", str(BUDGET)] if dynamic else [])
    plain = _launch(tmp_path, "plain", world, sp, port, *flags)
    dualkv = _launch(tmp_path, "dualkv", world, sp, port + 1, "--dualkv", *flags)
    # veRL's own path did run Ulysses: its kernel saw the heads split over the sp ranks.
    assert all(r["heads_seen"] == [4 // sp] for r in plain), [r["heads_seen"] for r in plain]
    for rank, (p, d) in enumerate(zip(plain, dualkv)):
        assert d["attn_implementation"] == "sdpa" and not d["unpacked"], d["reports"]
        # No graph with attention left unchanged (FSDP2's unspecialised modules once made an MoE layer's top_k a
        # symbol, and every Qwen3-MoE layer was refused).
        assert not [r for r in d["reports"] if "REFUSED" in r and " 0 attention" not in r], d["reports"]
        assert any("sequence parallel: " in r and "rewritten" in r for r in d["reports"]), d["reports"]
        groups = [set(p["group"][i] for i in part) for part in d.get("plan", [range(len(p["group"]))])]
        if dynamic:  # every group in one micro-batch; veRL's own arrangement used as many and split one
            assert sorted(i for part in d["plan"] for i in part) == list(range(len(p["group"])))
            assert sum(len(g) for g in groups) == 3 and len(d["plan"]) == len(p["outputs"]["loss"]) == 2, d["explain"]
        # Each micro-batch packed to its groups' prompts once plus their responses (the first layer's graph).

        assert [after for _, after in d["packed"]] == [sum(GROUPS[k][0] + sum(GROUPS[k][1]) for k in g) for g in groups], (d["packed"], groups)
        offsets = p["outputs"]["model_output"]["log_probs"].offsets()
        read = torch.ones(int(offsets[-1]), dtype=torch.bool)
        if dynamic:  # a row's last log-prob is read at the next row's first token, which the arrangement decides
            read[offsets[1:] - 1] = False
        for key in ("log_probs", "entropy"):
            a, b = (x["outputs"]["model_output"][key] for x in (p, d))
            assert b.offsets().equal(a.offsets()), key
            a, b = a.values(), b.values()
            a, b = (a[read], b[read]) if key == "log_probs" else (a, b)
            assert _rel(b, a) <= 1e-5, (rank, key)
        assert sum(d["outputs"]["loss"]) == pytest.approx(sum(p["outputs"]["loss"]), rel=1e-5)
        for name, g in p["grads"].items():
            assert _rel(d["grads"][name], g) <= 1e-5, (rank, name)
