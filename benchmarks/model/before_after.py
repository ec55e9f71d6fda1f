"""Two source trees side by side: ``model_cpu.py`` of each, alternately, in one run.

    .venv/bin/python benchmarks/model/before_after.py --before .old --after . [--rounds 2] [--out F] -- --loss policy

``--before``/``--after`` are directories holding ``dualkv_compile/`` and
``benchmarks/model/model_cpu.py`` (e.g. ``git archive <commit> dualkv_compile
benchmarks | tar -x -C .old``). Each round runs the before tree's benchmark,
then the after tree's, each in its own process (the two packages share a
name); the arguments after ``--`` go to both. Each process measures dualkv
against Inductor on the duplicated batch interleaved, so its speedup is a
ratio taken under the same machine load; the table lists it per round and
tree, with dualkv's median step time.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the repository
from benchmarks import harness  # noqa: E402


# Where a tree keeps model_cpu.py: benchmarks/model/ since the benchmarks were grouped, benchmarks/ before.
SCRIPT_PATHS = (os.path.join("benchmarks", "model", "model_cpu.py"), os.path.join("benchmarks", "model_cpu.py"))


def script_of(tree: str):
    """The path of ``tree``'s model_cpu.py, or None."""
    return next((os.path.join(tree, s) for s in SCRIPT_PATHS if os.path.isfile(os.path.join(tree, s))), None)


def run_tree(tree: str, extra: list[str], out: str) -> dict:
    tree = os.path.abspath(tree)
    cmd = [sys.executable, script_of(tree), *extra, "--out", out]
    env = dict(os.environ, PYTHONPATH=tree)
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    text = open(out).read()
    speedup = float(re.search(r"speedup dualkv over inductor-duplicated: \*\*([\d.]+)x\*\*", text).group(1))
    dualkv_ms = float(re.search(r"\| dualkv \| ([\d.]+) \|", text).group(1))
    inductor_ms = float(re.search(r"\| inductor \| ([\d.]+) \|", text).group(1))
    return {"speedup": speedup, "dualkv_ms": dualkv_ms, "inductor_ms": inductor_ms, "report": text}


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="the report's path, its record beside it (.json); default: "
                    "benchmarks/results/before_after/cpu-<date>/before_after.md")
    args = ap.parse_args(own)
    stamp = harness.stamp("before_after", device="cpu", script=__file__, argv=argv)
    args.out = args.out or os.path.join(harness.result_dir(stamp), "before_after.md")
    for tree in (args.before, args.after):
        if script_of(tree) is None:
            ap.error(f"{tree!r} holds no {' or '.join(SCRIPT_PATHS)}")

    rows = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, tree in (("before", args.before), ("after", args.after)):
                print(f"round {r + 1}/{args.rounds}: {name} ({tree}) ...", file=sys.stderr, flush=True)
                res = run_tree(tree, extra, os.path.join(tmp, f"{name}_{r}.md"))
                rows[name].append(res)
                print(f"  speedup {res['speedup']:.2f}x, dualkv {res['dualkv_ms']:.1f} ms", file=sys.stderr, flush=True)

    lines = [
        "# Before and after, side by side: `benchmarks/model/model_cpu.py " + " ".join(extra) + "`",
        "",
        *harness.markdown_stamp(stamp),
        f"- before: `{args.before}`; after: `{args.after}`; {args.rounds} rounds, the trees alternating",
        "",
        "| round | tree | dualkv ms (median) | inductor ms (median) | speedup over inductor-duplicated |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in range(args.rounds):
        for name in ("before", "after"):
            x = rows[name][r]
            lines.append(f"| {r + 1} | {name} | {x['dualkv_ms']:.1f} | {x['inductor_ms']:.1f} | {x['speedup']:.2f}x |")
    med = {n: statistics.median(x["speedup"] for x in rows[n]) for n in rows}
    lines += ["", f"- median speedup: before **{med['before']:.2f}x**, after **{med['after']:.2f}x** "
              f"(after / before {med['after'] / med['before']:.3f})", "",
              "## The after tree's last report", "", rows["after"][-1]["report"]]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    harness.write_json(os.path.splitext(args.out)[0] + ".json", harness.record(
        stamp, meta=dict(before=args.before, after=args.after, rounds=args.rounds, model_cpu_args=extra),
        rows=[dict(round=r + 1, tree=n, **{k: v for k, v in rows[n][r].items() if k != "report"})
              for r in range(args.rounds) for n in ("before", "after")], results=dict(median_speedup=med)))
    print("\n".join(lines[:9 + 2 * args.rounds + 2]))


if __name__ == "__main__":
    main()
