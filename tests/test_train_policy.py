"""The embedded-policy training script end to end at toy size: demonstrations -> a few optimiser steps
-> a pipeline folder that loads and answers a tick."""

import json
import re
import shutil

import numpy as np
import pytest
import torch
from cosmos3_folder import build_tiny_cosmos3_folder

from policy_server.model import load_transformer
from policy_server.model.vae import SmallVideoVAE, SmallVideoVAEConfig
from policy_server.pipeline.embodiments import Embodiment
from policy_server.pipeline.normalization import make_normalizer, parse_stats
from policy_server.pipeline.policy import PolicyPipeline, PolicyRequest, default_model_path
from robots import embedded
from robots.datagen import generate
from robots.dataset import DatasetError, Episode
from robots.embedded import build_random_pipeline
from robots.envs import REACH_EITHER_ID
from robots.lerobot_dataset import LeRobotDemoDataset
from robots.train_policy import check_fits_embodiment, collect_windows, demonstration_stats, main, train


def test_train_a_few_steps_and_serve_the_result(tmp_path):
    """Two datasets pooled (Reach and ReachEither, whose instructions differ) into one run."""
    generate(tmp_path / "demos", episodes=3, progress=False)
    generate(tmp_path / "either", episodes=2, env_id=REACH_EITHER_ID, targets_per_scene=2, progress=False)
    out = tmp_path / "policy"
    summary = train([tmp_path / "demos", tmp_path / "either"], default_model_path() / "vae", out, steps=2,
                    batch_size=4, log_every=1)
    assert summary["steps"] == 2 and summary["episodes"] == 5
    assert any(i.startswith("reach a ") for i in summary["instructions"])
    assert any(i.startswith("reach the ") for i in summary["instructions"])
    assert np.isfinite(summary["final_loss"])
    assert json.loads((out / "training.json").read_text())["windows"] == summary["windows"]

    pipe = PolicyPipeline.from_pretrained(out)
    assert pipe.served_embodiments == ["pusht"]
    rng = np.random.default_rng(0)
    result = pipe(PolicyRequest(images={"image": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)},
                                instruction="reach the red circle", embodiment="pusht",
                                state=np.array([0.2, 0.2], np.float32), num_steps=2))
    assert result.actions.shape == (8, 2) and np.all(np.isfinite(result.actions))


def test_the_actions_past_an_episodes_end_are_its_hold_action():
    """A position-controlled arm's actions are joint targets, here 0.5 to 1.5 rad, and a gripper that never moved
    (0.7). The rows past an episode's end were zero: min-max normalised -3 and -7e7 (the gripper's range is 0), a
    loss of 1e15 that taught the arm to send its joints to 0 as an episode ends. They are the episode's hold action
    (a LeRobot dataset's final row: the last target, which keeps the arm where it ended), and every action trained
    on maps into [-1, 1]."""
    rng = np.random.default_rng(0)
    actions = np.column_stack([rng.uniform(0.5, 1.5, 3), np.full(3, 0.7)]).astype(np.float32)
    hold = np.array([1.6, 0.7], np.float32)  # beyond the actions' range: the stats take it in
    episode = Episode(frames=rng.integers(0, 256, (4, 64, 64, 3), dtype=np.uint8), states=rng.uniform(0, 1, (4, 3)),
                      actions=actions, hold_action=hold, instruction="stack the cups", seed=None, target_color=None,
                      success=None)
    stats = demonstration_stats([episode])
    vae = SmallVideoVAE.from_pretrained(default_model_path() / "vae")
    windows = collect_windows([episode], vae, 4, 16, stats, 1, embedded.policy_config())
    assert windows.actions.shape == (3, 4, 16) and windows.actions.abs().max() <= 1
    normalize = make_normalizer("minmax", parse_stats(stats)["action"], 2).normalize
    expected = normalize(np.stack([actions[2], hold, hold, hold]).astype(np.float64))  # as training normalises
    np.testing.assert_array_equal(windows.actions[2, :, :2], expected.astype(np.float32))


def test_pipeline_folder_is_a_diffusers_layout_root(tmp_path):
    pipe = build_random_pipeline(tmp_path, seed=5)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "Cosmos3OmniTransformer"]
    loaded = load_transformer(tmp_path)  # a pipeline root resolves to transformer/
    expected = pipe.transformer.state_dict()
    assert all(torch.equal(tensor, expected[key]) for key, tensor in loaded.state_dict().items())


