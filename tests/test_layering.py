"""Dependencies point one way: `robots` builds on `policy_server`, never the reverse. No module under
policy_server/ imports `robots`, not even lazily inside a function; `policy-server bench` reaches the
robot-side bench through the `policy_server.commands` entry point instead."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "policy_server"


def robots_imports(path: Path) -> list[str]:
    """`line: statement` for every import of `robots` in the file: `import` / `from ... import` statements
    anywhere in it, and `importlib.import_module` / `__import__` calls with a literal name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            function = node.func
            called = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [(node.lineno, name) for name in names if name == "robots" or name.startswith("robots.")]
    return [f"{line}: {name}" for line, name in sorted(found)]


def test_no_policy_server_module_imports_robots():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 50  # the whole package was walked
    offenders = {str(path.relative_to(PACKAGE.parent)): hits for path in modules if (hits := robots_imports(path))}
    assert offenders == {}


def test_the_walk_sees_lazy_and_dynamic_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom policy_server import cli\nimport robotsx\n"
                      "def f():\n    from robots.bench import main\n    import robots\n"
                      "    importlib.import_module('robots.rollout')\n")
    assert robots_imports(module) == ["5: robots.bench", "6: robots", "7: robots.rollout"]


def test_the_bench_subcommand_is_an_installed_entry_point():
    commands = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="policy_server.commands")}
    assert commands.get("bench") == "robots.bench:main", "run `pip install -e .` to register the entry points"
