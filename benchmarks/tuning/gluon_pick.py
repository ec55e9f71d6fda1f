"""The winners of ``benchmarks/tuning/gluon_tune.py --json`` sweeps, as ``benchmarks/ops/attention.py --gluon-configs`` text.

    python benchmarks/tuning/gluon_pick.py OUT/fwd.json OUT/dq.json OUT/dkdv.json [--tol 1e-2]
    python benchmarks/tuning/gluon_pick.py --compare OUT/before.json OUT/after.json

Per kernel (each file names its own), among the configs within ``--tol`` of the Triton result (the largest
relative difference over the inputs and outputs; a NaN is never within it) and measured on every input the
sweep finished (``shapes_done``: a sweep cut short by its timeout counts the inputs it finished), the one of
the least geometric-mean time over those inputs. A kernel whose winner is the table's default, or with no
such config, or whose winner is not ``--min-gain`` faster than its default, is left out. stdout: the
``--gluon-configs`` text ("fwd: block_m=128, block_n=64, stages=3; dq: ..."; empty when nothing is picked);
stderr: each config's geometric mean and difference, and why a kernel is left out.

``--compare`` prints, per case of two ``attention.py`` results, the Gluon method's fwd+bwd ms and its efficiency
against cuDNN's (``attention_report``'s "vs cuDNN") in each. Needs no torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from benchmarks import harness  # noqa: E402

KINDS = ("fwd", "dq", "dkdv")  # the order of the --gluon-configs text
TOL = 1e-2  # tests/kernels/test_gluon_attention.py's bound on the bf16 forward against the float reference


def gmean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def rank(result: dict, tol: float = TOL) -> list[tuple[float, dict]]:
    """``(geometric-mean ms, config)`` of the configs of one sweep that may win, fastest first."""
    shapes = result.get("shapes_done") or []
    ranked = []
    for c in result.get("configs", []) if shapes else []:
        diffs = [c.get("diff", {}).get(s) for s in shapes]
        if all(s in c.get("ms", {}) for s in shapes) and all(d is not None and d <= tol for d in diffs):
            ranked.append((gmean(c["ms"][s] for s in shapes), c))
    return sorted(ranked, key=lambda t: t[0])


def pick(result: dict, tol: float = TOL, min_gain: float = 0.0):
    """``(config or None, why)``: the winner of one sweep, None where the kernel is left out."""
    ranked = rank(result, tol)
    if not result.get("shapes_done"):
        return None, "no input finished"
    if not ranked:
        return None, f"no config within {tol:g} of the Triton result on every finished input"
    best_ms, best = ranked[0]
    if best.get("default"):
        return None, "the default is the fastest"
    default = next((ms for ms, c in ranked if c.get("default")), None)
    if default is None:
        return best, f"{best['text']}: {best_ms:.4g} ms (the default was not measured on every input, or not exact)"
    if best_ms > default * (1 - min_gain):
        return None, f"{best['text']} is {default / best_ms - 1:.2%} faster than the default, under --min-gain"
    return best, f"{best['text']}: {best_ms:.4g} ms against the default's {default:.4g} ({default / best_ms:.3f}x)"


def gluon_configs_text(results: list[dict], tol: float = TOL, min_gain: float = 0.0, log=None) -> str:
    picks = {}
    for result in results:
        kind = result.get("kind")
        best, why = pick(result, tol, min_gain)
        if log:
            log(f"{kind}: {'picked ' if best else 'left out: '}{why}")
            for ms, c in rank(result, tol):
                log(f"  {ms:9.4f} ms  max diff {max(c['diff'][s] for s in result['shapes_done']):.1e}  "
                    f"{c['text']}{'  (default)' if c.get('default') else ''}")
        if best is not None:
            picks[kind] = best["text"]
    return "; ".join(f"{k}: {picks[k]}" for k in KINDS if k in picks)


def compare(before: dict, after: dict, method: str = "dualkv_gluon") -> list[str]:
    """Per case: ``method``'s fwd+bwd ms and "vs cuDNN" in ``before`` and ``after``."""
    def eff(results, case):
        rows = {r["method"]: r for r in results["rows"] if r["case"] == case["case"] and r["mode"] == "fwd+bwd"}
        me, cudnn = rows.get(method, {}).get("ms"), rows.get("sdpa_cudnn_dup", {}).get("ms")
        return me, (cudnn / (me * case["ideal_ratio"]) if me and cudnn else None)

    def fmt(x, f):
        return "-" if x is None else format(x, f)

    lines = [f"| case | {method} fwd+bwd ms before | after | vs cuDNN before | after |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for case in before["cases"]:
        (b_ms, b_eff), (a_ms, a_eff) = eff(before, case), eff(after, case)
        lines.append(f"| {case['case']} | {fmt(b_ms, '.2f')} | {fmt(a_ms, '.2f')} | {fmt(b_eff, '.3f')} "
                     f"| {fmt(a_eff, '.3f')} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="gluon_tune.py --json files (with --compare: two attention.py results)")
    ap.add_argument("--tol", type=float, default=TOL,
                    help="largest relative difference from Triton (default %(default)g)")
    ap.add_argument("--min-gain", type=float, default=0.0, help="fraction the winner must beat the default by")
    ap.add_argument("--compare", action="store_true", help="compare two attention.py results: before, after")
    args = ap.parse_args(argv)
    results = []
    for path in args.json:
        try:
            with open(path) as f:
                results.append(harness.payload(json.load(f)))  # a record's results (or an older flat JSON)
        except (OSError, ValueError) as e:
            if args.compare:
                ap.error(f"--compare: {path}: {e}")
            print(f"{path}: skipped ({type(e).__name__}: {e})", file=sys.stderr)
    if args.compare:
        if len(results) != 2:
            ap.error(f"--compare: expected two attention.py result files (before, after), got {len(results)}")
        print("\n".join(compare(*results)))
        return 0
    print(gluon_configs_text(results, args.tol, args.min_gain, log=lambda s: print(s, file=sys.stderr)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