def test_cli_trains_a_single_step(tmp_path, capsys):
    generate(tmp_path / "demos", episodes=1, progress=False)
    out = tmp_path / "runs" / "policy"  # parents are created
    main(["--data", str(tmp_path / "demos"), "--out", str(out), "--steps", "1", "--batch-size", "2"])
    summary = json.loads((out / "training.json").read_text())
    assert summary["steps"] == 1 and np.isfinite(summary["final_loss"])
    assert summary == json.loads(capsys.readouterr().out)
    assert PolicyPipeline.from_pretrained(out).served_embodiments == ["pusht"]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--save-every", "0"], "--save-every 0: expected a positive integer"),
        (["--steps", "0"], "--steps 0: expected a positive integer"),
        (["--steps", "-2"], "--steps -2: expected a positive integer"),
        (["--steps", "2.5"], "argument --steps: invalid int value: '2.5'"),
        (["--threads", "0"], "--threads 0: expected a positive integer"),
        (["--lr", "-1"], "--lr -1.0: expected a positive learning rate"),
        ([], "dataset.json not found"),
    ],
)
def test_cli_names_a_bad_argument_in_one_line(tmp_path, capsys, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(tmp_path / "no-data"), "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if "error:" in line] == [err.splitlines()[-1]]
    assert named in err.splitlines()[-1]


def test_cli_rejects_a_missing_init_folder_before_encoding(tmp_path, capsys):
    generate(tmp_path / "demos", episodes=1, progress=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(tmp_path / "demos"), "--out", str(tmp_path / "out"), "--init", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.splitlines()[-1].endswith(f"{tmp_path / 'nope'} is not a directory")
    assert "vae encode" not in err  # it failed before minutes of encoding on a real dataset
    assert not (tmp_path / "out").exists()


def test_cli_refuses_an_init_of_a_pipelines_transformer_folder_naming_the_level(tmp_path, capsys):
    """It said 'transformer/vae/config.json not found', of a VAE the user never named."""
    generate(tmp_path / "demos", episodes=1, progress=False)
    init = default_model_path() / "transformer"
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(tmp_path / "demos"), "--out", str(tmp_path / "out"), "--init", str(init)])
    assert exit_info.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(
        f"--init {init}: no vae/ folder; expected a pipeline folder (transformer/, vae/, ...) as this script writes "
        "it, or the VAE's folder named with --vae")
    main(["--data", str(tmp_path / "demos"), "--out", str(tmp_path / "out"), "--init", str(init),
          "--vae", str(default_model_path() / "vae"), "--steps", "1", "--batch-size", "2"])
    assert json.loads((tmp_path / "out" / "training.json").read_text())["steps"] == 1


def test_cli_refuses_an_out_folder_that_is_not_empty(tmp_path, capsys):
    """Training wrote into a folder as it found it: a quality profile calibrated there before was then beside other
    weights, and an interrupted run's training.json described another's."""
    generate(tmp_path / "demos", episodes=1, progress=False)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "quality_profile.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(tmp_path / "demos"), "--out", str(tmp_path / "out"), "--steps", "1"])
    assert exit_info.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(
        f"--out {tmp_path / 'out'} is not empty; expected a new or empty folder for the pipeline folder written (name "
        "another, or remove it)")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["quality_profile.json"]
    main(["--data", str(tmp_path / "demos"), "--out", str(tmp_path / "empty folder"), "--steps", "1",
          "--batch-size", "2"])  # a new folder, whose path has a space
    assert json.loads((tmp_path / "empty folder" / "training.json").read_text())["steps"] == 1


@pytest.mark.parametrize(("out", "named"), [
    ("report.json", "--out {tmp}/report.json is a file; expected a new or empty folder for the pipeline folder "
                    "written"),
    ("report.json/policy", "--out {tmp}/report.json/policy: {tmp}/report.json is a file; expected a new or empty "
                           "folder for the pipeline folder written"),
])
def test_cli_refuses_an_out_it_cannot_make_a_folder_of_before_encoding(tmp_path, capsys, out, named):
    """An --out under a file trained every step, then failed to write the folder ('[Errno 20] Not a directory'), as
    did one on a read-only file system ('[Errno 30]')."""
    generate(tmp_path / "demos", episodes=1, progress=False)
    (tmp_path / "report.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(tmp_path / "demos"), "--out", str(tmp_path / out), "--steps", "1", "--batch-size", "2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.splitlines()[-1].endswith(named.format(tmp=tmp_path))
    assert "vae encode" not in err and "train policy" not in err


def test_ctrl_c_stops_training_naming_what_the_folder_holds(tmp_path):
    """Ctrl-C ended in a KeyboardInterrupt traceback from wherever training was; the folder last saved had no
    training.json to say which step it was."""
    import signal
    import subprocess
    import sys
    import time

    generate(tmp_path / "demos", episodes=1, progress=False)
    out, log = tmp_path / "out", tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "robots.train_policy", "--data", str(tmp_path / "demos"), "--out", str(out),
             "--steps", "100000", "--batch-size", "2", "--save-every", "20"], stdout=subprocess.DEVNULL,
            stderr=stderr)
        # Between the saves at steps 20 and 40, as the progress bar shows
        while process.poll() is None and not any(int(done) >= 25 for done in re.findall(r"(\d+)/100000",
                                                                                          log.read_text())):
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    err = log.read_text()
    assert process.returncode == 130 and "Traceback" not in err
    assert err.splitlines()[-1] == f"train_policy.py: interrupted; {out} holds the weights after step 20 (--save-every)"
    assert json.loads((out / "training.json").read_text())["steps"] == 20
    assert PolicyPipeline.from_pretrained(out).served_embodiments == ["pusht"]


