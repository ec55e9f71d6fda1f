"""The docs against the tree: docs/layout.md lists every package file, every design citation names docs/design.md,
module docstrings are short contracts, and no device model or date sits in package code.

A newcomer reads docs/layout.md to find a file's job and docs/design.md for the rules the code cites ("semantics N");
these tests keep both true as files come and go, and keep measurements in docs/benchmarks.md.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dualkv_compile"
LAYOUT = ROOT / "docs" / "layout.md"
DESIGN = ROOT / "docs/design.md"

# What cites the design: the package, its tests, docs, benchmarks, examples and the README.
CITING = ["dualkv_compile", "tests", "docs", "benchmarks", "examples", "README.md"]
TEXT_SUFFIXES = {".py", ".md", ".sh", ".txt", ".toml", ".cfg", ".yaml", ".yml"}
# A file name of the design (any case), with whatever path is written before it.
DESIGN_NAME = re.compile(r"[\w./-]*design\.md", re.IGNORECASE)
SEMANTICS = re.compile(r"\bsemantics (\d+)(?:\s*-\s*(\d+))?")


def package_files() -> set[str]:
    """Every .py file of the package, by its path relative to ``dualkv_compile/``."""
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


def package_folders() -> set[str]:
    """Every subpackage, as ``name/`` relative to ``dualkv_compile/``."""
    return {p.relative_to(PACKAGE).parent.as_posix() + "/" for p in PACKAGE.rglob("__init__.py")} - {"./"}


def layout_entries(text: str) -> list[tuple[str, str]]:
    """``(path, job)`` per entry of the package listing: the first code block after the ``## dualkv_compile/``
    heading, one entry a line (``path  job``); indented lines continue the entry above."""
    section = text.split("## dualkv_compile/", 1)[1]
    block = section.split("```", 2)[1]
    entries = []
    for line in block.splitlines()[1:]:  # the first is the fence's language tag (empty)
        if not line.strip() or line[0].isspace():
            continue
        path, _, job = line.partition(" ")
        entries.append((path, job.strip()))
    return entries


def test_layout_entries_reads_paths_and_jobs():
    text = "intro\n## dualkv_compile/\n\n```\na.py     job a\n         more of a\nsub/     the sub\nsub/b.py b\n```\n"
    assert layout_entries(text) == [("a.py", "job a"), ("sub/", "the sub"), ("sub/b.py", "b")]


def test_layout_lists_every_package_file_and_no_other():
    entries = layout_entries(LAYOUT.read_text())
    listed = {path for path, _ in entries}
    files, folders = package_files(), package_folders()
    missing = sorted((files | folders) - listed)
    stale = sorted(listed - files - folders)
    assert not missing, f"docs/layout.md does not list these files of dualkv_compile/ (add each with its job): {missing}"
    assert not stale, f"docs/layout.md lists files that are not in dualkv_compile/: {stale}"
    no_job = [path for path, job in entries if not job]
    assert not no_job, f"docs/layout.md lists these without a job: {no_job}"
    twice = sorted({path for path, _ in entries if [p for p, _ in entries].count(path) > 1})
    assert not twice, f"docs/layout.md lists these twice: {twice}"


def _citing_files() -> list[pathlib.Path]:
    files = []
    for name in CITING:
        path = ROOT / name
        found = [path] if path.is_file() else sorted(path.rglob("*"))
        files += [p for p in found if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts]
    return files


def _resolves_to_design(path: pathlib.Path, name: str) -> bool:
    """``name`` (as written in ``path``) names docs/design.md: from the repository root, or relative to a doc."""
    if name == "docs/design.md":
        return True
    return path.parent == DESIGN.parent and path.suffix == ".md" and (path.parent / name).resolve() == DESIGN


def test_every_design_citation_names_docs_design_md():
    bad = []
    for path in _citing_files():
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for name in DESIGN_NAME.findall(line):
                if not _resolves_to_design(path, name):
                    bad.append(f"{path.relative_to(ROOT)}:{lineno}: {name}")
    assert DESIGN.is_file()
    assert not bad, "design citations that do not name docs/design.md (the design lives in the repository):\n" + "\n".join(bad)


def test_every_cited_semantics_number_is_defined():
    """A "semantics N" citation names a rule docs/design.md numbers, and its file says where the rules are."""
    defined = {int(n) for n in re.findall(r"^(\d+)\. \*\*", DESIGN.read_text(), re.MULTILINE)}
    assert defined == set(range(1, len(defined) + 1)), sorted(defined)
    bad = []
    for path in _citing_files():
        text = path.read_text(errors="replace")
        cited = [int(n) for m in SEMANTICS.finditer(text) for n in m.groups() if n]
        if path == DESIGN or not cited:
            continue
        undefined = sorted(set(cited) - defined)
        if undefined:
            bad.append(f"{path.relative_to(ROOT)}: semantics {undefined} are not in docs/design.md")
        if not DESIGN_NAME.search(text):
            bad.append(f"{path.relative_to(ROOT)}: cites semantics {sorted(set(cited))} but never names docs/design.md")
    assert not bad, "\n".join(bad)


# Device models and dates: measurements and history belong in docs/benchmarks.md and the results, not in the code
# (arch names such as sm_90 or Hopper, which the code dispatches on, are fine).
DEVICE_MODEL = re.compile(r"(?<![A-Za-z0-9])(?:GB200|B100|B200|H100|H200|H800|A100|A800|V100|L40S|MI250X?|MI300X?)"
                          r"(?![0-9])", re.IGNORECASE)
DATE = re.compile(r"(?<!\d)20\d\d-[01]\d-[0-3]\d(?!\d)")
MAX_MODULE_DOCSTRING = 25


def module_docstring_lines(source: str) -> int:
    """How many lines a module's docstring spans (its quotes included), 0 without one."""
    body = ast.parse(source).body
    if not body or not isinstance(body[0], ast.Expr) or not isinstance(body[0].value, ast.Constant):
        return 0
    if not isinstance(body[0].value.value, str):
        return 0
    return body[0].end_lineno - body[0].lineno + 1


