"""Every relative link in README.md and docs/**/*.md points at a file that exists, and every #anchor at a heading
(or an explicit id) of the page it names, as GitHub renders them. Pure Python, no network."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXPLICIT_ID = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, with their numbers."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)  # emphasis underscores, not those inside words
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    text = path.read_text(encoding="utf-8")
    for _, line in prose_lines(path):
        heading = HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    found |= set(EXPLICIT_ID.findall(text))
    return found


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(path):
        line = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)  # `[a](b)` in code is not a link
        found += [(number, target) for target in LINK.findall(line)]
        reference = REFERENCE.match(line)
        if reference:
            found.append((number, reference.group(1)))
    return found


def broken_links() -> list[str]:
    problems, cache = [], {}
    for document in documents():
        for number, target in links(document):
            if EXTERNAL.match(target):
                continue
            place = f"{document.relative_to(ROOT)}:{number}: {target}"
            file_part, _, anchor = target.partition("#")
            linked = (document.parent / unquote(file_part)).resolve() if file_part else document
            if not linked.exists():
                problems.append(f"{place}: no such file")
                continue
            if anchor and linked.suffix == ".md":
                if linked not in cache:
                    cache[linked] = anchors(linked)
                if unquote(anchor) not in cache[linked]:
                    problems.append(f"{place}: no heading with that anchor in {linked.relative_to(ROOT)}")
    return problems


def test_slug_follows_github():
    assert slug("Before you launch: `meshtune doctor`") == "before-you-launch-meshtune-doctor"
    assert slug("Kubernetes (Kubeflow PyTorchJob)") == "kubernetes-kubeflow-pytorchjob"
    assert slug("One node, 1 → 2 GPUs") == "one-node-1--2-gpus"
    assert slug("The `preflight_key` and **bold**") == "the-preflight_key-and-bold"


def test_every_relative_link_and_anchor_resolves():
    assert documents()[1:], "no docs/ pages found"
    problems = broken_links()
    assert not problems, "broken links:\n" + "\n".join(problems)
