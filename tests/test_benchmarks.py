"""The benchmark scripts: a CPU smoke run of the whole-model one and the merge of its runs into one table, the
peers, the profiles and the other tools (the Gluon tuning tools: test_benchmarks_gluon.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # benchmarks/ is a package of the repository

from benchmarks.model import model_gpu  # noqa: E402


def _run_json(path, meta, rows):
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f)
    return str(path)


@pytest.mark.slow  # a subprocess compiling both variants (~2 min on 2 cores); the model-variant tests cover the path
def test_model_gpu_smoke_on_cpu(tmp_path):
    """The script runs both variants on a tiny model and reports dualkv as packed."""
    cmd = [sys.executable, "benchmarks/model/model_gpu.py", "--device", "cpu", "--models", "tiny", "--shapes", "4,64,16",
           "--reps", "1", "--out", str(tmp_path)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(tmp_path / "model_gpu.json") as f:
        (row,) = json.load(f)["rows"]
    assert row["dualkv_packed"] is True
    assert isinstance(row["dualkv_ms"], float) and isinstance(row["baseline_ms"], float)
    assert row["tokens_after"] < row["tokens_before"]
    assert "| qwen3-tiny | (4, 64, 16) |" in (tmp_path / "model_gpu.md").read_text()


def test_merge_keeps_full_batch_baseline_apart(tmp_path):
    """A later run's columns fill an earlier row; a full-batch baseline does not replace the micro-batched one."""
    meta = {"device": "X", "device_gb": 100.0, "torch": "t", "triton": "t", "transformers": "t", "date": "d",
            "reps": 5, "baseline_max_tokens": 32768, "dtype": "torch.bfloat16"}
    base = dict(model="m", batch="(8, 1024, 4096)", rho=2.0, ideal=1.9, tokens_before=40960, tokens_after=20480)
    a = _run_json(tmp_path / "a.json", meta, [dict(base, baseline_ms=800.0, baseline_gb=40.0, baseline_mb=2)])
    b = _run_json(tmp_path / "b.json", meta, [dict(base, baseline_ms=780.0, baseline_gb=80.0, baseline_mb=1)])
    c = _run_json(tmp_path / "c.json", meta, [dict(base, dualkv_ms=400.0, dualkv_gb=30.0)])
    rows, _ = model_gpu.merge([a, b, c])
    (row,) = rows
    assert (row["baseline_ms"], row["baseline_gb"], row["baseline_mb"]) == (800.0, 40.0, 2)
    assert (row["baseline_full_ms"], row["baseline_full_gb"]) == (780.0, 80.0)
    assert row["dualkv_ms"] == 400.0
    # saved 1 - 30/80 = 0.625 of a goal of 0.8 x (1 - 1/2) = 0.4
    assert model_gpu.memory_goal(row, meta) == f"{0.625 / 0.4:.2f}"
    # The same runs in the other order give the same row.
    rows2, _ = model_gpu.merge([b, a, c])
    assert rows2 == rows


def test_memory_goal_is_a_bound_where_the_full_batch_ran_out_of_memory():
    meta = {"device_gb": 100.0}
    row = dict(rho=4.0, dualkv_gb=40.0, baseline_full_ms="OOM", baseline_mb=4, baseline_gb=50.0)
    # at least 1 - 40/100 = 0.6 saved, goal 0.8 x 0.75 = 0.6
    assert model_gpu.memory_goal(row, meta) == ">= 1.00"
    assert model_gpu.memory_goal(dict(row, baseline_full_ms=None), meta) == "-"


def test_merge_orders_rows_by_model_then_shape(tmp_path):
    meta = {"device": "X", "date": "d"}
    row = lambda model, batch: dict(model=model, batch=batch, rho=2.0, ideal=1.9, tokens_before=2, tokens_after=1)  # noqa: E731
    a = _run_json(tmp_path / "a.json", meta, [row("qwen3-8b (4 layers)", "groups"), row("qwen3-1.7b", "(8, 1024, 4096)")])
    b = _run_json(tmp_path / "b.json", meta, [row("qwen3-1.7b", "(16, 4096, 1024)"), row("qwen3-0.6b", "groups")])
    rows, _ = model_gpu.merge([a, b])
    assert [(r["model"], r["batch"]) for r in rows] == [
        ("qwen3-0.6b", "groups"), ("qwen3-1.7b", "(16, 4096, 1024)"), ("qwen3-1.7b", "(8, 1024, 4096)"),
        ("qwen3-8b (4 layers)", "groups"),
    ]


def test_parameter_count_matches_the_model_it_builds():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    for name, vocab in (("tiny", model_gpu.TINY_VOCAB), ("0.6b", model_gpu.VOCAB)):
        cfg = model_gpu.MODELS[name]
        with torch.device("meta"):
            model = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, use_cache=False, **cfg))
        assert model_gpu.parameter_count(cfg, vocab) == sum(p.numel() for p in model.parameters())


