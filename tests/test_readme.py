"""The README's commands are what CI runs: a newcomer who copies them gets what CI proves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    test_commands = [c for c in _readme_commands() if c.endswith("python -m pytest")]
    assert len(test_commands) == 1, test_commands
    assert test_commands[0] in ci, "the README's test command must appear verbatim as a line of .ci/run"


def _anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(markdown: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", markdown.read_text(), flags=re.S)
    return {_anchor(heading) for heading in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_every_link_between_the_docs_reaches_its_file_and_heading():
    """A link that moved with its text (HISTORY.md's 'On a GPU' pointed into itself) lands nowhere."""
    broken = []
    docs = [ROOT / "README.md", *sorted((ROOT / "robots").glob("*.md")), *sorted((ROOT / "docs").rglob("*.md"))]
    for markdown in docs:
        for target in re.findall(r"\]\(([^)\s]+)\)", markdown.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (markdown.parent / path).resolve() if path else markdown
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
                broken.append(f"{markdown.relative_to(ROOT)}: {target}")
    assert not broken, broken
