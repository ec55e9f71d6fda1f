"""The README is a newcomer's first screen (at most 200 lines), and every relative link in it and in docs/ names a
file or folder that is committed: a claim that links to a result must link to one that exists."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    """The targets of markdown links that point into the repository (no scheme, no pure anchor)."""
    return [t.split("#")[0] for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_relative_links_finds_file_links_and_skips_urls():
    text = "[a](docs/x.md) [b](https://example.com) [c](#anchor) [d](../y/z.md#part)"
    assert relative_links(text) == ["docs/x.md", "../y/z.md"]


def test_readme_is_one_screen_of_at_most_200_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc):
    missing = [t for t in relative_links(doc.read_text()) if not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to files that do not exist: {missing}"
