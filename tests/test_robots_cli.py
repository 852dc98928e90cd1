"""The commands in robots/README.md run as written on a fresh checkout, in the README's order, from an
empty working directory: each reads what the one before it wrote. Only their sizes are shrunk, by
appending flags (argparse keeps an option's last value)."""

from __future__ import annotations

import importlib
import json
import math
import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "robots" / "README.md"

# How each documented command is run in-process, and the flags that shrink it to a second or two.
COMMANDS = {
    ("python", "-m", "robots.datagen"): ("robots.datagen", ["--episodes", "3", "--no-progress"]),
    ("python", "-m", "robots.train_vae"): ("robots.train_vae", ["--steps", "2", "--batch-size", "2", "--no-progress"]),
    ("python", "-m", "robots.train_policy"): ("robots.train_policy", ["--steps", "2", "--batch-size", "2",
                                                                      "--save-every", "1"]),
    ("policy-rollout",): ("robots.rollout", ["--episodes", "1", "--num-steps", "2", "--execute", "8"]),
}


def readme_commands() -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return [shlex.split(line) for line in lines]


def split_command(words: list[str]) -> tuple[str, list[str]]:
    """The module whose ``main`` runs ``words``, and its shrunk arguments."""
    for program, (module, shrink) in COMMANDS.items():
        if tuple(words[: len(program)]) == program:
            return module, [*words[len(program):], *shrink]
    raise AssertionError(f"robots/README.md documents a command this test does not know: {shlex.join(words)}")


def test_readme_documents_the_whole_chain_with_relative_paths():
    commands = readme_commands()
    assert [split_command(words)[0] for words in commands] == [
        "robots.datagen", "robots.datagen", "robots.train_vae", "robots.train_policy",
        "robots.datagen", "robots.datagen", "robots.train_policy", "robots.rollout"]  # the ReachEither fine-tune
    for words in commands:
        assert not [w for w in words if w.startswith("/")], f"absolute path in {shlex.join(words)}"


def test_readme_commands_run_in_order_from_an_empty_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for words in readme_commands():
        module, argv = split_command(words)
        try:
            importlib.import_module(module).main(argv)
        except SystemExit as exit_:  # a usage error: show which command and why
            pytest.fail(f"{shlex.join(words)} exited {exit_.code}: {capsys.readouterr().err.splitlines()[-1:]}")
    runs = tmp_path / "runs"
    assert json.loads((runs / "data" / "reach-9000" / "dataset.json").read_text())["num_episodes"] == 3
    lerobot = json.loads((runs / "data" / "reach-9000-lerobot" / "meta" / "info.json").read_text())
    assert (lerobot["codebase_version"], lerobot["total_episodes"]) == ("v3.0", 3)
    assert json.loads((runs / "vae" / "train_report.json").read_text())["steps"] == 2
    training = json.loads((runs / "policy" / "training.json").read_text())
    assert training["steps"] == 2 and math.isfinite(training["final_loss"])
    either = json.loads((runs / "data" / "either-4000" / "dataset.json").read_text())
    assert either["env_id"] == "PolicyServer/ReachEither-v0" and either["targets_per_scene"] == 2
    tuned = json.loads((runs / "policy-either" / "training.json").read_text())
    assert tuned["init"] == "runs/policy" and tuned["episodes"] == 6  # both datasets pooled
    rollout = json.loads((runs / "rollout.json").read_text())
    assert rollout["episodes"] == 1 and rollout["config"]["diffusion_cache"] is False
    assert (runs / "rollout.png").is_file()
