"""One result schema for every benchmark: what ran, where, with which versions, when, and what it measured.

    stamp = harness.stamp("model_gpu", device="cuda", script=__file__, argv=argv)
    harness.write_json(os.path.join(out, "model_gpu.json"), harness.record(stamp, meta=meta, rows=rows))
    out = args.out or harness.result_dir(stamp)     # benchmarks/results/model_gpu/h200-2026-12-02/

A record (the JSON a script writes) has exactly the top-level keys ``KEYS``:

    schema    SCHEMA (1)
    bench     the benchmark's name: its folder under benchmarks/results/
    device    what ran it: "NVIDIA H200", "4 x NVIDIA H100 80GB HBM3", "cpu (x86_64, 2 cores)"
    versions  {"python", "torch", "triton", "transformers", "cuda"}: None where one is not installed
    date      when it was stamped, "YYYY-MM-DD HH:MM UTC"
    command   the command line, from the repository root ("python benchmarks/model/model_gpu.py --models 0.6b")
    meta      the run's settings, the script's own (shapes, dtype, repetitions; older readers find device and
              versions here too)
    rows      the measured rows, a list ([] where the result is no table)
    results   the other measured values, a dict ({} where the rows hold everything)

Markdown reports start with ``markdown_stamp(stamp)``: the same device, versions, date and command.
Imports nothing of benchmarks/ and nothing heavy: torch only where a device is named.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import sys
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
SCHEMA = 1
STAMP_KEYS = ("schema", "bench", "device", "versions", "date", "command")
KEYS = STAMP_KEYS + ("meta", "rows", "results")
VERSIONED = ("torch", "triton", "transformers")


def versions() -> dict:
    """Python's, torch's, Triton's and transformers' versions (installed distributions, None where absent) and the
    CUDA torch was built with (None on a CPU build)."""
    out = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["cuda"] = None
    if out["torch"] is not None:
        import torch

        out["cuda"] = torch.version.cuda
    return out


def device_name(device=None, gpus: int = 1) -> str:
    """The device a run used: the GPU's name (``gpus`` > 1: "N x name") for "cuda" (or None where CUDA is
    available), else the CPU: "cpu (machine, N cores)"."""
    kind = getattr(device, "type", device)
    if kind is None or str(kind).startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name()
            return f"{gpus} x {name}" if gpus > 1 else name
        if kind is not None:
            raise ValueError(f"device {device!r}: CUDA is not available")
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


# A GPU model in a device name: H100, H200, A100, B200, L40S, MI300X, RTX 4090, ...
_MODEL = re.compile(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b")


def device_slug(device: str) -> str:
    """The folder name of a device: "NVIDIA H200" -> "h200", "4 x NVIDIA H100 80GB HBM3" -> "4xh100", any CPU ->
    "cpu"; otherwise the name in lower case, letters and digits only."""
    if device.startswith("cpu"):
        return "cpu"
    count, _, name = device.partition(" x ") if " x " in device else ("", "", device)
    m = _MODEL.search(name)
    slug = m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return f"{count}x{slug}" if count else slug


def command(script: str | None = None, argv=None) -> str:
    """The command line that ran ``script`` (default: the main script) with ``argv`` (default: ``sys.argv[1:]``),
    its path relative to the repository root."""
    script = os.path.abspath(script or sys.argv[0])
    rel = os.path.relpath(script, ROOT)
    argv = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(["python", rel if not rel.startswith("..") else script, *map(str, argv)])


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def stamp(bench: str, *, device=None, gpus: int = 1, script: str | None = None, argv=None) -> dict:
    """The stamp of one run of ``bench``: ``STAMP_KEYS`` (``device``: a torch device, "cuda", "cpu" or None for
    CUDA where available; or a name already, "cpu (...)" / a GPU's)."""
    named = isinstance(device, str) and device.split(":")[0] not in ("cuda", "cpu")
    name = device if named else device_name(device, gpus)
    return dict(schema=SCHEMA, bench=bench, device=name, versions=versions(), date=now(),
                command=command(script, argv))


def record(stamp: dict, *, meta: dict | None = None, rows: list | None = None, results: dict | None = None) -> dict:
    """A record of ``KEYS``: ``stamp`` with the run's ``meta``, ``rows`` and ``results``."""
    missing = [k for k in STAMP_KEYS if k not in stamp]
    if missing:
        raise ValueError(f"record: the stamp lacks {missing}: expected harness.stamp()'s keys {list(STAMP_KEYS)}")
    return dict({k: stamp[k] for k in STAMP_KEYS}, meta=dict(meta or {}), rows=list(rows or []),
                results=dict(results or {}))


def is_record(doc) -> bool:
    """Whether ``doc`` (a loaded JSON) is a record of this schema."""
    return isinstance(doc, dict) and set(doc) == set(KEYS) and doc.get("schema") == SCHEMA


def write_json(path: str, rec: dict, indent: int = 1) -> str:
    """Write record ``rec`` to ``path`` (its folder made; replaced atomically, so a run killed mid-write keeps the
    last whole file); ValueError for a dict that is not a record."""
    if not is_record(rec):
        raise ValueError(f"write_json: expected a record with keys {list(KEYS)}, got keys {sorted(rec)}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(rec, f, indent=indent, default=str)
    os.replace(path + ".tmp", path)
    return path


def payload(doc: dict) -> dict:
    """A record's measured part as one flat dict (``results`` with ``meta`` and ``rows`` beside it); a JSON written
    before this schema, as it is."""
    if not is_record(doc):
        return doc
    return dict(doc["results"], meta=doc["meta"], rows=doc["rows"])


def result_dir(stamp: dict, root: str = RESULTS) -> str:
    """Where a run's results go: ``benchmarks/results/<bench>/<device slug>-<YYYY-MM-DD>/``."""
    return os.path.join(root, stamp["bench"], f"{device_slug(stamp['device'])}-{stamp['date'][:10]}")


def markdown_stamp(stamp: dict) -> list[str]:
    """The stamp as the first lines of a Markdown report."""
    v = stamp["versions"]
    vs = ", ".join(f"{k} {v[k]}" for k in ("torch", "triton", "transformers", "cuda", "python") if v.get(k))
    return [f"- device: {stamp['device']}; {vs}; date {stamp['date']}", f"- command: `{stamp['command']}`"]