def test_estimated_full_batch_memory_and_its_goal():
    meta = {"dtype": "torch.bfloat16", "device_gb": 100.0}
    static = model_gpu.parameter_count(model_gpu.MODELS["0.6b"]) * 4 / 2**30
    row = dict(model="qwen3-0.6b", batch="(8, 1024, 4096)", rho=4.0, baseline_mb=4, baseline_gb=static + 10.0, dualkv_gb=8.0)
    est = model_gpu.estimated_full_gb(row, meta)
    assert abs(est - (static + 40.0)) < 1e-9
    goal = (1 - 8.0 / est) / 0.6
    assert model_gpu.memory_goal(row, meta) == f"est. {goal:.2f}"
    # a full batch that ran out of memory: the bound, with the estimate beside it
    assert model_gpu.memory_goal(dict(row, baseline_full_ms="OOM"), meta) == f">= {(1 - 8.0 / 100) / 0.6:.2f} (est. {goal:.2f})"
    # a measured full batch wins over both
    assert model_gpu.memory_goal(dict(row, baseline_full_gb=50.0), meta) == f"{(1 - 8.0 / 50) / 0.6:.2f}"
    # one micro-batch, or an unknown model: nothing to scale
    assert model_gpu.estimated_full_gb(dict(row, baseline_mb=1), meta) is None
    assert model_gpu.estimated_full_gb(dict(row, model="other"), meta) is None


def test_attention_report_gives_each_method_its_efficiency_against_cudnn():
    """The attention report's "vs cuDNN" column: SDPA-cuDNN's fwd+bwd time on the duplicated batch over the
    method's time times the ideal ratio (issue 20's measure). Here 8.0 / (5.0 * 2.0) = 0.8 and
    8.0 / (2.5 * 2.0) = 1.6; without a cuDNN row the column stays empty. "vs cuDNN from idle" is the same
    ratio over the times from an idle GPU."""
    from benchmarks.ops import attention as bench

    def row(method, mode, ms, case="c"):  # from an idle GPU: each time plus 1 ms of host work
        return dict(method=method, mode=mode, ms=ms, ms_idle=ms + 1.0, tflops=1.0, status="ok", peak_gb=None, note="",
                    case=case)

    meta = dict(device="cpu", torch="x", triton="x", cuda=None, date="d", hq=4, hkv=2, d=64, dtype="bf16",
                cuda_timing=False)
    cases = [dict(case="c", N=2, P=8, R=4, T=16, ideal_ratio=2.0), dict(case="nocudnn", N=2, P=8, R=4, T=16,
                                                                      ideal_ratio=2.0)]
    rows = [row("sdpa_cudnn_dup", "fwd", 2.0), row("sdpa_cudnn_dup", "fwd+bwd", 8.0),
            row("dualkv_triton", "fwd", 1.0), row("dualkv_triton", "fwd+bwd", 5.0),
            row("dualkv_gluon", "fwd", 1.0), row("dualkv_gluon", "fwd+bwd", 2.5),
            row("dualkv_gluon", "fwd", 1.0, "nocudnn"), row("dualkv_gluon", "fwd+bwd", 2.5, "nocudnn"),
            row("varlen_dup", "fwd", 1.0), row("varlen_dup", "fwd+bwd", 10.0)]
    lines = bench.markdown(dict(meta=meta, cases=cases, rows=rows)).splitlines()
    table = [ln for ln in lines if ln.startswith("| ")]
    assert table[0].split(" | ")[6] == "vs cuDNN"
    cells = {ln.split(" | ")[0][2:]: ln.split(" | ")[6] for ln in table[:7] if not ln.startswith("| ---")}
    # varlen_dup runs the duplicated batch as cuDNN does: 8.0 / 10.0, no ideal ratio
    assert cells == {"method": "vs cuDNN", "sdpa_cudnn_dup": "", "dualkv_triton": "0.800", "dualkv_gluon": "1.600",
                     "varlen_dup": "0.800"}
    assert table[-1].split(" | ")[6] == ""  # the case without a cuDNN row
    # From an idle GPU: 9.0 / (6.0 * 2.0) = 0.75 and 9.0 / (3.5 * 2.0) = 1.286.
    idle = {ln.split(" | ")[0][2:]: ln.split(" | ")[9].rstrip(" |") for ln in table[:7] if not ln.startswith("| ---")}
    assert idle == {"method": "vs cuDNN from idle", "sdpa_cudnn_dup": "", "dualkv_triton": "0.750",
                    "dualkv_gluon": "1.286", "varlen_dup": "0.818"}


