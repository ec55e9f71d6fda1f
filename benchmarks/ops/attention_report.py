"""The report of ``benchmarks/ops/attention.py``: its results as JSON, a Markdown table per case (speedup over SDPA on
the duplicated batch, efficiency against SDPA-cuDNN, peak memory) and a PNG plot of the speedups.

``python benchmarks/ops/attention.py --plot-only results.json`` redraws the Markdown and the plot from a results file
(a record of ``benchmarks/harness.py`` or a JSON written before it).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import harness
from benchmarks.ops.attention_timing import log


# --------------------------------------------------------------------------- report


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in s.lower()).strip("_")


def write_report(results: dict, out_dir: Path, stem: str, stamp: dict) -> None:
    """``results`` ({meta, cases, rows, ...}) as the harness's record ``stem``.json (cases, skipped and the block
    mask in its ``results``), its Markdown and its plot, in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rest = {k: v for k, v in results.items() if k not in ("meta", "rows")}
    harness.write_json(str(out_dir / f"{stem}.json"), harness.record(stamp, meta=results["meta"], rows=results["rows"],
                                                                    results=rest))
    (out_dir / f"{stem}.md").write_text(markdown(results))
    try:
        plot(results, out_dir / f"{stem}.png")
    except Exception as e:  # noqa: BLE001 - matplotlib may be missing
        log(f"no plot: {type(e).__name__}: {e}")


