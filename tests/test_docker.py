"""Dockerfile and docker-compose.yml are correct by construction (no Docker engine here): every
referenced file, console script and flag exists, the image can serve a Cosmos3 checkpoint, the GPU is reserved,
the network is internal, the server's caches live in a volume, the build context holds what the image needs."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from policy_server import cli
from policy_server.client import __main__ as client_cli

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


@pytest.fixture(scope="module")
def scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def module_file(entry_point: str) -> Path:
    module = entry_point.split(":")[0]
    return REPO / (module.replace(".", "/") + ".py")


def exec_form(args: str) -> list[str]:
    return json.loads(args) if args.startswith("[") else shlex.split(args)


def test_dockerfile_copies_existing_paths_and_runs_the_server(dockerfile, scripts):
    instructions = dict(dockerfile)
    assert instructions["FROM"].startswith("python:3.11")
    for keyword, args in dockerfile:
        if keyword == "COPY":
            *sources, _dest = args.split()
            for source in sources:
                assert (REPO / source).exists(), f"COPY source {source} missing"
    assert "torch==2.13.0" in " ".join(a for k, a in dockerfile if k == "RUN")
    assert "install -y --no-install-recommends g++" in " ".join(a for k, a in dockerfile if k == "RUN")  # compiles
    assert 'pip install ".[cosmos3]"' in [a for k, a in dockerfile if k == "RUN"]  # a checkpoint's Wan2.2 VAE
    entrypoint = exec_form(instructions["ENTRYPOINT"])
    assert entrypoint == ["policy-server"] and module_file(scripts["policy-server"]).exists()
    config = cli.config_from_args(exec_form(instructions["CMD"]))  # the default flags validate
    assert config.device == "cuda" and config.port == 50051
    assert set(instructions["EXPOSE"].split()) == {"50051", "8000", "9464"}
    assert config.metrics_port == 9464  # exposed, and not Prometheus' own 9090
    assert instructions["USER"] != "root"


def test_healthchecks_use_the_client_probe(dockerfile, compose):
    docker_check = dict(dockerfile)["HEALTHCHECK"]
    probe = exec_form(docker_check[docker_check.index("CMD") + 3:].strip())
    compose_probe = compose["services"]["policy-server"]["healthcheck"]["test"]
    assert compose_probe[0] == "CMD" and compose_probe[1:] == probe
    assert probe[:3] == ["python", "-m", "policy_server.client"]
    args = client_cli.build_parser().parse_args(probe[3:])  # the probe's flags are the client's
    assert (args.command, args.server) == ("health", "127.0.0.1:50051")


def test_compose_server_reserves_a_gpu_on_an_internal_network(compose):
    server = compose["services"]["policy-server"]
    assert (REPO / server["build"]["context"] / server["build"]["dockerfile"]).exists()
    assert server["init"] is True  # PID 1 ignores a signal left at its default action: an init passes them on
    devices = server["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert compose["networks"]["robot-net"]["internal"] is True
    assert server["networks"] == ["robot-net"]
    for mapping in server.get("ports", []):
        assert str(mapping).startswith("127.0.0.1:"), f"port {mapping} would be exposed beyond loopback"
    config = cli.config_from_args(server["command"])
    assert (config.port, config.metrics_port, config.websocket_port) == (50051, 9464, 8000)


def test_compose_robot_waits_for_a_healthy_server(compose, scripts):
    robot = compose["services"]["robot"]
    assert robot["image"] == compose["services"]["policy-server"]["image"]
    assert robot["depends_on"]["policy-server"]["condition"] == "service_healthy"
    assert robot["networks"] == ["robot-net"]
    assert robot["command"][robot["command"].index("--server") + 1] == "policy-server:50051"
    assert robot["entrypoint"] == ["policy-rollout"] and "policy-rollout" in scripts
    # The script sets gRPC core's log level, then runs robots.rollout's main
    assert scripts["policy-rollout"] == "robots.console:rollout" and module_file(scripts["policy-rollout"]).exists()
    assert "--server" in (REPO / "robots" / "rollout.py").read_text(), "policy-rollout must accept --server HOST:PORT"


def test_compose_keeps_the_servers_caches_in_a_volume(dockerfile, compose):
    """Compiled kernels, quality profiles and Hub downloads all go under the user's ~/.cache, which a named volume
    holds; the image makes that folder as the user, so that a new volume takes the user's ownership."""
    user = dict(dockerfile)["USER"]
    home_cache = f"/home/{user}/.cache"
    assert f"useradd --create-home --uid 10001 {user}" in [a for k, a in dockerfile if k == "RUN"]
    env = dict(pair.split("=", 1) for k, a in dockerfile if k == "ENV" for pair in shlex.split(a))
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(home_cache + "/")
    assert not {"XDG_CACHE_HOME", "HF_HOME", "POLICY_SERVER_CACHE"} & set(env)  # their defaults are under ~/.cache
    assert home_cache in made_by_the_user(dockerfile)
    volume, target = compose["services"]["policy-server"]["volumes"][0].split(":")
    assert target == home_cache and volume in compose["volumes"]