def _widen(tensors: dict, name: str) -> dict:
    """The episode's `name` with 7 channels (or frames of 96 px), as another robot's dataset has them."""
    value = tensors[name]
    if name == "frames":
        return {**tensors, name: np.zeros((len(value), 96, 96, 3), np.uint8)}
    return {**tensors, name: np.concatenate([value, np.zeros((len(value), 5), value.dtype)], axis=1)}


@pytest.mark.parametrize(("name", "named"), [
    ("actions", "actions of width 7; expected 2, the raw_action_dim of the embodiment it trains (pusht)"),
    ("states", "states of width 7; expected 2, the state_dim of the embodiment it trains (pusht)"),
    ("frames", "frames of 96x96 px (its cameras side by side); expected 64x64, the frames of {'image': (64, 64)} px "
               "(height, width) side by side of the embodiment it trains (pusht)"),
])
def test_cli_refuses_a_dataset_of_another_layout_before_encoding(tmp_path, capsys, name, named):
    """A 7-D arm's demonstrations trained 2 of their 7 action channels and wrote a pusht folder that no server
    loads (its stats have 7 channels): the trainer trains the embedded pusht embodiment only, and says so."""
    from safetensors.numpy import load_file, save_file

    generate(tmp_path / "demos", episodes=1, progress=False)
    path = tmp_path / "demos" / "episode_000000.safetensors"
    save_file(_widen(load_file(str(path)), name), str(path))
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(tmp_path / "demos"), "--out", str(tmp_path / "out"), "--steps", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and named in err.splitlines()[-1]
    assert "vae encode" not in err and not (tmp_path / "out").exists()


def test_cli_refuses_demonstrations_recorded_at_another_rate(tmp_path, capsys):
    """Demonstrations at 15 Hz were captioned and served as the embodiment's 10 Hz."""
    generate(tmp_path / "demos", episodes=1, progress=False)
    path = tmp_path / "demos" / "dataset.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "fps": 15}))
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(tmp_path / "demos"), "--out", str(tmp_path / "out"), "--steps", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "vae encode" not in err
    assert f"{tmp_path / 'demos'}: recorded at 15 fps; expected 10.0, the fps of the embodiment it trains (pusht); " \
        "name another embodiment (--embodiment) to train one of this layout" in err.splitlines()[-1]