def markdown(results: dict) -> str:
    m = results["meta"]
    lines = [
        "# Shared-prompt attention: side by side",
        "",
        f"- device: {m['device']}; torch {m['torch']}; triton {m['triton']}; CUDA {m['cuda']}; date {m['date']}",
        f"- Hq={m['hq']}, Hkv={m['hkv']}, D={m['d']}, {m['dtype']}; median of {'CUDA-event' if m['cuda_timing'] else 'wall-clock'} timings; "
        "TFLOP/s = useful attention pairs (packed layout) x 4 x D x Hq / time, fwd+bwd counted 3.5x",
        *(["- ms: each call queued behind a short GPU sleep, so the host's work before its first kernel overlaps "
           "the GPU (as in a training step, whose host runs ahead); 'from idle': the same calls started on an idle "
           "GPU, the host's dispatch and launch counted (benchmarks/ops/op_overhead.py gives each method's host share)"]
          if m["cuda_timing"] else []),
        *([f"- **Caveat:** {m['caveat']}"] if m.get("caveat") else []),
        *([_gluon_line(m)] if m.get("gluon_configs") else []),
        "- speedup: SDPA (flash on CUDA) on the duplicated batch, fwd+bwd time, over the method's; "
        "peak GB: peak allocated memory of the method (its inputs, activations and gradients)",
        "- vs cuDNN: fwd+bwd efficiency against SDPA-cuDNN's (its time on the duplicated batch over the method's time "
        "times the ideal ratio: the method's useful TFLOP/s over cuDNN's own TFLOP/s); 1 is cuDNN's efficiency. "
        "A method on the duplicated batch too (`_dup`) is not packed: its ratio is cuDNN's time over its time",
        "",
    ]
    bm = results.get("block_mask")
    if bm:
        lines += [f"## Block mask (T = {bm.get('T', '?')})", ""]
        for key in bm:
            if key.startswith(("eager", "triton")):
                lines.append(f"- {key} builder (ms): {bm[key]}")
        for key in ("syncs", "compiles_first_layout", "recompiles_next_layouts", "layouts_T", "error"):
            if key in bm:
                lines.append(f"- {key}: {bm[key]}")
        lines.append("")
    notes = {}
    for case in results["cases"]:
        rows = [r for r in results["rows"] if r["case"] == case["case"]]
        base = next((r["ms"] for r in rows if r["method"] in ("sdpa_flash_dup", "sdpa_dup") and r["mode"] == "fwd+bwd" and r["ms"]), None)
        cudnn_row = next((r for r in rows
                          if r["method"] == "sdpa_cudnn_dup" and r["mode"] == "fwd+bwd" and r["ms"]), {})
        cudnn, cudnn_idle = cudnn_row.get("ms"), cudnn_row.get("ms_idle")
        lines += [
            f"## {case['case']}: N={case['N']}, P={case['P']}, R={case['R']}, T={case['T']}, ideal ratio {case['ideal_ratio']}x",
            "",
            "| method | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | speedup (fwd+bwd) | vs cuDNN | peak GB "
            "| fwd+bwd ms from idle | vs cuDNN from idle |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for meth in dict.fromkeys(r["method"] for r in rows):
            f = next(r for r in rows if r["method"] == meth and r["mode"] == "fwd")
            b = next(r for r in rows if r["method"] == meth and r["mode"] == "fwd+bwd")
            if b["note"]:
                notes.setdefault(meth, set()).add(b["note"])
            if b["status"] != "ok":
                lines.append(f"| {meth} | {b['status']} | | {b['status']} | | | | | | |")
                continue
            sp = f"{base / b['ms']:.2f}x" if base else ""
            ratio = 1.0 if meth.endswith("_dup") else case["ideal_ratio"]  # a _dup method computes what cuDNN does
            eff = f"{cudnn / (b['ms'] * ratio):.3f}" if cudnn and meth != "sdpa_cudnn_dup" else ""
            pk = "" if b["peak_gb"] is None else f"{b['peak_gb']:.1f}"
            idle = b.get("ms_idle")
            eff_idle = (f"{cudnn_idle / (idle * ratio):.3f}"
                        if cudnn_idle and idle and meth != "sdpa_cudnn_dup" else "")
            lines.append(f"| {meth} | {f['ms']:.2f} | {f['tflops']:.3g} | {b['ms']:.2f} | {b['tflops']:.3g} | {sp} | {eff} "
                         f"| {pk} | {'' if idle is None else f'{idle:.2f}'} | {eff_idle} |")
        lines.append("")
    if results.get("skipped"):
        lines += ["## Skipped", ""] + [f"- {k}: {v}" for k, v in results["skipped"].items()] + [""]
    if notes:
        lines += ["## Notes", ""] + [f"- {k}: {'; '.join(sorted(v))}" for k, v in notes.items()] + [""]
    return "\n".join(lines)


def _gluon_line(m: dict) -> str:
    g = m["gluon_configs"]
    src = f"--gluon-configs set {', '.join(g['set'])}" if g.get("set") else "the defaults"
    return (f"- Gluon launch configs at D={g.get('head_dim', m['d'])} ({src}): "
            + "; ".join(f"{k}: {g[k]}" for k in ("fwd", "dq", "dkdv") if k in g))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    uni = [c for c in results["cases"] if c["groups"] == 1 and isinstance(c["P"], int) and isinstance(c["R"], int)]
    Rs = sorted({c["R"] for c in uni})
    if not Rs:
        return
    fig, axes = plt.subplots(1, len(Rs), figsize=(6 * len(Rs), 4.5), squeeze=False)
    for ax, R in zip(axes[0], Rs):
        cases = sorted((c for c in uni if c["R"] == R), key=lambda c: (c["P"], c["N"]))
        methods = list(dict.fromkeys(r["method"] for r in results["rows"]))
        for meth in methods:
            xs, ys = [], []
            for c in cases:
                rows = [r for r in results["rows"] if r["case"] == c["case"] and r["mode"] == "fwd+bwd"]
                base = next((r["ms"] for r in rows if r["method"] in ("sdpa_flash_dup", "sdpa_dup") and r["ms"]), None)
                me = next((r["ms"] for r in rows if r["method"] == meth and r["ms"]), None)
                if base and me:
                    xs.append(c["P"])
                    ys.append(base / me)
            if xs:
                ax.plot(xs, ys, marker="o", label=meth)
        ax.plot([c["P"] for c in cases], [c["ideal_ratio"] for c in cases], "k--", label="ideal (pairs ratio)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("prompt length P")
        ax.set_ylabel("speedup over SDPA-flash, duplicated batch (fwd+bwd)")
        ax.set_title(f"R = {R} (N: " + ", ".join(f"P{c['P']}:N{c['N']}" for c in cases) + ")", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    m = results["meta"]
    fig.suptitle(f"{m['device']}, torch {m['torch']}, Hq={m['hq']} Hkv={m['hkv']} D={m['d']} {m['dtype']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
