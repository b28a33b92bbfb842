"""The user documentation as tests read it: README.md and docs/*.md, their fenced code blocks,
their links and GitHub's heading anchors."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^```(\S*)\n(.*?)^```[ \t]*$", re.S | re.M)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)


@dataclass(frozen=True)
class Block:
    """One fenced code block: its page, its number among the page's blocks, its language."""

    page: Path
    index: int
    language: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}#{self.index}"


def pages() -> list[Path]:
    """README.md, then every page under docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    return [Block(page, i, m.group(1), m.group(2))
            for i, m in enumerate(_FENCE.finditer(page.read_text()))]


def prose(page: Path) -> str:
    """The page without its fenced code blocks."""
    return _FENCE.sub("", page.read_text())


def links(page: Path) -> list[str]:
    """Every link target written in the page's prose, as written."""
    return _LINK.findall(prose(page))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than '-'
    and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The page's heading anchors, repeated headings numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    result = set()
    for heading in _HEADING.findall(prose(page)):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result