def made_by_the_user(dockerfile: list[tuple[str, str]]) -> list[str]:
    """The folders the image makes after its USER instruction, which a new named volume mounted there takes the
    ownership of."""
    user = dict(dockerfile)["USER"]
    after_user = dockerfile[dockerfile.index(("USER", user)):]
    return [folder for keyword, args in after_user if keyword == "RUN" and args.startswith("mkdir -p ")
            for folder in args.removeprefix("mkdir -p ").split()]


def test_compose_robot_writes_its_report_into_a_volume_the_user_owns(dockerfile, compose):
    """Its default --out, rollout.json in the working folder, is root's in the image: the rollout ran its episodes and
    ended in a traceback (PermissionError), its report lost."""
    robot = compose["services"]["robot"]
    out = Path(robot["command"][robot["command"].index("--out") + 1])
    volume, target = robot["volumes"][0].split(":")
    assert out.parent == Path(target) and volume in compose["volumes"]
    assert target in made_by_the_user(dockerfile)


def dockerignore_rules() -> list[tuple[re.Pattern, bool]]:
    """.dockerignore's patterns as (regex, excludes), read as Docker's pattern matcher reads them: Go's filepath.Match
    (`*` and `?` stop at a `/`) plus `**` for any number of folders, a leading `!` re-includes, the last match wins."""
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        excludes = not line.startswith("!")
        pattern = line.removeprefix("!").strip().strip("/")
        regex, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex, i = regex + pattern[i:end + 1], end + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((re.compile(f"^{regex}$"), excludes))
    return rules


def sent_to_the_daemon(path: str, rules: list[tuple[re.Pattern, bool]]) -> bool:
    """Whether the build context holds `path` (relative to the context): a pattern that matches a folder above it
    matches it too, and the last pattern that matches decides."""
    parts = path.split("/")
    excluded = False
    for regex, excludes in rules:
        if any(regex.match("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            excluded = excludes
    return not excluded


def test_the_build_context_holds_what_the_dockerfile_copies_and_nothing_else(dockerfile):
    """Without a .dockerignore, `docker build .` sent the whole checkout: .git, virtual environments, wheel caches,
    runs/ and benchmark reports, into the context (and COPY . would take them into the image)."""
    assert (REPO / ".dockerignore").is_file()
    rules = dockerignore_rules()
    copied = [source for keyword, args in dockerfile if keyword == "COPY" for source in args.split()[:-1]]
    assert copied and "." not in copied  # each COPY names what it takes
    for source in copied:
        files = [source] if (REPO / source).is_file() else [
            str(path.relative_to(REPO)) for path in (REPO / source).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts]
        assert files, source
        for path in files:
            assert sent_to_the_daemon(path, rules), f"{path} (COPY {source}) is left out of the build context"
    for path in (".git/HEAD", ".venv/bin/python", "venv/lib/site.py", "runs/rollout.json", ".whl/grpcio.whl",
                 "bench.json", "rollout.png", "tests/test_docker.py", ".hypothesis/examples/x", ".pytest_cache/v",
                 "policy_server.egg-info/PKG-INFO", "build/lib/policy_server/cli.py", "docs/ARCHITECTURE.md",
                 "policy_server/__pycache__/cli.cpython-311.pyc", "robots/__pycache__/bench.cpython-311.pyc",
                 "policy_server/cli.pyc", "deploy/rayservice.yaml"):
        assert not sent_to_the_daemon(path, rules), f"{path} would be sent to the daemon"