def _arm_dataset(folder, state_dim=3, action_dim=5, fps=15, version="v3.0", images=(), wrist=(16, 24), episodes=2,
                 length=5, scene=(32, 32), scene_key="observation.images.scene"):
    """A tiny LeRobot dataset as LeRobot records another robot: `episodes` (2) episodes of `length` (5) frames, two
    cameras of unequal size (scene `scene`: 32x32, wrist `wrist`: 16x24), `state_dim`-D state, `action_dim`-D action,
    `fps`; none of robots.datagen's own columns; the scene camera's feature `scene_key`. `version` "v3.0" (one data
    file, one video a camera) or "v2.1" (meta/episodes.jsonl, a data file per episode, a video per episode and
    camera); the cameras in `images` are stored as PNG bytes in the rows (dtype "image"), not as videos. Every layout
    holds the same frames, states and actions."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from robots.video import H264Writer

    cameras = {scene_key: scene, "observation.images.wrist": wrist}
    rng, task = np.random.default_rng(0), "stack the cups"
    frames = {key: rng.integers(0, 256, (episodes, length, h, w, 3), dtype=np.uint8)
              for key, (h, w) in cameras.items()}
    rows = [[{"observation.state": rng.uniform(-3, 3, state_dim).tolist(),
              "action": rng.uniform(-1, 1, action_dim).tolist(), "timestamp": i / fps, "frame_index": i,
              "episode_index": e, "index": e * length + i, "task_index": 0} for i in range(length)]
            for e in range(episodes)]
    for key in images:  # as Hugging Face datasets' Image: struct<bytes, path>
        for e, i in np.ndindex(episodes, length):
            png = io.BytesIO()
            Image.fromarray(frames[key][e, i]).save(png, format="PNG")
            rows[e][i][key] = {"bytes": png.getvalue(), "path": f"frame_{i:06d}.png"}
    videos = [key for key in cameras if key not in images]

    def write_video(path, key, numbers):
        path.parent.mkdir(parents=True, exist_ok=True)
        with H264Writer(path, fps, *cameras[key], "yuv444p", 0) as video:
            for e in numbers:
                for i, frame in enumerate(frames[key][e]):
                    video.write(frame, keyframe=i == 0)

    def write_table(path, table):
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(table), path)

    if version == "v3.0":
        for key in videos:
            write_video(folder / f"videos/{key}/chunk-000/file-000.mp4", key, range(episodes))
        write_table(folder / "data/chunk-000/file-000.parquet", [row for episode in rows for row in episode])
        write_table(folder / "meta/episodes/chunk-000/file-000.parquet", [
            {"episode_index": e, "tasks": [task], "length": length, "data/chunk_index": 0, "data/file_index": 0,
             "dataset_from_index": e * length, "dataset_to_index": (e + 1) * length,
             **{f"videos/{key}/{field}": value for key in videos for field, value in (
                 ("chunk_index", 0), ("file_index", 0), ("from_timestamp", e * length / fps),
                 ("to_timestamp", (e + 1) * length / fps))}} for e in range(episodes)])
        paths = {"data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
                 "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"}
    else:
        for e in range(episodes):
            for key in videos:
                write_video(folder / f"videos/chunk-000/{key}/episode_{e:06d}.mp4", key, [e])
            write_table(folder / f"data/chunk-000/episode_{e:06d}.parquet", rows[e])
        (folder / "meta").mkdir()
        (folder / "meta/episodes.jsonl").write_text("".join(
            json.dumps({"episode_index": e, "tasks": [task], "length": length}) + "\n" for e in range(episodes)))
        (folder / "meta/tasks.jsonl").write_text(json.dumps({"task_index": 0, "task": task}) + "\n")
        paths = {"chunks_size": 1000,
                 "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
                 "video_path": "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"}
    features = {key: {"dtype": "image" if key in images else "video", "shape": [h, w, 3], "names": None}
                for key, (h, w) in cameras.items()}
    features["observation.state"] = {"dtype": "float32", "shape": [state_dim], "names": None}
    features["action"] = {"dtype": "float32", "shape": [action_dim], "names": [f"m{i}" for i in range(action_dim)]}
    (folder / "meta/info.json").write_text(json.dumps({
        "codebase_version": version, "robot_type": "tiny_arm", "fps": fps, "total_episodes": episodes,
        "features": features, **paths}))
    return folder


def test_a_dataset_is_held_in_memory_one_episode_at_a_time(tmp_path):
    """Every episode's frames were held at once, and each tick's clip copied at the recorded size (6 episodes of 100
    frames from two 240x320 cameras, 0.3 MB on disk: 2.7 GB more memory, and twice the time): a dataset bigger than
    memory could not train. Each episode is read, checked, read again and encoded, then dropped: twice the episodes
    take no more memory (numpy's, which tracemalloc traces), where they took 5.6 times their frames more."""
    import tracemalloc

    def peak_training(episodes: int) -> int:
        data = _arm_dataset(tmp_path / f"arm{episodes}", episodes=episodes, length=10, scene=(128, 128),
                            wrist=(128, 128))
        tracemalloc.reset_peak()
        main(["--data", str(data), "--out", str(tmp_path / f"out{episodes}"), "--chunk-size", "4", "--steps", "1",
              "--batch-size", "2"])
        assert json.loads((tmp_path / f"out{episodes}" / "training.json").read_text())["windows"] == episodes * 9
        return tracemalloc.get_traced_memory()[1]

    tracemalloc.start()
    try:
        peak_training(1)  # the first run in a process allocates more, once
        growth = peak_training(12) - peak_training(6)
    finally:
        tracemalloc.stop()
    assert growth < 6 * 10 * 128 * 256 * 3 / 2  # half the 6 more episodes' frames, their cameras side by side


def test_another_robot_trains_on_a_domain_row_of_its_own_and_is_served_as_trained(tmp_path, caplog):
    """A LeRobot dataset of two cameras, 3-D state and 5-D action at 15 Hz: trained from the shipped weights (the
    default), the folder serves exactly that embodiment under the model name given, on domain row 10 (the first
    no Cosmos3 embodiment uses), which training moved; the shipped pusht row it left (weight decay aside).
    Retrained from that folder, it stays on row 10. An engine warms up on its cameras' sizes and acts on them."""
    import policy_server.engine
    from policy_server.config import build_config
    from policy_server.engine import api

    data, out = _arm_dataset(tmp_path / "arm"), tmp_path / "out"
    (tmp_path / "limits.json").write_text(json.dumps({"action_low": [-1.0] * 5, "action_high": [1.0] * 5,
                                                          "action_units": ["rad/s"] * 5}))
    main(["--data", str(data), "--out", str(out), "--name", "arm-policy", "--chunk-size", "4", "--steps", "2",
          "--batch-size", "2", "--limits", str(tmp_path / "limits.json")])
    summary = json.loads((out / "training.json").read_text())
    assert (summary["name"], summary["embodiment"], summary["domain_id"]) == ("arm-policy", "tiny_arm", 10)

    pipe = PolicyPipeline.from_pretrained(out)
    arm = pipe.embodiments.get("tiny_arm")
    assert pipe.served_embodiments == ["tiny_arm"] and pipe.config.name == "arm-policy"
    assert (arm.domain_id, arm.raw_action_dim, arm.state_dim, arm.fps, arm.cameras) == (10, 5, 3, 15.0,
                                                                                        ("scene", "wrist"))
    assert arm.action_names == ("m0", "m1", "m2", "m3", "m4") and arm.action_high == (1.0,) * 5
    assert arm.action_units == ("rad/s",) * 5
    assert (arm.default_chunk_size, arm.viewpoint) == (4, "concat_view")
    assert pipe.config.trained_domain_ids == (4, 10) and pipe.untrained_embodiments == []
    rng = np.random.default_rng(1)
    result = pipe(PolicyRequest(images={"scene": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8),
                                        "wrist": rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)},
                                instruction="stack the cups", embodiment="tiny_arm",
                                state=np.zeros(3, np.float32), num_steps=2))
    assert result.actions.shape == (4, 5) and np.all(np.isfinite(result.actions))
    shipped, trained = (load_transformer(f).action_proj_in.fc.weight for f in (default_model_path(), out))
    moved = (trained - shipped).abs().amax(1)
    assert moved[10] > 10 * moved[4] > 0

    # Retrained from its own folder, it stays on its row: the training before is built on, not left unused.
    again = tmp_path / "again"
    main(["--data", str(data), "--init", str(out), "--out", str(again), "--chunk-size", "4", "--steps", "1",
          "--batch-size", "2"])
    assert json.loads((again / "training.json").read_text())["domain_id"] == 10
    assert json.loads((again / "policy.json").read_text())["trained_domain_ids"] == [4, 10]

    # The same weights claiming only pusht's row: the server warns at start, naming the embodiment.
    policy = json.loads((out / "policy.json").read_text())
    (out / "policy.json").write_text(json.dumps({**policy, "trained_domain_ids": [4]}))
    with caplog.at_level("WARNING", logger="policy_server.engine"):
        engine = policy_server.engine.build_engine(build_config(overrides={
            "checkpoint": str(out), "device": "cpu", "quality_profile": "off", "compile_gen_stack": False}))
    engine.start()  # warmup sends frames of the advertised camera sizes
    try:
        assert engine.wait_ready(timeout_s=120)
        served = engine.info().embodiment("tiny_arm")
        # a budget any machine meets: the default 120 ms is infeasible on a loaded 2-core one
        session = engine.open_session("tiny_arm", "stack the cups", budget_ms=10_000, rate_hz=0)
        frames = {c.name: rng.integers(0, 256, (c.height, c.width, 3), dtype=np.uint8) for c in served.cameras}
        acted = engine.act(session.session_id, session.epoch, api.Observation(frames, np.zeros(3, np.float32)))
        assert acted.actions.shape == (4, 5) and np.all(np.isfinite(acted.actions))
    finally:
        engine.close()
    # ServerInfo advertises each camera at the size it was recorded and trained at, not its share of the canvas,
    # and no unit for the state, whose units the dataset does not give (served de-normalised, not "normalized")
    assert [(c.name, c.height, c.width, c.min_side) for c in served.cameras] == [("scene", 32, 32, 8),
                                                                                 ("wrist", 16, 24, 8)]
    assert (served.action.units, served.state_units) == (("rad/s",) * 5, ())
    assert "embodiment 'tiny_arm' is served on domain row 10, which these weights were never trained on " \
        "(policy.json: trained_domain_ids [4])" in caplog.text


