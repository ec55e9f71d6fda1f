"""The docs against the tree: docs/layout.md lists every package file, and every design citation names docs/design.md.

A newcomer reads docs/layout.md to find a file's job and docs/design.md for the rules the code cites ("semantics N");
these tests keep both true as files come and go.
"""

from __future__ import annotations

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
