"""Every relative link in README.md and docs/*.md leads to a file of the repository, and
a link to a section (``file.md#section``) to a heading that file has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, inline code removed."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(INLINE_CODE.sub("", line))
    return lines


def links(page: Path) -> list[str]:
    return [m.group(1) for line in _prose_lines(page.read_text()) for m in LINK.finditer(line)]


def anchors(page: Path) -> set[str]:
    """GitHub's ids for the page's headings: lower case, punctuation dropped, spaces
    to hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_the_pages_exist():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    for name in ("README.md", "docs/serving.md", "docs/configuration.md", "docs/scaling.md",
                 "docs/benchmarks.md", "docs/development.md"):
        assert name in names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif not dest.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: {dest.name} has no heading #{fragment}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_link_check_sees_links_and_headings(tmp_path):
    """The checker itself: a link in prose counts, one in code does not; ids as GitHub's."""
    page = tmp_path / "page.md"
    page.write_text("# A title\n\n## The API (`x/y.proto`)\n\nsee [a](b.md#c) and `[d](e.md)`\n"
                    "```\n[f](g.md)\n## not a heading\n```\n## A title\n")
    assert links(page) == ["b.md#c"]
    assert anchors(page) == {"a-title", "the-api-xyproto", "a-title-1"}