@pytest.mark.parametrize(("argv", "named"), [
    (["--data", "{arm17}"], "{'action': 17} channels; the model's action rows hold action_dim=16 (one row carries "
                            "the action or the state): a wider robot needs a model of a wider action_dim"),
    (["--data", "{arm}", "{arm17}"], "episode 0 has actions of width 17; expected 5, the raw_action_dim of the "
                                     "embodiment it trains (tiny_arm)"),
    (["--data", "{arm}", "--domain-id", "0"], "--domain-id 0: expected 1 to 31 (0 is Cosmos3's no-action domain)"),
    (["--data", "{arm}", "--limits", "{limits}"], "embodiment 'tiny_arm': Value error, action_low has 7 entries; "
                                                   "expected raw_action_dim=5"),
    (["--data", "{arm_4px}"], "{arm_4px}: camera 'wrist' is 4x24 px; expected sides of 8 to 2048 px (8: the VAE's "
                              "spatial compression, the smallest frame side the server takes)"),
    # from its metadata: none of its frames is decoded (it has none), nor any but the first dataset's first episode
    (["--data", "{arm}", "{arm10}"], "{arm10}: recorded at 10 fps; expected 15.0, the fps of the embodiment it "
                                     "trains (tiny_arm)"),
])
def test_cli_refuses_what_the_model_cannot_train_before_encoding(tmp_path, capsys, argv, named):
    """Beyond the model's action_dim, datasets of two layouts pooled, the no-action row, limits of the wrong width."""
    (tmp_path / "limits.json").write_text(json.dumps({"action_low": [-1.0] * 7, "action_high": [1.0] * 7}))
    paths = {"arm": _arm_dataset(tmp_path / "arm"), "limits": tmp_path / "limits.json"}
    if "{arm17}" in argv:
        paths["arm17"] = _arm_dataset(tmp_path / "arm17", action_dim=17)
    if "{arm_4px}" in argv:  # a wrist camera too small for the VAE, stored as images (a 4 px video will not encode)
        paths["arm_4px"] = _arm_dataset(tmp_path / "arm_4px", wrist=(4, 24), images=("observation.images.wrist",))
        named = named.replace("{arm_4px}", str(paths["arm_4px"]))
    if "{arm10}" in argv:
        paths["arm10"] = _arm_dataset(tmp_path / "arm10", fps=10)
        shutil.rmtree(paths["arm10"] / "videos")
        named = named.replace("{arm10}", str(paths["arm10"]))
    argv = [arg.format(**paths) for arg in argv]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(tmp_path / "out"), "--steps", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and named in err.splitlines()[-1]
    assert "vae encode" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("column", "value", "named"), [
    ("action", np.nan, "episode 1 has actions that are not finite (nan at frame 2, channel 1); expected finite "
                       "numbers"),
    ("observation.state", -np.inf, "episode 1 has states that are not finite (-inf at frame 2, channel 1); expected "
                                   "finite numbers"),
])
def test_a_demonstration_that_is_not_finite_is_named_before_encoding(tmp_path, capsys, column, value, named):
    """A NaN in a recording (a dropped sensor reading) ended in a traceback from the statistics, or trained on NaN."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = _arm_dataset(tmp_path / "arm")
    path = data / "data/chunk-000/file-000.parquet"
    rows = pq.read_table(path).to_pylist()
    rows[5 + 2][column][1] = value  # episode 1 (5 frames each), its frame 2
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(data), "--out", str(tmp_path / "out"), "--steps", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and "vae encode" not in err
    assert err.splitlines()[-1].endswith(f"{data}: {named}")


def test_episodes_with_no_action_are_named(tmp_path, capsys):
    """Episodes of one frame each (an observation, no action) ended in a traceback from the statistics."""
    data = _arm_dataset(tmp_path / "arm", length=1)
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(data), "--out", str(tmp_path / "out"), "--steps", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and not (tmp_path / "out").exists()
    assert err.splitlines()[-1].endswith("no episode has an action to train on (each has one frame); expected "
                                         "episodes of 2 frames or more")


@pytest.mark.parametrize(("other", "named"), [
    ({"cameras": ("scene", "hand"), "camera_sizes": None},
     "cameras ['scene', 'wrist']; expected ['scene', 'hand'], the cameras of the embodiment it trains (tiny_arm)"),
    ({"camera_sizes": {"scene": (32, 32), "wrist": (24, 24)}},
     "cameras of {'scene': (32, 32), 'wrist': (16, 24)} px (height, width); expected {'scene': (32, 32), 'wrist': "
     "(24, 24)}, the frame sizes of the embodiment it trains (tiny_arm)"),
])
def test_a_dataset_of_other_cameras_than_the_embodiment_trained_is_named(tmp_path, other, named):
    dataset = LeRobotDemoDataset(_arm_dataset(tmp_path / "arm"))
    arm = Embodiment(name="tiny_arm", domain_id=10, raw_action_dim=5, state_dim=3, fps=15.0, cameras=("scene", "wrist"),
                     camera_sizes={"scene": (32, 32), "wrist": (16, 24)})
    check_fits_embodiment(dataset, arm, (64, 64))
    with pytest.raises(DatasetError, match=re.escape(named)):
        check_fits_embodiment(dataset, arm.model_copy(update=other), (64, 64))


@pytest.mark.parametrize("mismatch", ["cosmos3_init", "vae"])
def test_an_init_or_vae_the_embedded_parts_do_not_fit_is_named_before_encoding(tmp_path, capsys, mismatch):
    """A Cosmos3 diffusers folder's transformer (a vocabulary of its own) as --init, or a VAE of other latent channels
    as --vae, ended in an IndexError / shape traceback at the first training step, after the encoding."""
    shipped = default_model_path()
    if mismatch == "cosmos3_init":
        init, vae = build_tiny_cosmos3_folder(tmp_path / "cosmos3"), shipped / "vae"
        named = f"the transformer of {init} (--init) has vocab_size=300; expected at least "
    else:
        init, vae = shipped, tmp_path / "vae8"
        SmallVideoVAE(SmallVideoVAEConfig(latent_channels=8)).save_pretrained(vae)
        named = f"the transformer of {init} (--init) takes latents of 16 channels; the VAE {vae} makes 8"
    folder = _arm_dataset(tmp_path / "arm")
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(folder), "--init", str(init), "--vae", str(vae), "--out", str(tmp_path / "out"),
              "--steps", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and named in err.splitlines()[-1]
    assert "vae encode" not in err and "Traceback" not in err


def test_a_robot_type_that_is_not_a_string_is_named(tmp_path, capsys):
    """It names the embodiment trained: a number was refused as "embodiment 5.name: Input should be a valid string",
    naming neither the file nor the field."""
    folder = _arm_dataset(tmp_path / "arm")
    _edit_json("meta/info.json", lambda info: info.update(robot_type=5))(folder)
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(folder), "--out", str(tmp_path / "out"), "--steps", "1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"{folder}/meta/info.json: robot_type 5; expected a string (the robot's name) or null")


def test_a_lerobot_v21_dataset_reads_and_trains_as_its_v3_equivalent(tmp_path):
    """Most LeRobot datasets are still in the v2.1 layout (meta/episodes.jsonl, a data file per episode, a video per
    episode and camera) and were refused: they read as the same episodes as their v3.0 equivalent, and train."""
    v3, v21 = (LeRobotDemoDataset(_arm_dataset(tmp_path / version, version=version)) for version in ("v3.0", "v2.1"))
    assert (v21.cameras, v21.fps, v21.robot_type, v21.dims, v21.action_names, v21.entries) == \
        (v3.cameras, v3.fps, v3.robot_type, v3.dims, v3.action_names, v3.entries)
    for a, b in zip(v3, v21, strict=True):
        assert a.instruction == b.instruction == "stack the cups" and b.frames.shape == (5, 32, 80, 3)
        for field in ("frames", "states", "actions", "hold_action"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))

    out = tmp_path / "out"
    main(["--data", str(tmp_path / "v2.1"), "--out", str(out), "--chunk-size", "4", "--steps", "2",
          "--batch-size", "2"])
    summary = json.loads((out / "training.json").read_text())
    assert (summary["embodiment"], summary["episodes"], summary["steps"]) == ("tiny_arm", 2, 2)
    arm = PolicyPipeline.from_pretrained(out).embodiments.get("tiny_arm")
    assert (arm.raw_action_dim, arm.state_dim, arm.fps, arm.cameras) == (5, 3, 15.0, ("scene", "wrist"))


@pytest.mark.parametrize("version", ["v3.0", "v2.1"])
def test_cameras_stored_as_images_read_as_stored_as_videos(tmp_path, version):
    """dtype "image": each frame's PNG in its data row (LeRobot's struct of bytes and path), exact where the
    video's frames are within its RGB <-> YUV rounding."""
    images = LeRobotDemoDataset(_arm_dataset(tmp_path / "images", version=version,
                                             images=("observation.images.scene", "observation.images.wrist")))
    videos = LeRobotDemoDataset(_arm_dataset(tmp_path / "videos"))
    assert images.cameras == videos.cameras == ["scene", "wrist"]
    for a, b in zip(videos, images, strict=True):
        assert a.frames.shape == b.frames.shape and np.abs(a.frames.astype(int) - b.frames).max() <= 2
        np.testing.assert_array_equal(a.actions, b.actions)


