"""The README's commands are what CI runs: a newcomer who copies them gets what CI proves."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest
from test_config import modules_with_a_main

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


def test_the_bounds_readme_states_are_the_servers():
    """README's 'Bounded inputs' and its neighbours quote policy_server/limits.py: a bound changed there must change
    here too."""
    from policy_server import limits as L

    def g(x: float) -> str:
        return f"{x:g}"

    text = " ".join((ROOT / "README.md").read_text().split())
    stated = [
        f"an instruction of at most {L.MAX_INSTRUCTION_TOKENS} tokens",
        f"a `Reason` prompt of at most {L.MAX_PROMPT_TOKENS}",
        f"after a {L.MAX_TEXT_BYTES // 1024} KiB byte check",
        f"a `client_name` of at most {L.MAX_CLIENT_NAME_CHARS} printable characters",
        f"a `request_id` of {L.MIN_REQUEST_ID_CHARS} to {L.MAX_REQUEST_ID_CHARS} characters",
        f"budgets up to {g(L.MAX_BUDGET_MS / 1000)} s",
        f"rates of 0 (a closed loop) or {g(L.MIN_RATE_HZ)} to {g(L.MAX_RATE_HZ)} Hz",
        f"temperatures up to {g(L.MAX_TEMPERATURE)}",
        f"(8..{L.MAX_FRAME_SIDE} px",
        f"{g(L.MAX_FRAME_RATE_HZ)} observation frames a second per `Control` stream",
        f"at most {L.MAX_PENDING_FRAMES} `must_answer` frames waiting per stream",
        f"at most {L.MAX_QUEUED_EVENTS} events waiting per stream",
        f"must send its `start` within {g(L.CONTROL_START_S)} s",
        f"at most {L.MAX_STARTING_STREAMS} streams wait for theirs at once",
        f"`Limits.max_dynamics_ms` ({g(L.MAX_DYNAMICS_MS / 1000)} s)",
        f"beyond {L.MAX_REFLECTION_STREAMS} open at once",
        f"a burst of {L.MAX_REFUSED_MESSAGES} at {g(L.REFUSED_MESSAGES_HZ)} per second",
        f"at least {L.MIN_TOKEN_CHARS} characters",
        f"{['No', 'One', 'Two', 'Three', 'Four'][L.MAX_REASON_CALLS]} `Reason` calls run at once",
    ]
    assert [s for s in stated if s not in text] == []


OTHER_TOOLS_FLAGS = {"--build", "--gpus", "--head", "--no-deps"}  # docker compose / docker run, ray start, pip


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy: imported by earlier tests
def test_every_flag_the_readmes_name_is_one_a_command_takes(monkeypatch, capsys):
    """A flag renamed or dropped in a parser, and still in README, fails a newcomer's copy-paste with 'unrecognized
    arguments'."""
    taken = set(OTHER_TOOLS_FLAGS)
    for module in modules_with_a_main():
        monkeypatch.setattr(sys, "argv", [module, "--help"])
        with pytest.raises(SystemExit):
            runpy.run_module(module, run_name="__main__")
        taken |= set(re.findall(r"--[a-z][a-z0-9-]*", capsys.readouterr().out))
    for readme in (ROOT / "README.md", ROOT / "robots" / "README.md"):
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", readme.read_text()))
        assert sorted(named - taken) == [], readme.relative_to(ROOT)


def test_the_robot_snippet_waits_out_the_first_start_readme_states():
    """README's robot snippet calls `wait_until_serving()` as a newcomer runs it, right after starting the server.
    With a 60 s default it raised TimeoutError during a first start's warmup (SERVING after 67 s on the 2-core machine
    README measures on), so its default must outlast that start on a machine twice as slow."""
    import inspect

    from policy_server.client import PolicyClient

    text = " ".join((ROOT / "README.md").read_text().split())
    warmup_s = float(re.search(r"the embedded model's warmup takes (\d+) s on a first start", text)[1])
    loading_s = float(re.search(r"after about (\d+) s of loading the model", text)[1])
    assert "client.wait_until_serving()" in text
    default_s = inspect.signature(PolicyClient.wait_until_serving).parameters["timeout_s"].default
    assert default_s >= 2 * (warmup_s + loading_s)