def test_torch_varlen_attention_matches_each_sequence_alone():
    """The baseline's attention (``benchmarks/ops/varlen_attention.py``, registered with transformers as
    ``torch_varlen``): on veRL's remove-padding row each sequence attends causally within itself, as the model on
    that sequence alone; on a padded batch every valid position's logits equal SDPA's (the CPU loop; the GPU path
    is torch's varlen flash attention)."""
    import copy

    from benchmarks.ops import varlen_attention  # noqa: F401  (registers torch_varlen)

    from tests.helpers import grpo_batch, hf_model
    from tests.rewrite.test_gather_unpacked import remove_padding_row

    model = hf_model("qwen3", "sdpa")
    varlen = copy.deepcopy(model)
    varlen.config._attn_implementation = "torch_varlen"
    ids, pos, _ = remove_padding_row([(9, [3, 5, 2]), (6, [4, 1])], seed=3)
    bounds = (pos[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
    alone = torch.cat([model(input_ids=ids[:, s:e]).logits for s, e in zip(bounds[:-1], bounds[1:])], 1)
    torch.testing.assert_close(varlen(input_ids=ids, position_ids=pos).logits, alone, rtol=1e-5, atol=1e-5)
    ids, mask, pos = grpo_batch([(7, [3, 5, 2]), (5, [4, 1])], vocab=101, left_pad=2, right_pad=1)
    want = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[mask.bool()]
    got = varlen(input_ids=ids, attention_mask=mask, position_ids=pos).logits[mask.bool()]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_torch_varlen_attention_names_a_mask_it_cannot_read():
    from benchmarks.ops import varlen_attention

    q = torch.zeros(2, 4, 3, 8)
    with pytest.raises(ValueError, match=r"expected no mask or a \[B, S\] = \[2, 3\] 0/1 mask, got \(2, 1, 3, 3\)"):
        varlen_attention.torch_varlen_attention(None, q, q, q, torch.ones(2, 1, 3, 3))


@pytest.mark.slow  # a minute on 2 cores: its path (varlen attention, @policy_loss) is covered by the tests above
def test_model_remove_padding_compares_with_the_strongest_baseline_on_cpu(tmp_path):
    """``model_remove_padding.py``'s CPU smoke form: the varlen baseline, dualkv with nothing shared and dualkv give
    one loss, dualkv packs, and the speedup is reported against the strongest baseline."""
    cmd = [sys.executable, "benchmarks/model/model_remove_padding.py", "--device", "cpu", "--model", "tiny", "--groups", "2",
           "--rollouts", "3", "--prompt", "24", "--response", "8", "--reps", "1", "--skip-weak", "--out", str(tmp_path)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(tmp_path / "model_remove_padding.json") as f:
        rows = json.load(f)["rows"]
    assert [r["variant"] for r in rows][0].startswith("remove padding, torch varlen") and len(rows) == 3
    assert max(abs(r["loss"] - rows[0]["loss"]) for r in rows) <= 1e-4 * abs(rows[0]["loss"])
    assert rows[-1]["packed_calls"] > 0
    assert "Speedup against the strongest baseline" in (tmp_path / "model_remove_padding.md").read_text()


def test_step_profile_sorts_kernels_into_kinds_by_name():
    from benchmarks.probes.step_profile import kind_of

    assert kind_of("ncclDevKernel_AllToAll_RING_LL") == "communication"
    assert kind_of("_attn_fwd_gluon_kernel") == "attention"
    assert kind_of("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == "matrix products"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32") == "matrix products"
    assert kind_of("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "Inductor / Triton fused"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, FillFunctor>") == "copies and fills"
    assert kind_of("some_unknown_kernel") == "other"


def test_sync_sites_counts_sync_warnings_by_site_and_passes_others_through():
    """SyncSites groups torch's sync-debug warnings by the calling site (the innermost frame), counts each, and lets
    every other warning reach the usual filters."""
    import warnings

    from benchmarks.probes.step_profile import SYNC_WARNING, SyncSites

    def reads_a_device_value():
        warnings.warn(f"called a {SYNC_WARNING}", UserWarning)

    with warnings.catch_warnings(record=True) as others:
        warnings.simplefilter("always")
        with SyncSites() as sites:
            for _ in range(3):
                reads_a_device_value()
            warnings.warn("something else", UserWarning)
    assert list(sites.counts.values()) == [3], sites.counts
    (site,) = sites.counts
    assert "reads_a_device_value" in site and "test_benchmarks.py" in site, site
    assert [str(w.message) for w in others] == ["something else"]
    text = sites.markdown("side", steps=3)
    assert "synchronising CUDA calls per step: 1" in text and "| 1 | " in text, text


def _run_peers(tmp_path, *flags):
    """``peers.py`` on CPU, 2 prompts of 16 tokens x 3 responses of 6, one timed step: (its JSON, rows by side)."""
    cmd = [sys.executable, "benchmarks/peers/peers.py", "--device", "cpu", "--groups", "2", "--rollouts", "3", "--prompt-len",
           "16", "--response-len", "6", "--iters", "1", "--threads", "1", "--out", str(tmp_path), *flags]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(tmp_path / "peers.json") as f:
        run = json.load(f)
    return run, {r["side"]: r for r in run["rows"]}


def test_peers_smoke_on_cpu(tmp_path):
    """``peers.py`` on a tiny model and a ragged batch: dualkv packs and is exact against the plain model (float32);
    every other side either ran, with a step time, and matches the plain model too, or says why it cannot run
    (flash-pref and TRL's FlashAttention-3 kernel do not run here: see the script's docstring)."""
    _, rows = _run_peers(tmp_path, "--ragged", "--profile", "dualkv")
    profile = (tmp_path / "profile_dualkv.md").read_text()  # --profile: the side's step under torch.profiler
    assert "### Profile: dualkv" in profile and "dualkv::attention" in profile, profile[:2000]
    assert not (tmp_path / "profile_plain_varlen.md").exists()
    assert {"plain", "plain_varlen", "dualkv", "prefix_grouper", "trl_prefix_tree", "trl_prefix_tree_standin",
            "flash_pref"} == set(rows)
    dualkv = rows["dualkv"]
    assert dualkv["status"] == "ok" and dualkv["packed"] is True, dualkv
    assert dualkv["grad_rel"] < 1e-4 and dualkv["loss_rel"] < 1e-4, dualkv
    assert dualkv["tokens"] < rows["plain"]["tokens"]
    for name, r in rows.items():
        if r["status"] == "ok":
            assert isinstance(r["ms"], float) and r["ms"] > 0, r
            if name != "plain":
                assert r["grad_rel"] < 1e-4 and r["loss_rel"] < 1e-4, r
        else:
            assert r["status"].startswith("cannot run: ") and len(r["status"]) > len("cannot run: ") + 5, r
    assert rows["trl_prefix_tree_standin"]["status"] == "ok" and rows["trl_prefix_tree_standin"]["packed"] is True
    assert "| dualkv | ok | True |" in (tmp_path / "peers.md").read_text()
    # Against the strongest baseline: plain_varlen runs the valid tokens only, the padded plain more.
    assert rows["plain_varlen"]["ideal"] == 1.0 and rows["plain"]["ideal"] < 1.0 < rows["dualkv"]["ideal"]


def test_peers_tiny_moe_is_exact_and_its_flop_columns_match_a_hand_count(tmp_path):
    """``peers.py --shape tiny-moe`` (model_moe.py's tiny MoE, 2 layers) on 2 prompts of 16 tokens x 3 responses of 6:
    every side that ran is exact against plain (float32, 1e-5), and the FLOP columns equal a count by hand."""
    run, rows = _run_peers(tmp_path, "--shape", "tiny-moe")
    assert run["meta"]["moe"] and run["meta"]["reference"] == "plain"
    for name in ("plain", "plain_varlen", "dualkv", "prefix_grouper", "trl_prefix_tree_standin"):
        assert rows[name]["status"] == "ok", rows[name]
    for name, r in rows.items():
        if r["status"] == "ok" and name != "plain":
            assert r["grad_rel"] < 1e-5 and r["loss_rel"] < 1e-5, r
    assert rows["dualkv"]["packed"] is True

    # By hand. Per token and layer: q, k, v, o projections 64*4*16 + 2*64*2*16 + 4*16*64 = 12288; top-2 of 8 experts,
    # 3 matrices of 64 x 32 each, 12288, and the router 64*8 = 512; 2 layers, plus lm_head 64*512 = 32768.
    per_token = 2 * (12288 + 12288 + 512) + 32768
    assert per_token == 82944
    flops = lambda tokens, pairs: 6 * per_token * tokens + 3.5 * 4 * pairs * 16 * 4 * 2  # noqa: E731 (fwd+bwd)
    # 6 sequences of 22 tokens: 132 tokens, 6 * 22*23/2 = 1518 pairs, padded (plain) or not (plain_varlen).
    # Shared once (dualkv, PrefixGrouper): 2*16 + 6*6 = 68 tokens; pairs 2 * 16*17/2 + 6 * (17 + ... + 22) = 272 + 702.
    # TRL's trie forks one token early (a node is keyed on its next token): 2*15 + 6*7 = 72 tokens, each attending its
    # depth + 1 keys: 2 * 15*16/2 + 6 * (16 + ... + 22) = 240 + 798.
    expected = {"plain": (132, 1518), "plain_varlen": (132, 1518), "dualkv": (68, 974), "prefix_grouper": (68, 974),
                "trl_prefix_tree_standin": (72, 1038)}
    assert flops(132, 1518) == 68411904 and flops(68, 974) == 35586560 and flops(72, 1038) == 37691904
    for name, (tokens, pairs) in expected.items():
        r = rows[name]
        assert (r["tokens"], r["pairs"]) == (tokens, pairs), r
        assert r["flops"] == flops(tokens, pairs), r
        assert abs(r["ideal"] - 68411904 / flops(tokens, pairs)) < 1e-12, r
        assert abs(r["speedup"] - rows["plain_varlen"]["ms"] / r["ms"]) < 1e-9, r
        assert abs(r["of_ideal"] - r["speedup"] / r["ideal"]) < 1e-9, r
    assert abs(rows["dualkv"]["ideal"] - 1.9224) < 1e-4 and abs(rows["trl_prefix_tree_standin"]["ideal"] - 1.8150) < 1e-4
    md = (tmp_path / "peers.md").read_text()
    assert "strongest baseline: `plain_varlen`" in md and "| vs base | ideal | of ideal |" in md
    assert f"| dualkv | ok | True | 68 | 0.03559 | {rows['dualkv']['ms']:.1f} | {rows['dualkv']['speedup']:.2f}x | 1.92x |" in md


def test_grad_bf16_check_holds_dualkv_to_the_original_models_bf16_error(tmp_path):
    """``grad_bf16_check.py`` on 2 narrow layers under autocast: dualkv packs, and its bf16 gradients are no
    further from the float32 original's than the original model's own bf16 gradients are (1.5x, all together)."""
    cmd = [sys.executable, "benchmarks/probes/grad_bf16_check.py", "--device", "cpu", "--layers", "2", "--N", "4", "--P", "32",
           "--R", "8", "--out", str(tmp_path)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    with open(tmp_path / "grad_bf16_check_deep-narrow_autocast.json") as f:
        run = json.load(f)["results"]  # the record of benchmarks/harness.py
    assert run["packed_calls"] > 0 and run["pass"] is True
    assert 0 < run["all_grads_rel"]["plain"] < 0.1  # bf16 differs from float32, and not by everything
    assert run["all_grads_rel"]["dualkv"] <= 1.5 * run["all_grads_rel"]["plain"]


@pytest.mark.parametrize("shape", ["uniform", "groups", "tree"])
def test_flex_user_mask_is_the_forests_dense_mask(shape):
    """``attention.py``'s plain-Flex column uses a mask function written as a user would (document ids and an
    ancestor table); over every (query, key) pair it is the forest's dense mask, which the kernels are tested
    against, for one prompt, several groups, and a system prompt over groups."""
    from torch.nn.attention.flex_attention import create_mask

    from benchmarks.ops import attention_methods as am
    from dualkv_compile.layout.segments import dense_mask

    case = {"uniform": am.uniform_case(3, 5, 4), "groups": am.groups_case(num_groups=3, N=2, P=6, lo=1, hi=5),
            "tree": am.tree_case(system=3, num_groups=2, N=2, P=4, R=3)}[shape]
    T = case.num_tokens
    mask = create_mask(am.user_forest_mask_mod(case, "cpu"), None, None, T, T, device="cpu")[0, 0]
    expected = dense_mask(am.segments(case, "cpu"), T)
    assert mask.shape == (T, T) and torch.equal(mask, expected)
    assert 0 < int(mask.sum()) < T * (T + 1) // 2  # a forest, not all-causal, and not empty


def test_compile_time_names_a_bad_model_and_takes_llama_1b():
    """``compile_time.py --model``: a Qwen3 preset of model_gpu.py or llama-1b; anything else is refused at the
    command line, naming the argument and what it takes (not a KeyError in a child process)."""
    res = subprocess.run([sys.executable, "benchmarks/compile/compile_time.py", "--model", "llama-8b"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "--model: expected llama-1b or one of 0.6b, 1.7b, 8b, tiny" in res.stderr, res.stderr
    from benchmarks.compile import compile_time  # the repository is on sys.path (above)

    assert compile_time.parse(["--model", "llama-1b"]).model == "llama-1b"
    assert compile_time.LLAMA_1B["head_dim"] == 64 and compile_time.LLAMA_1B["num_hidden_layers"] == 16


def test_compile_time_profile_warm_needs_out(capsys):
    """``--profile-warm`` writes its report under ``--out``: without one it is refused, naming both (it profiled
    the warm process for nothing and wrote no file)."""
    from benchmarks.compile import compile_time

    with pytest.raises(SystemExit) as e:
        compile_time.parse(["--model", "tiny", "--profile-warm"])
    assert e.value.code == 2 and "--profile-warm" in capsys.readouterr().err
    assert compile_time.parse(["--model", "tiny", "--profile-warm", "--out", "x"]).profile_warm


def test_varlen_kernel_choice_is_checked():
    """``DUALKV_VARLEN_KERNEL`` picks the baseline's CUDA kernel; a value it does not know stops the import, naming
    the variable and the choices."""
    code = "import sys; from benchmarks.ops import varlen_attention"
    env = dict(os.environ, DUALKV_VARLEN_KERNEL="fa2")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "DUALKV_VARLEN_KERNEL: expected one of auto, torch, fa4, got 'fa2'" in res.stderr, res.stderr
    env["DUALKV_VARLEN_KERNEL"] = "fa4"
    res = subprocess.run([sys.executable, "-c", code + "; print(varlen_attention.kernel())"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "fa4", res.stderr
    # The default picks the fastest kernel that runs here: without a GPU (and FA4), torch's.
    env.pop("DUALKV_VARLEN_KERNEL")
    res = subprocess.run([sys.executable, "-c", code + "; print(varlen_attention.CHOICE, varlen_attention.kernel())"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    allowed = {"auto torch", "auto fa4"} if torch.cuda.is_available() else {"auto torch"}
    assert res.returncode == 0 and res.stdout.strip() in allowed, (res.stdout, res.stderr)


@pytest.mark.parametrize("fa4_installed, capability, expected", [(True, (9, 0), "fa4"), (False, (9, 0), "torch"),
                                                                (True, (8, 0), "torch")])
def test_varlen_kernel_auto_picks_fa4_on_hopper_where_it_imports(monkeypatch, fa4_installed, capability, expected):
    """"auto" (the default) resolves once, at import, to FA4 on a Hopper-or-newer GPU where ``flash_attn.cute``
    imports, else to torch's kernel; the attention then reads a module constant while Dynamo traces it."""
    import importlib
    import types

    from benchmarks.ops import varlen_attention

    monkeypatch.delenv("DUALKV_VARLEN_KERNEL", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    if fa4_installed:
        monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
        monkeypatch.setitem(sys.modules, "flash_attn.cute", types.ModuleType("flash_attn.cute"))
    else:
        monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # an import of it raises ImportError
    try:
        module = importlib.reload(varlen_attention)
        assert (module.CHOICE, module.KERNEL, module.kernel()) == ("auto", expected, expected)
    finally:
        monkeypatch.undo()
        importlib.reload(varlen_attention)


def test_cpu_thread_profile_compare_ranks_ops_by_self_time_at_more_threads(tmp_path):
    """cpu_thread_profile --compare: rows by self time at the second file's thread count, each with its speedup and
    its excess over perfect scaling; the ops left out are summed into one row."""
    from benchmarks.probes import cpu_thread_profile

    def run(path, threads, ops, wall):
        with open(path, "w") as f:
            json.dump({"side": "dualkv", "threads": threads, "steps": 1, "wall_ms": wall,
                       "self_total_ms": sum(o[0] for o in ops.values()), "ops": ops}, f)
        return str(path)

    one = run(tmp_path / "t1.json", 1, {"aten::mm": [200.0, 200.0, 87], "aten::_index_put_impl_": [8.0, 8.0, 1],
                                         "aten::add_": [2.0, 2.0, 10]}, [210.0])
    two = run(tmp_path / "t2.json", 2, {"aten::mm": [100.0, 100.0, 87], "aten::_index_put_impl_": [48.0, 48.0, 1],
                                         "aten::add_": [1.5, 1.5, 10]}, [150.0])
    lines = cpu_thread_profile.compare(one, two, top=2).splitlines()
    assert "1.40x" in lines[0]  # 210 / 150
    assert lines[4] == "| `aten::mm` | 87 | 200.0 | 100.0 | 2.00x | 66.9% | +0.0 |"
    assert lines[5] == "| `aten::_index_put_impl_` | 1 | 8.0 | 48.0 | 0.17x | 32.1% | +44.0 |"
    assert lines[6] == "| all other ops |  | 2.0 | 1.5 | 1.33x | 1.0% | +0.5 |"


def test_window_attention_pair_counts():
    """window_attention.py's useful-FLOP count: the forest's window-visible pairs, by brute force over dense_mask."""
    from benchmarks.ops import window_attention

    from dualkv_compile.layout import tree_segments
    from dualkv_compile.layout.segments import dense_mask

    for P, Rs, w in [(7, [3, 5], 4), (3, [6, 1, 2], 5), (5, [2], 100)]:
        segs = tree_segments([P] + Rs, [-1] + [0] * len(Rs))
        assert window_attention.packed_pairs(P, Rs, w) == int(dense_mask(segs, P + sum(Rs), window=w).sum())
        assert window_attention.window_pairs(P + Rs[0], w) == sum(min(i + 1, w) for i in range(P + Rs[0]))


def test_model_variants_tiny_presets_pack_and_agree_on_cpu(tmp_path):
    """``model_variants.py``'s CPU presets, in-process: on tiny gpt-oss (sinks, a binding window, the padded batch)
    and DeepSeek-V2 (MLA, the remove-padding row) shapes dualkv packs its calls, its loss equals the strongest
    baseline's (float32), and the table names that baseline and why; with one response per prompt nothing is shared
    and the FLOP ideal is 1."""
    from benchmarks.model import model_variants

    for model in ("tiny-gpt-oss", "tiny-deepseek-v2"):
        argv = ["--device", "cpu", "--model", model, "--layers", "2", "--rollouts", "3", "--reps", "1",
                "--compiler", "none", "--out", str(tmp_path)]
        assert model_variants.main(argv) == 0
    with open(tmp_path / "model_variants.json") as f:
        models = json.load(f)["results"]["models"]  # the record of benchmarks/harness.py
    for model, baseline in (("tiny-gpt-oss", "eager"), ("tiny-deepseek-v2", "varlen")):
        e = models[model]
        base, dk = e["rows"]
        assert base["variant"] == e["strongest"] == baseline and dk["variant"] == "dualkv", e
        assert dk["packed_calls"] > 0 and dk["refused"] == [] and set(dk["attention_backends"]) == {"cpu_flash"}, dk
        assert e["losses_agree"] and e["loss_rel_diff"] <= 1e-4, (base["loss"], dk["loss"])
        assert e["tokens_after"] < e["tokens"] and e["ideal"] > 1.5
    md = (tmp_path / "model_variants.md").read_text()
    assert "## tiny-gpt-oss" in md and "## tiny-deepseek-v2" in md and "GptOssModel builds its masks" in md
    alone = model_variants.sequences(2, 1, (16, 24), (3, 8), 512)
    dup, packed = model_variants.flop_model("tiny-gpt-oss", 2, alone)
    assert dup == packed


def test_model_vlm_tiny_run_packs_and_agrees_on_cpu(tmp_path):
    """``model_vlm.py --tiny`` in-process: dualkv runs the tower on the distinct images only (2 of 16 rows' images),
    its language model packed, its loss equal to the plain model's (float32); the FLOP ideal above 1."""
    from benchmarks.model import model_vlm

    argv = ["--device", "cpu", "--tiny", "--reps", "1", "--compiler", "eager", "--layers", "2", "--out", str(tmp_path)]
    assert model_vlm.main(argv) == 0
    with open(tmp_path / "model_vlm.json") as f:
        rec = json.load(f)
    plain, dk = rec["rows"]
    per_image = rec["meta"]["patches_per_image"]
    assert plain["tower_patches_per_step"] == 16 * per_image and dk["tower_patches_per_step"] == 2 * per_image
    assert dk["packed_calls"] > 0 and plain["packed_calls"] == 0
    assert rec["results"]["loss_rel_diff"] <= 1e-4 and rec["results"]["ideal"] > 1.5, rec["results"]
    assert "| dualkv |" in (tmp_path / "model_vlm.md").read_text()


@pytest.mark.slow  # the suite's time; `make test-slow` runs it
def test_model_variants_flex_block_masks_are_the_padded_models_masks():
    """The gpt-oss flex baseline's BlockMasks (document, causal, window from ``cu_seqlens``) give the row the padded
    batch's loss, where transformers' own masks on the row (GptOssModel builds them without position ids) mix the
    sequences. On CPU flex has no sinks: they are set to -1e4 (no weight) and dropped from flex's call."""
    import math

    from benchmarks.model import model_variants as mv
    from benchmarks.model.model_remove_padding import remove_padding_loss
    from transformers import AttentionInterface
    from transformers.integrations.flex_attention import flex_attention_forward

    AttentionInterface.register("flex_no_sinks", lambda *a, s_aux=None, **kw: flex_attention_forward(*a, **kw))
    model = mv.build_model("tiny-gpt-oss", 2, "cpu", torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.fill_(-1e4)
    seqs = mv.sequences(2, 3, (16, 24), (3, 8), 512)
    old = -math.log(512)
    row, padded = mv.row_batch(seqs, "cpu", old_logp=old), mv.padded_batch(seqs, "cpu", old_logp=old)
    row["flex_masks"] = mv.flex_masks(row, window=8)
    with torch.no_grad():
        model.config._attn_implementation = "eager"
        expected, mixed = float(mv.padded_chunked_loss(model, padded)), float(remove_padding_loss(model, row))
        model.config._attn_implementation = "flex_no_sinks"
        got = float(mv.flex_loss(model, row))
    assert abs(got - expected) <= 1e-5 * abs(expected) and abs(mixed - expected) > 1e-3 * abs(expected)


def _benchmark_import_graph():
    """``{module: modules of benchmarks/ it imports}`` over benchmarks/, by tests/test_architecture.py's reader
    (function-level imports included)."""
    import pathlib

    from tests.test_architecture import _imports, _module_name

    modules = {_module_name(p): p for p in sorted(pathlib.Path(ROOT, "benchmarks").rglob("*.py"))}
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_benchmarks_have_no_import_cycle_between_modules_or_groups():
    """benchmarks/ has no circle: no module imports itself back through others (ops/attention.py and
    tuning/gluon_tune.py once imported each other; the config text they share is ops/gluon_configs.py), and no two
    groups (ops, model, peers, ...) import each other."""
    from tests.test_architecture import _cycles

    graph = _benchmark_import_graph()
    # The reader resolves the package imports (an empty graph would have no cycle either).
    assert {"benchmarks.ops.attention", "benchmarks.ops.gluon_configs"} <= graph["benchmarks.tuning.gluon_tune"]
    assert "benchmarks.ops.gluon_configs" in graph["benchmarks.ops.attention"]
    cycles = _cycles(graph)
    assert not cycles, "import cycles in benchmarks/:\n" + "\n".join(" -> ".join(c) for c in cycles)

    def group(module):
        return module.split(".")[1] if module.count(".") >= 2 else module

    groups = {}
    for importer, targets in graph.items():
        groups.setdefault(group(importer), set()).update(group(t) for t in targets if group(t) != group(importer))
    for targets in list(groups.values()):
        for t in targets:
            groups.setdefault(t, set())
    cycles = _cycles(groups)
    assert not cycles, "groups of benchmarks/ that import each other:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_harness_stamps_one_schema_and_names_the_results_folder(tmp_path):
    """benchmarks/harness.py: a record has exactly the fixed keys (bench, device, versions, date, command, meta, rows,
    results), the command is the script's path from the repository root with its arguments, and a run's folder is
    results/<bench>/<device>-<date>/."""
    from benchmarks import harness

    script = os.path.join(ROOT, "benchmarks", "ops", "attention.py")
    stamp = harness.stamp("attention", device="cpu", script=script, argv=["--shapes", "2,8,4", "--stem", "a b"])
    assert stamp["command"] == "python benchmarks/ops/attention.py --shapes 2,8,4 --stem 'a b'"
    assert stamp["device"].startswith("cpu (") and stamp["bench"] == "attention" and stamp["date"].endswith(" UTC")
    assert set(stamp["versions"]) == {"python", "torch", "triton", "transformers", "cuda"}
    assert stamp["versions"]["torch"] == torch.__version__
    rec = harness.record(stamp, meta={"n": 1}, rows=[{"ms": 1.0}])
    assert tuple(rec) == harness.KEYS and rec["results"] == {} and harness.is_record(rec)
    path = harness.write_json(str(tmp_path / "run" / "attention.json"), rec)
    with open(path) as f:
        back = json.load(f)
    assert back == rec and harness.payload(back) == {"meta": {"n": 1}, "rows": [{"ms": 1.0}]}
    assert harness.payload({"meta": {}, "cases": []}) == {"meta": {}, "cases": []}  # a JSON from before the schema
    with pytest.raises(ValueError, match="expected a record with keys"):
        harness.write_json(str(tmp_path / "x.json"), {"meta": {}, "rows": []})
    gpu = dict(stamp, device="NVIDIA H200", date="2026-12-02 10:00 UTC")
    assert harness.result_dir(gpu) == os.path.join(ROOT, "benchmarks", "results", "attention", "h200-2026-12-02")
    assert [harness.device_slug(d) for d in ("4 x NVIDIA H100 80GB HBM3", "cpu (x86_64, 2 cores)", "AMD Instinct MI300X")] \
        == ["4xh100", "cpu", "mi300x"]
    assert harness.markdown_stamp(gpu)[1] == f"- command: `{stamp['command']}`"


def test_every_benchmark_json_goes_through_the_harness():
    """No script of benchmarks/ writes a JSON file but through harness.write_json (one schema for every result); the
    exceptions print JSON to a parent process or append to a log of lines."""
    import pathlib

    lines_log = {"benchmarks/tuning/triton_tune.py"}  # results.jsonl: one record per line as the sweep goes
    bad = []
    for path in sorted(pathlib.Path(ROOT, "benchmarks").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "benchmarks/harness.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "json.dump(" in line or ("write(json.dumps" in line and rel not in lines_log):
                bad.append(f"{rel}:{n}: {line.strip()}")
    assert not bad, "JSON written around benchmarks/harness.py:\n" + "\n".join(bad)


def test_results_index_is_the_trees_and_lists_every_result():
    """benchmarks/results/README.md is what ``python benchmarks/index.py`` makes of the tree (regenerating it gives
    the same text): every folder results/<bench>/<device>-<date>[-<label>]/ holds a record of the harness whose
    bench, device and date are the folder's, and its row gives device, date, command and the doc lines quoting it."""
    from benchmarks import index

    found = index.results()
    problems = [f"results/{r['path']}: {p}" for r in found for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert found and all(os.path.isdir(os.path.join(index.RESULTS, r["path"])) for r in found)
    loose = [n for b in os.listdir(index.RESULTS) if os.path.isdir(os.path.join(index.RESULTS, b))
             for n in os.listdir(os.path.join(index.RESULTS, b)) if not os.path.isdir(os.path.join(index.RESULTS, b, n))]
    assert not loose, f"files directly under results/<bench>/, outside a run's folder: {loose}"
    assert sorted(os.listdir(index.RESULTS)) == sorted({r["bench"] for r in found} | {"README.md"})
    with open(index.INDEX) as f:
        assert f.read() == index.render(), "benchmarks/results/README.md is stale: run python benchmarks/index.py"
    text = index.render()
    for r in found:
        assert f"[{r['folder']}]({r['path']}/)" in text
    # A doc line naming a result is quoted beside it; a path that merely starts the same is not.
    texts = {"docs/x.md": ["see `benchmarks/results/peers/cpu-2026-11-27/peers.md`", "results/peers/cpu-2026-11-27-b/"]}
    assert index.quotes("peers/cpu-2026-11-27", texts) == [("docs/x.md", 1, texts["docs/x.md"][0])]


def test_varlen_recurrent_restarts_gdn_and_conv_at_each_sequence():
    """The hybrid baseline's remove-padding GDN and short conv (``benchmarks/ops/varlen_recurrent.py``) on a row of
    three sequences equal transformers' torch fallbacks run on each sequence alone (float32); the fallbacks on the
    whole row (what the row gets without it) differ, and a row without ``cu_seq_lens_q`` is refused."""
    import inspect

    from benchmarks.ops import varlen_recurrent
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    gdn_ref, conv_ref = (inspect.unwrap(vars(m)[n]) for n in (varlen_recurrent.GDN, varlen_recurrent.CONV))
    torch.manual_seed(0)
    lens = [7, 12, 5]
    T, Hk, Hv, D, C, K = sum(lens), 2, 4, 8, 6, 4
    cu = torch.tensor([0, 7, 19, 24], dtype=torch.int32)
    q, k = torch.randn(1, T, Hk, D), torch.randn(1, T, Hk, D)
    v, beta = torch.randn(1, T, Hv, D), torch.rand(1, T, Hv)
    g = -torch.rand(1, T, Hv)
    x, w, b = torch.randn(1, C, T), torch.randn(C, K), torch.randn(C)
    with varlen_recurrent.flat_forest(m):
        out, _ = m.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, use_qk_l2norm_in_kernel=True,
                                                cu_seqlens=cu)
        conv = m.causal_conv1d_fn(x, w, b, activation="silu", cu_seq_lens_q=cu)
        with pytest.raises(ValueError, match="cu_seq_lens_q"):
            m.causal_conv1d_fn(x, w, b, activation="silu")
    assert vars(m)[varlen_recurrent.GDN] is not None and inspect.unwrap(vars(m)[varlen_recurrent.GDN]) is gdn_ref
    pieces = [slice(int(cu[i]), int(cu[i + 1])) for i in range(3)]
    want = torch.cat([gdn_ref(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], chunk_size=4,
                              use_qk_l2norm_in_kernel=True)[0] for s in pieces], dim=1)
    want_conv = torch.cat([conv_ref(x[..., s], w, b, activation="silu") for s in pieces], dim=-1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv, want_conv, rtol=1e-5, atol=1e-5)
    joined = gdn_ref(q, k, v, g, beta, chunk_size=4, use_qk_l2norm_in_kernel=True)[0]
    assert (joined - want).abs().max() > 1e-3 and (conv_ref(x, w, b, activation="silu") - want_conv).abs().max() > 1e-3