def _edit_json(path, edit):
    def apply(folder):
        content = json.loads((folder / path).read_text())
        edit(content)
        (folder / path).write_text(json.dumps(content))
    return apply


def _lines(text):
    return lambda folder: (folder / "meta/episodes.jsonl").write_text(text)


EPISODE_1 = "data/chunk-000/episode_000001.parquet"
WRIST_0 = "videos/chunk-000/observation.images.wrist/episode_000000.mp4"


@pytest.mark.parametrize(("break_it", "error", "named"), [
    (lambda f: (f / EPISODE_1).unlink(), FileNotFoundError,
     f"{EPISODE_1} not found; meta/info.json's data_path puts episode 1's rows there"),
    (lambda f: (f / WRIST_0).unlink(), FileNotFoundError,
     f"{WRIST_0} not found; meta/info.json's video_path puts episode 0's frames of observation.images.wrist there"),
    (lambda f: (f / "meta/episodes.jsonl").unlink(), FileNotFoundError,
     "meta/episodes.jsonl not found; expected the episode index of a LeRobot v2.1 dataset"),
    (_lines('{"episode_index": 0, "tasks": ["stack the cups"], "length": 6}\n'
            '{"episode_index": 1, "tasks": ["stack the cups"], "length": 5}\n'), DatasetError,
     "episode_000000.parquet holds 5 rows of episode 0, frame_index [0, 1, 2, 3, 4]...; expected 6 (its length in "
     "meta/episodes.jsonl) numbered from 0"),
    (_lines('{"episode_index": 0, "tasks": ["stack the cups"], "length": 5}\n[1, 2]\n'), DatasetError,
     "meta/episodes.jsonl: line 2 is '[1, 2]'; expected a JSON object with ['episode_index', 'tasks', 'length'], "
     "an integer episode_index"),
    (_lines('{"episode_index": 1, "tasks": ["stack the cups"], "length": 5}\n'), DatasetError,
     "meta/episodes.jsonl numbers its 1 episodes [1]...; expected 0 to 1 in order (total_episodes in info.json)"),
    (_edit_json("meta/info.json", lambda i: i.pop("chunks_size")), DatasetError, "info.json lacks ['chunks_size']"),
    (_edit_json("meta/info.json", lambda i: i.update(data_path="data/chunk-{chunk_index:03d}/file-000.parquet")),
     DatasetError, "data_path 'data/chunk-{chunk_index:03d}/file-000.parquet' does not name a file with "
                   "['episode_chunk', 'episode_index'] (KeyError: 'chunk_index'); expected LeRobot v2.1's template"),
])
def test_a_malformed_v21_dataset_is_named(tmp_path, break_it, error, named):
    folder = _arm_dataset(tmp_path / "arm", version="v2.1")
    break_it(folder)
    with pytest.raises(error) as raised:
        list(LeRobotDemoDataset(folder))
    assert named in str(raised.value)


