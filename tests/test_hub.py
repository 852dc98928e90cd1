"""Checkpoints named by Hugging Face Hub id: resolved through the user's Hub cache, offline here (a cache
filled beforehand, `HF_HUB_OFFLINE=1`), in fresh processes so that the environment is read as a user's is."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from policy_server.config import ConfigError, build_config
from policy_server.engine.calibration import Observation, save_observations
from robots.embedded import build_random_pipeline

REPO = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """`(environment, digest)`: a Hub cache holding `org/tiny` (a tiny random policy at 3 sampler steps), offline."""
    root = tmp_path_factory.mktemp("hub")
    model = root / "model"
    pipeline = build_random_pipeline(model, seed=7)
    policy = json.loads((model / "policy.json").read_text())
    (model / "policy.json").write_text(json.dumps({**policy, "num_steps": 3}))
    repo = root / "cache" / "models--org--tiny"
    shutil.copytree(model, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    env = {**os.environ, "HF_HUB_CACHE": str(root / "cache"), "HF_HUB_OFFLINE": "1",
           "POLICY_SERVER_CACHE": str(root / "profiles"), "PYTHONPATH": str(REPO)}
    return env, pipeline.digest


def _run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_a_hub_id_loads_from_the_cache_and_a_missing_one_is_a_clear_error(hub):
    env, digest = hub
    script = (
        "import sys\n"
        "from policy_server.pipeline.policy import CheckpointLoadError, PolicyPipeline\n"
        "for reference in sys.argv[1:]:\n"
        "    try:\n"
        "        pipeline = PolicyPipeline.from_pretrained(reference)\n"
        "        print('loaded', pipeline.folder.name, pipeline.digest)\n"
        "    except CheckpointLoadError as error:\n"
        "        print('error', error)\n"
    )
    result = _run(["-c", script, "org/tiny", f"org/tiny@{COMMIT}", "org/missing"], env)
    assert result.returncode == 0, result.stderr
    loaded, pinned, missing = result.stdout.strip().splitlines()
    assert loaded == pinned == f"loaded {COMMIT} {digest}"
    assert missing.startswith("error cannot serve checkpoint org/missing: ") and "HF_HUB_OFFLINE=1" in missing
    # Online with nothing answering (a closed loopback port as the Hub): huggingface_hub's text has line breaks.
    unreachable = _run(["-c", script, "org/missing"], {**env, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"})
    (line,) = unreachable.stdout.strip().splitlines()
    assert line.startswith("error cannot serve checkpoint org/missing: ") and "Connection refused" in line


def test_calibrate_resolves_a_hub_id_and_writes_the_profile_to_the_cache_not_the_hub_snapshot(hub, tmp_path):
    env, digest = hub
    observations = tmp_path / "obs.safetensors"
    save_observations(observations, [Observation("pusht", {"image": np.full((64, 64, 3), 90, np.uint8)},
                                                 np.array([0.3, 0.4], np.float32), "reach the blue circle")])
    result = _run(["-m", "policy_server.cli", "calibrate", "--checkpoint", "org/tiny", "--observations",
                   str(observations), "--device", "cpu"], env)
    assert result.returncode == 0, result.stderr
    written = Path(env["POLICY_SERVER_CACHE"]) / "profiles" / f"{digest.removeprefix('sha256:')}.json"
    assert written.is_file() and f"wrote {written}" in result.stdout
    snapshot = Path(env["HF_HUB_CACHE"]) / "models--org--tiny" / "snapshots" / COMMIT
    assert not (snapshot / "quality_profile.json").exists()


def test_the_server_setting_takes_a_hub_id_and_names_a_path_that_is_neither():
    assert str(build_config(overrides={"checkpoint": "nvidia/Cosmos3-Policy@main"}).checkpoint) == \
        "nvidia/Cosmos3-Policy@main"
    with pytest.raises(ConfigError, match="'runs/no/such/model' is neither an existing path nor a Hugging Face Hub id"):
        build_config(overrides={"checkpoint": "runs/no/such/model"})
    for name in ("a/..", "org/..@main", "org/-name", "org/name.", "org/na--me", "org/" + "n" * 97, "org/name@../.."):
        with pytest.raises(ConfigError, match="is neither an existing path nor a Hugging Face Hub id"):
            build_config(overrides={"checkpoint": name})
