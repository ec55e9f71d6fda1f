"""The Gluon tuning tools of benchmarks/ (gluon_tune.py, gluon_pick.py, sm90_resources.py, attention.py's
--gluon-configs), on the CPU: what they parse, pick and record, without a GPU."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # benchmarks/ is a package of the repository

def test_sm90_resources_compiles_the_table_without_a_gpu():
    """The sm_90 resource report runs on this CPU machine (its own process: it patches Triton's driver).
    Every kernel is compiled with FMAs, even where Triton's default is off (as 3.10's will be)."""
    code = (
        "import json, sys; from benchmarks.tuning import sm90_resources as s; "
        "from dualkv_compile.kernels.triton.attention import HOPPER_CONFIGS; "
        "print(json.dumps(s.compile_kernels(HOPPER_CONFIGS[64], 64, 4, 2, 512)))"
    )
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="0")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    kernels = {r["kernel"]: r for r in json.loads(done.stdout.strip().splitlines()[-1])}
    assert set(kernels) == {"shared_prompt_fwd_kernel", "bwd_preprocess_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel"}
    for r in kernels.values():
        assert 0 < r["registers"] <= 255 and r["programs_per_sm"] >= 1
        assert r["fp_fusion"] is True, r["kernel"]
    # The table's streamed operands come through the copy engine inside the pipelined loops.
    for name in ("shared_prompt_fwd_kernel", "bwd_dkdv_kernel"):
        assert any(loop.get("UTMALDG") and loop.get("HGMMA") for loop in kernels[name]["loops"]), kernels[name]


def test_gluon_tune_parses_configs_and_names_what_is_wrong():
    from benchmarks.tuning import gluon_tune
    from dualkv_compile.kernels.gluon import attention as ga

    assert gluon_tune.parse_configs("dkdv", "dq_mode='atomic'; stages=3, block_m=64") == [
        ga.DkdvConfig(dq_mode="atomic"), ga.DkdvConfig(stages=3, block_m=64)]
    assert gluon_tune.parse_configs("fwd", "pingpong=True") == [ga.FwdConfig(pingpong=True)]
    assert gluon_tune.parse_configs("dq", "") == [ga.DqConfig()]
    with pytest.raises(ValueError, match=r"'block_k=64' is not field=value with a field of DqConfig"):
        gluon_tune.parse_configs("dq", "block_k=64")
    with pytest.raises(ValueError, match=r"the value of 'stages' is not a Python literal: 'three'"):
        gluon_tune.parse_configs("fwd", "stages=three")
    with pytest.raises(ValueError, match=r"DkdvConfig.dq_mode: expected one of"):
        gluon_tune.parse_configs("dkdv", "dq_mode='fused'")
    with pytest.raises(ValueError, match=r"kind: expected one of \['dkdv', 'dq', 'fwd'\], got 'bwd'"):
        gluon_tune.parse_configs("bwd", "")


_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(_SM90, reason="the refusal is for other machines; an sm_90 GPU runs the sweep")
def test_gluon_tune_refuses_a_machine_without_an_sm90_gpu():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tuning", "gluon_tune.py"), "dkdv", "stages=2"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "needs an sm_90 GPU (H100, H200)" in run.stderr, run.stderr[-2000:]


def _sweep(path, kind, configs, shapes_done=("a", "b")):
    """A ``gluon_tune.py --json`` file: ``configs`` as (text, {shape: ms}, max diff, is the default)."""
    with open(path, "w") as f:
        json.dump(dict(kind=kind, shapes_done=list(shapes_done), configs=[
            dict(text=t, default=d, ms=ms, diff={s: diff for s in ms}, errors={}) for t, ms, diff, d in configs]), f)
    return str(path)


def test_gluon_pick_takes_the_fastest_exact_config_of_each_kernel_and_leaves_out_defaults(tmp_path, capsys):
    """gluon_pick.py: per kernel the least geometric mean over the finished inputs among the configs within the
    tolerance (1e-2) of Triton; a faster inexact (or NaN: None) config, one missing a finished input and a kernel
    whose default wins are left out; the text is what attention.py --gluon-configs reads."""
    from benchmarks.tuning import gluon_pick
    from benchmarks.tuning import gluon_tune

    fwd = _sweep(tmp_path / "fwd.json", "fwd", [
        ("block_m=128, block_n=128, stages=2", {"a": 4.0, "b": 1.0}, 2e-3, True),   # gmean 2.0
        ("block_m=128, block_n=128, stages=3", {"a": 1.0, "b": 1.0}, 3e-2, False),  # fastest, not exact
        ("block_m=128, block_n=64, stages=3", {"a": 1.0, "b": 0.5}, None, False),   # a NaN
        ("block_m=128, block_n=128, stages=4", {"a": 1.0}, 0.0, False),             # no time for input b
        ("block_m=128, block_n=128, stages=2, pingpong=True", {"a": 2.0, "b": 1.5}, 5e-3, False)])  # gmean 1.73
    dq = _sweep(tmp_path / "dq.json", "dq", [
        ("block_m=128, block_n=64, stages=4", {"a": 1.0, "b": 1.0}, 0.0, True),
        ("block_m=128, block_n=64, stages=3", {"a": 0.9, "b": 1.2}, 0.0, False)])    # gmean 1.04
    # A sweep cut short: input b unfinished, so only a counts.
    dkdv = _sweep(tmp_path / "dkdv.json", "dkdv", [
        ("block_m=64, block_n=128, stages=2", {"a": 2.0, "b": 1.0}, 0.0, True),
        ("block_m=128, block_n=128, stages=2", {"a": 1.5}, 0.0, False)], shapes_done=["a"])
    assert gluon_pick.main([fwd, dq, dkdv, str(tmp_path / "missing.json")]) == 0
    out, err = capsys.readouterr()
    text = out.strip()
    assert text == "fwd: block_m=128, block_n=128, stages=2, pingpong=True; dkdv: block_m=128, block_n=128, stages=2"
    assert "dq: left out: the default is the fastest" in err and "missing.json: skipped" in err
    assert gluon_tune.parse_kernel_configs(text) == {
        "fwd": gluon_tune.ga.FwdConfig(pingpong=True), "dkdv": gluon_tune.ga.DkdvConfig(block_m=128)}
    # Nothing exact, or nothing finished: left out; nothing picked prints an empty line.
    assert gluon_pick.pick(json.load(open(fwd)), tol=1e-3)[0] is None
    assert gluon_pick.pick(dict(kind="dq", shapes_done=[], configs=[]))[1] == "no input finished"
    assert gluon_pick.main([dq]) == 0 and capsys.readouterr().out == "\n"


def test_attention_gluon_configs_are_parsed_applied_and_recorded(tmp_path, monkeypatch, capsys):
    """attention.py --gluon-configs: the named kernels' configs replace the table entries at --head-dim (the others
    stay), the report records them; a bad kernel, field, value or repeat is refused naming the option."""
    from benchmarks.ops import attention
    from benchmarks.tuning import gluon_tune
    from dualkv_compile.kernels.gluon import attention as ga

    def keep_tables():  # restored by monkeypatch.undo() and after the test
        for table in (ga.FWD_CONFIGS, ga.DQ_CONFIGS, ga.DKDV_CONFIGS):
            for d in list(table):
                monkeypatch.setitem(table, d, table[d])

    keep_tables()
    rec = gluon_tune.use_kernel_configs("fwd: block_m=128, block_n=64, stages=3; dkdv: block_n=128, stages=3", 64)
    assert ga.FWD_CONFIGS[64] == ga.FwdConfig(128, 64, 3) and ga.DKDV_CONFIGS[64] == ga.DkdvConfig(stages=3)
    assert ga.DQ_CONFIGS[64] == ga.DqConfig() and ga.FWD_CONFIGS[128] == ga.FwdConfig(128, 128, 2)
    assert rec == dict(fwd="block_m=128, block_n=64, stages=3", dq="block_m=128, block_n=64, stages=4",
                       dkdv="block_m=64, block_n=128, stages=3", head_dim=64, set=["dkdv", "fwd"])
    for text, msg in [("bwd: stages=3", r"--gluon-configs: 'bwd' is not a kernel: expected one of \['dkdv', 'dq', 'fwd'\]"),
                      ("stages=3", r"--gluon-configs: 'stages=3' names no kernel: expected 'kernel: field=value"),
                      ("dq: block_k=64", r"--gluon-configs: dq: .*'block_k=64' is not field=value with a field of DqConfig"),
                      ("fwd: stages=3.0", r"--gluon-configs: fwd: .*stages=3.0: expected int for FwdConfig.stages"),
                      ("dq: stages=3; dq: stages=2", r"--gluon-configs: kernel 'dq' is given twice"),
                      (" ; ", r"--gluon-configs: no kernel in")]:
        with pytest.raises(ValueError, match=msg):
            gluon_tune.parse_kernel_configs(text)
    with pytest.raises(ValueError, match=r"--gluon-configs: head dim 96 has no Gluon configs: expected --head-dim"):
        gluon_tune.use_kernel_configs("dq: stages=3", 96)
    # The script: refused with a usage error; accepted, recorded in the JSON and the Markdown (no method runs).
    monkeypatch.undo()
    keep_tables()
    with pytest.raises(SystemExit) as e:
        attention.main(["--device", "cpu", "--gluon-configs", "dq: block_k=64"])
    assert e.value.code == 2 and "--gluon-configs: dq:" in capsys.readouterr().err
    assert attention.main(["--device", "cpu", "--shapes", "2,8,4", "--methods", "none", "--out", str(tmp_path),
                           "--stem", "t", "--head-dim", "64", "--gluon-configs", "dq: stages=2"]) == 0
    meta = json.load(open(tmp_path / "t.json"))["meta"]
    assert meta["gluon_configs"]["dq"] == "block_m=128, block_n=64, stages=2" and meta["gluon_configs"]["set"] == ["dq"]
    assert ("- Gluon launch configs at D=64 (--gluon-configs set dq): fwd: block_m=128, block_n=128, stages=2; "
            "dq: block_m=128, block_n=64, stages=2; dkdv: block_m=128, block_n=128, stages=2"
            in (tmp_path / "t.md").read_text())