@pytest.mark.parametrize(("shape", "named"), [
    ([8, 8, 3], "frame 0 of 'observation.images.wrist' is 16x24 px; expected 8x8 (its shape in info.json)"),
    ([16, 24], "feature 'observation.images.wrist' has shape [16, 24]; expected [height, width, channels]"),
])
def test_an_image_of_another_size_than_its_feature_is_named_before_decoding(tmp_path, shape, named):
    folder = _arm_dataset(tmp_path / "arm", images=("observation.images.wrist",))
    _edit_json("meta/info.json", lambda i: i["features"]["observation.images.wrist"].update(shape=shape))(folder)
    with pytest.raises(DatasetError, match=re.escape(named)):
        list(LeRobotDemoDataset(folder))


def test_a_video_of_another_size_than_its_feature_is_named(tmp_path):
    """info.json's shape is the camera size the trained folder advertises: a video whose frames differ is named."""
    folder = _arm_dataset(tmp_path / "arm")
    _edit_json("meta/info.json", lambda i: i["features"]["observation.images.scene"].update(shape=[16, 16, 3]))(folder)
    dataset = LeRobotDemoDataset(folder)
    assert dataset.camera_sizes == {"scene": (16, 16), "wrist": (16, 24)}
    with pytest.raises(DatasetError, match=re.escape("episode 0's frames of observation.images.scene are 32x32 px; "
                                                     "expected 16x16 (its shape in info.json)")):
        dataset[0]


