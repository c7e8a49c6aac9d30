"""The documentation holds together: every relative link in README.md, docs/ and benchmarks/ points at
a file that exists (and, with an anchor, at a heading of that file, slugged as GitHub slugs it); the
README stays a front page; and its test command is the one CI runs (.ci/run)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
TEST_COMMAND = "bash scripts/setup.sh && .venv/bin/python -m pytest -q"

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the target ends at whitespace (an optional "title" follows) or ")"
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]
    return [f for f in files if f.is_file()]


def prose_lines(text: str, keep_code: bool = False) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code spans blanked out unless
    `keep_code` (headings may contain them)."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line if keep_code else INLINE_CODE.sub("", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, punctuation but '-' and '_'
    dropped, spaces turned into '-' (so "Auto layout (`parallel.layout = "auto"`)" gives
    "auto-layout-parallellayout--auto")."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file; repeated headings get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(), keep_code=True):
        found = HEADING.match(line)
        if not found:
            continue
        base = slug(found[2])
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path: Path) -> list[tuple[int, str]]:
    links = []
    for number, line in prose_lines(path.read_text()):
        for target in LINK.findall(line):
            if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, mailto:, ...
                continue
            links.append((number, target))
    return links


def dead_links() -> list[str]:
    dead, cache = [], {}
    for source in markdown_files():
        for number, target in relative_links(source):
            file_part, _, anchor = target.partition("#")
            where = f"{source.relative_to(ROOT)}:{number}: {target}"
            dest = (source.parent / file_part).resolve() if file_part else source
            if not dest.exists():
                dead.append(f"{where} (no such file)")
                continue
            if anchor and dest.suffix == ".md":
                if dest not in cache:
                    cache[dest] = anchors(dest)
                if anchor not in cache[dest]:
                    dead.append(f"{where} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    return dead


def test_every_relative_link_points_at_a_file_and_heading():
    assert markdown_files(), "no markdown found"
    assert dead_links() == []


def test_the_link_checker_sees_links_and_slugs_as_github_does(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        '# Auto layout and elastic re-layout (`parallel.layout = "auto"`)\n'
        "## DeepSeek-V3's layout in miniature\n## Notes\n## Notes\n"
        "[a](#auto-layout-and-elastic-re-layout-parallellayout--auto) [b](#deepseek-v3s-layout-in-miniature)\n"
        "[c](#notes-1) ![d](missing.png) `[not a link](nowhere.md)`\n"
        "```\n[inside a fence](nowhere.md)\n```\n[e](https://example.com)\n"
    )
    assert {"auto-layout-and-elastic-re-layout-parallellayout--auto", "notes", "notes-1"} <= anchors(page)
    assert [t for _, t in relative_links(page)] == [
        "#auto-layout-and-elastic-re-layout-parallellayout--auto",
        "#deepseek-v3s-layout-in-miniature",
        "#notes-1",
        "missing.png",
    ]


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def bash_blocks(text: str) -> list[list[str]]:
    blocks, current = [], None
    for line in text.splitlines():
        if current is None:
            if line.strip() == "```bash":
                current = []
        elif line.strip() == "```":
            blocks.append(current)
            current = None
        else:
            current.append(line.strip())
    return blocks


def test_readme_test_command_is_the_one_ci_runs():
    assert [TEST_COMMAND] in bash_blocks((ROOT / "README.md").read_text()), "README lost its test command"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in ci if line and not line.startswith("#")]
    parts = TEST_COMMAND.split(" && ")
    at = [commands.index(part) for part in parts if part in commands]
    assert len(at) == len(parts) and at == sorted(at), f".ci/run does not run {parts} in order: {commands}"
    assert [c for c in commands if "pytest" in c] == [parts[-1]], "CI's test command differs from the README's"


@pytest.mark.parametrize(
    "path", ["docs/parity.md", "docs/planner-vs-published.md", "benchmarks/RESULTS.md"], ids=lambda p: p
)
def test_pages_other_files_name_exist(path):
    assert (ROOT / path).is_file()
