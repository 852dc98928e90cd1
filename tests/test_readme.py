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