def test_channel_names_nested_as_lerobot_records_them_are_read(tmp_path):
    """LeRobot's info.json often nests a feature's channel names, {"motors": [...]}: they were dropped (a0, a1...)."""
    folder = _arm_dataset(tmp_path / "arm")
    names = ["shoulder", "elbow", "wrist", "roll", "gripper"]
    _edit_json("meta/info.json", lambda i: i["features"]["action"].update(names={"motors": names}))(folder)
    assert LeRobotDemoDataset(folder).action_names == names


def test_a_feature_of_shape_1_reads_as_lerobot_stores_it(tmp_path):
    """LeRobot keeps a feature of shape [1] (a gripper-only action, a conveyor's position) as a number a row, not a
    list of one: reading it ended in a traceback."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = _arm_dataset(tmp_path / "arm", state_dim=1, action_dim=1)
    listed = list(LeRobotDemoDataset(folder))
    path = folder / "data/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    for key in ("observation.state", "action"):
        numbers = pa.array([row[0] for row in table[key].to_pylist()], pa.float32())
        table = table.set_column(table.column_names.index(key), key, numbers)
    pq.write_table(table, path)
    for a, b in zip(listed, LeRobotDemoDataset(folder), strict=True):
        assert b.actions.shape == (4, 1) and b.states.shape == (5, 1)
        for field in ("states", "actions", "hold_action"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_a_state_and_action_of_float64_read(tmp_path):
    """Datasets converted to LeRobot's layout often keep their state and action as float64: they were refused."""
    folder = _arm_dataset(tmp_path / "arm")
    as_float32 = list(LeRobotDemoDataset(folder))
    _edit_json("meta/info.json", lambda i: [i["features"][key].update(dtype="float64")
                                            for key in ("observation.state", "action")])(folder)
    for a, b in zip(as_float32, LeRobotDemoDataset(folder), strict=True):
        for field in ("states", "actions", "hold_action"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_a_camera_keyed_otherwise_is_a_camera_as_lerobot_reads_it(tmp_path):
    """LeRobot takes every feature of dtype video or image as a camera, whatever its key (lerobot/pusht's
    "observation.image"): such a camera was dropped, and the robot trained and served on its other cameras alone."""
    keyed = LeRobotDemoDataset(_arm_dataset(tmp_path / "image", version="v2.1", scene_key="observation.image"))
    assert (keyed.cameras, keyed.camera_sizes) == (["image", "wrist"], {"image": (32, 32), "wrist": (16, 24)})
    for a, b in zip(LeRobotDemoDataset(_arm_dataset(tmp_path / "scene", version="v2.1")), keyed, strict=True):
        np.testing.assert_array_equal(a.frames, b.frames)
    folder = _arm_dataset(tmp_path / "both", scene_key="observation.images.wrist.rgb")
    _edit_json("meta/info.json", lambda i: i["features"].update({"observation.wrist.rgb": {
        "dtype": "video", "shape": [16, 24, 3]}}))(folder)
    with pytest.raises(DatasetError, match=re.escape(
            "cameras ['observation.images.wrist.rgb', 'observation.images.wrist', 'observation.wrist.rgb'] are named "
            "['wrist.rgb', 'wrist', 'wrist.rgb']; expected distinct names")):
        LeRobotDemoDataset(folder)


def test_an_image_of_more_than_8_bits_is_named(tmp_path):
    """A 16-bit PNG (a camera recorded at 16 bits, a depth image) decoded to frames of 255 wherever its pixel was over
    255, PIL's RGB of it, and trained on them."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    folder = _arm_dataset(tmp_path / "arm", images=("observation.images.wrist",))
    path = folder / "data/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    rows = table.to_pylist()
    png = io.BytesIO()
    Image.fromarray(np.full((16, 24), 1000, np.uint16)).save(png, format="PNG")
    rows[1]["observation.images.wrist"]["bytes"] = png.getvalue()
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)
    with pytest.raises(DatasetError, match=re.escape(
            "file-000.parquet: frame 1 of 'observation.images.wrist' is a I;16 image (PIL's mode: 16 or 32 bits a "
            "pixel); expected 8 bits a channel (RGB, RGBA, L or P), as LeRobot records frames")):
        list(LeRobotDemoDataset(folder))