def test_module_docstring_lines_counts_the_docstring_only():
    assert module_docstring_lines('"""One line."""\nx = 1\n') == 1
    assert module_docstring_lines('"""First.\n\nThird.\n"""\n\nimport os\n') == 4
    assert module_docstring_lines("import os\n") == 0


def test_module_docstrings_are_contracts_of_at_most_25_lines():
    """A module docstring says what the module assumes and guarantees; how it works and why go to docs/design.md,
    measurements to docs/benchmarks.md."""
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        n = module_docstring_lines(path.read_text())
        if n > MAX_MODULE_DOCSTRING:
            long[path.relative_to(ROOT).as_posix()] = n
    assert not long, f"module docstrings over {MAX_MODULE_DOCSTRING} lines: {long}"


def test_device_patterns_find_models_and_dates_only():
    assert DEVICE_MODEL.search("measured on an H200") and DEVICE_MODEL.search("results/foo_h100_x.md")
    assert DATE.search("gluon_tuning_2026-11-25h") and DATE.search("(2026-11-27)")
    assert not DEVICE_MODEL.search("a Hopper (sm_90) GPU, capability 9.0, SM count 132")
    assert not DATE.search("T = 2048-4096 tokens, 0x2026-11")


def test_no_device_model_or_date_in_package_code():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for pattern in (DEVICE_MODEL, DATE):
                m = pattern.search(line)
                if m:
                    found.append(f"{path.relative_to(ROOT)}:{lineno}: {m.group(0)}")
    assert not found, ("device models or dates in package code (say the arch, and move measurements to "
                       "docs/benchmarks.md with a link):\n" + "\n".join(found))
