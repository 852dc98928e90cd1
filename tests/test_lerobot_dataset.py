"""`robots.datagen --format lerobot`: the LeRobot v3 layout, its statistics and video, and training reading
it as it reads the safetensors format."""

import json
import shutil

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from policy_server.model.vae import SmallVideoVAE
from policy_server.pipeline.policy import default_model_path
from robots import embedded
from robots.datagen import generate, main
from robots.dataset import DatasetError, array_stats, open_dataset
from robots.lerobot_dataset import ACTION_KEY, IMAGE_KEY, STATE_KEY, LeRobotDemoDataset, LeRobotWriter
from robots.train_policy import collect_windows
from robots.train_vae import main as train_vae_main

VIDEO = f"videos/{IMAGE_KEY}/chunk-000/file-000.mp4"
STATS = {"count", "min", "max", "mean", "std", "q01", "q10", "q50", "q90", "q99"}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """The same four demonstrations (two scenes, two targets each) in both formats."""
    root = tmp_path_factory.mktemp("formats")
    for layout in ("safetensors", "lerobot"):
        generate(root / layout, episodes=4, seed_offset=20, targets_per_scene=2, progress=False, format=layout)
    return root


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(255**2 / np.mean((a.astype(np.float64) - b) ** 2)))


def test_layout_keys_and_counts(datasets):
    root, originals = datasets / "lerobot", list(open_dataset(datasets / "safetensors"))
    lengths = [e.num_steps + 1 for e in originals]  # T actions: T+1 observations, one row each
    info = json.loads((root / "meta/info.json").read_text())
    assert (info["codebase_version"], info["robot_type"], info["fps"]) == ("v3.0", "pusht", 10)
    instructions = {e.instruction for e in originals}
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (4, sum(lengths), len(instructions))
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    assert info["splits"] == {"train": "0:4"}
    features = info["features"]
    assert set(features) == {IMAGE_KEY, STATE_KEY, ACTION_KEY, "timestamp", "frame_index", "episode_index", "index",
                             "task_index"}
    assert (features[IMAGE_KEY]["dtype"], features[IMAGE_KEY]["shape"]) == ("video", [64, 64, 3])
    assert features[IMAGE_KEY]["info"]["video.pix_fmt"] == "yuv444p"
    assert (features[STATE_KEY]["shape"], features[ACTION_KEY]["names"]) == ([2], ["vx", "vy"])

    data = pq.read_table(root / "data/chunk-000/file-000.parquet")
    assert data.column_names == [STATE_KEY, ACTION_KEY, "timestamp", "frame_index", "episode_index", "index",
                                 "task_index"]
    assert data.num_rows == sum(lengths) and data["index"].to_pylist() == list(range(sum(lengths)))
    assert data["frame_index"].to_pylist() == [i for n in lengths for i in range(n)]
    assert data["episode_index"].to_pylist() == [e for e, n in enumerate(lengths) for _ in range(n)]
    np.testing.assert_allclose(data["timestamp"].to_numpy(), data["frame_index"].to_numpy() / 10, rtol=1e-6)
    actions = np.stack(data[ACTION_KEY].to_numpy(zero_copy_only=False))
    ends = np.cumsum(lengths) - 1
    np.testing.assert_array_equal(actions[ends], 0.0)  # the final observation holds still
    np.testing.assert_array_equal(np.delete(actions, ends, axis=0), np.concatenate([e.actions for e in originals]))

    tasks = pq.read_table(root / "meta/tasks.parquet")
    assert tasks.schema.pandas_metadata["index_columns"] == ["task"]  # pandas (LeRobot) indexes tasks by string
    task_of = dict(zip(tasks["task_index"].to_pylist(), tasks["task"].to_pylist(), strict=True))
    assert sorted(task_of) == list(range(len(task_of)))
    assert [task_of[data["task_index"][int(row)].as_py()] for row in ends] == [e.instruction for e in originals]

    episodes = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [e["length"] for e in episodes] == lengths
    assert [e["tasks"] for e in episodes] == [[o.instruction] for o in originals]
    assert [e["dataset_to_index"] for e in episodes] == np.cumsum(lengths).tolist()
    assert [e["dataset_from_index"] for e in episodes] == [0, *np.cumsum(lengths)[:-1].tolist()]
    for e in episodes:
        assert e[f"videos/{IMAGE_KEY}/from_timestamp"] == e["dataset_from_index"] / 10
        assert e[f"videos/{IMAGE_KEY}/to_timestamp"] == e["dataset_to_index"] / 10
    assert [(e["seed"], e["target_color"], e["success"]) for e in episodes] == [
        (o.seed, o.target_color, o.success) for o in originals]
    datagen = json.loads((root / "meta/datagen.json").read_text())
    assert (datagen["env_id"], datagen["seed_offset"], datagen["targets_per_scene"]) == (
        "PolicyServer/Reach-v0", 20, 2)


def test_stats_are_those_of_the_data(datasets):
    root = datasets / "lerobot"
    stats = json.loads((root / "meta/stats.json").read_text())
    data = pq.read_table(root / "data/chunk-000/file-000.parquet")
    assert set(stats) == set(data.column_names) | {IMAGE_KEY}
    for key in data.column_names:
        assert set(stats[key]) == STATS
        values = np.stack(data[key].to_numpy(zero_copy_only=False)).reshape(data.num_rows, -1).astype(np.float64)
        assert stats[key]["count"] == [data.num_rows]
        for name, reduce in (("min", np.min), ("max", np.max), ("mean", np.mean), ("std", np.std)):
            np.testing.assert_allclose(stats[key][name], reduce(values, axis=0), rtol=1e-12, err_msg=f"{key} {name}")
        for q in (1, 10, 50, 90, 99):
            np.testing.assert_allclose(stats[key][f"q{q:02d}"], np.quantile(values, q / 100, axis=0), rtol=1e-12)
    # Images: per channel, in [0, 1], shaped [3, 1, 1] as LeRobot keeps them; of the frames before encoding.
    pixels = np.concatenate([e.frames for e in open_dataset(datasets / "safetensors")]).reshape(-1, 3) / 255.0
    image = stats[IMAGE_KEY]
    assert set(image) == STATS and image["count"] == [data.num_rows]
    assert np.asarray(image["mean"]).shape == (3, 1, 1)
    for name, reduce in (("min", np.min), ("max", np.max), ("mean", np.mean), ("std", np.std)):
        np.testing.assert_allclose(np.asarray(image[name])[:, 0, 0], reduce(pixels, axis=0), rtol=1e-9)
    for q in (1, 10, 50, 90, 99):
        np.testing.assert_allclose(np.asarray(image[f"q{q:02d}"])[:, 0, 0], np.quantile(pixels, q / 100, axis=0),
                                   rtol=1e-9)


def test_each_episode_keeps_its_own_statistics(datasets):
    root = datasets / "lerobot"
    episodes = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    data = pq.read_table(root / "data/chunk-000/file-000.parquet")
    originals = list(open_dataset(datasets / "safetensors"))
    for episode, original in zip(episodes, originals, strict=True):
        rows = data.slice(episode["dataset_from_index"], episode["length"])
        for key in data.column_names:
            values = np.stack(rows[key].to_numpy(zero_copy_only=False)).reshape(rows.num_rows, -1).astype(np.float64)
            assert episode[f"stats/{key}/count"] == [rows.num_rows]
            np.testing.assert_allclose(episode[f"stats/{key}/mean"], values.mean(0), rtol=1e-12)
            np.testing.assert_allclose(episode[f"stats/{key}/q90"], np.quantile(values, 0.9, axis=0), rtol=1e-12)
        pixels = original.frames.reshape(-1, 3) / 255.0
        assert np.asarray(episode[f"stats/{IMAGE_KEY}/std"]).shape == (3, 1, 1)
        np.testing.assert_allclose(np.asarray(episode[f"stats/{IMAGE_KEY}/max"])[:, 0, 0], pixels.max(0), rtol=1e-9)
        np.testing.assert_allclose(np.asarray(episode[f"stats/{IMAGE_KEY}/mean"])[:, 0, 0], pixels.mean(0), rtol=1e-9)
    assert {name.split("/")[-1] for name in episodes[0] if name.startswith("stats/")} == STATS


def test_video_is_h264_444_and_close_to_the_frames(datasets):
    originals = np.concatenate([e.frames for e in open_dataset(datasets / "safetensors")])
    with av.open(str(datasets / "lerobot" / VIDEO)) as container:
        stream = container.streams.video[0]
        assert (stream.codec_context.name, stream.pix_fmt) == ("h264", "yuv444p")
        assert stream.codec_context.profile == "High 4:4:4 Predictive"
        decoded = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])
    assert decoded.shape == originals.shape
    assert psnr(decoded, originals) > 50  # measured 52.2 dB; 4:2:0 would cap near 33 dB
    assert np.abs(decoded.astype(int) - originals).max() <= 2  # lossless in YUV: only the RGB <-> YUV rounding


def test_training_reads_the_same_episodes_and_windows_from_both(datasets):
    safetensors, lerobot = open_dataset(datasets / "safetensors"), open_dataset(datasets / "lerobot")
    assert isinstance(lerobot, LeRobotDemoDataset) and len(lerobot) == len(safetensors) == 4
    assert lerobot.entries == [{k: v for k, v in e.items() if k != "file"} for e in safetensors.entries]
    pairs = list(zip(safetensors, lerobot, strict=True))
    for a, b in pairs:
        np.testing.assert_array_equal(a.actions, b.actions)
        np.testing.assert_array_equal(a.states, b.states)
        assert (a.instruction, a.seed, a.target_color, a.success) == (b.instruction, b.seed, b.target_color, b.success)
        assert a.frames.shape == b.frames.shape and psnr(a.frames, b.frames) > 50
    vae = SmallVideoVAE.from_pretrained(default_model_path() / "vae").eval()
    windows = []
    for episodes in ([a for a, _ in pairs], [b for _, b in pairs]):
        stats = {"action": array_stats(np.concatenate([e.actions for e in episodes])),
                 "state": array_stats(np.concatenate([e.states for e in episodes]))}
        windows.append(collect_windows(episodes, vae, embedded.CHUNK_SIZE, embedded.transformer_config().action_dim,
                                       stats, stride=3, policy=embedded.policy_config()))
    a, b = windows
    assert a.instructions == b.instructions and a.prompt_index.tolist() == b.prompt_index.tolist()
    assert a.actions.equal(b.actions) and a.states.equal(b.states)
    assert a.latents.shape == b.latents.shape
    assert (a.latents - b.latents).abs().max() < 0.05 * a.latents.std()


def test_cli_writes_lerobot_and_overwrite_replaces_the_other_format(tmp_path, capsys):
    generate(tmp_path, episodes=1, progress=False)
    main(["--episodes", "2", "--out", str(tmp_path), "--format", "lerobot", "--overwrite", "--no-progress"])
    assert "wrote 2 episodes" in capsys.readouterr().out
    assert not list(tmp_path.glob("episode_*")) and not (tmp_path / "dataset.json").exists()
    assert len(open_dataset(tmp_path)) == 2
    with pytest.raises(FileExistsError, match="overwrite"):
        generate(tmp_path, episodes=1, progress=False, format="lerobot")
    with pytest.raises(SystemExit):
        main(["--episodes", "1", "--out", str(tmp_path / "x"), "--format", "hdf5"])
    assert "argument --format: invalid choice: 'hdf5'" in capsys.readouterr().err


def _broken_copy(datasets, tmp_path, break_it):
    folder = tmp_path / "broken"
    shutil.copytree(datasets / "lerobot", folder)
    break_it(folder)
    return folder


def _edit_info(edit):
    def apply(folder):
        path = folder / "meta/info.json"
        info = json.loads(path.read_text())
        edit(info)
        path.write_text(json.dumps(info))
    return apply


def _shorten_episodes(folder):
    path = folder / "meta/episodes/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    pq.write_table(table.set_column(table.column_names.index("length"), "length",
                                    pa.array(table["length"].to_numpy() - 1)), path)


def _shift_first_video_start(folder):  # 0.3 frames later: read the nearest frames, as if it started at 0
    path = folder / "meta/episodes/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    column = f"videos/{IMAGE_KEY}/from_timestamp"
    pq.write_table(table.set_column(table.column_names.index(column), column,
                                    pa.array(table[column].to_numpy() + 0.03)), path)


def _edit_rows(edit):
    def apply(folder):
        path = folder / "data/chunk-000/file-000.parquet"
        rows = pq.read_table(path).to_pylist()
        edit(rows)
        pq.write_table(pa.Table.from_pylist(rows), path)
    return apply


def _ragged(rows):  # the same number of values in all, one row short, the next one long
    rows[3][STATE_KEY], rows[4][STATE_KEY] = rows[3][STATE_KEY][:1], rows[4][STATE_KEY] + rows[3][STATE_KEY][1:]


def _audio_only(folder):
    with av.open(str(folder / VIDEO), "w") as container:
        stream = container.add_stream("aac", rate=44100)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 44100
        container.mux(stream.encode(frame))
        container.mux(stream.encode())


def _video_at_twice_the_rate(folder):
    from robots.video import H264Writer

    with av.open(str(folder / VIDEO)) as source:
        frames = [f.to_ndarray(format="rgb24") for f in source.decode(video=0)]
    with H264Writer(folder / VIDEO, 20, 64, 64, "yuv444p", crf=0) as writer:
        for frame in frames:
            writer.write(frame)


@pytest.mark.parametrize(("break_it", "error", "named"), [
    (lambda f: (f / VIDEO).unlink(), FileNotFoundError, f"{VIDEO} not found; meta/episodes puts episode 0's frames"),
    # a row of fewer numbers beside one of more trained on values shifted from one frame to the next
    (_edit_rows(_ragged), DatasetError, "file-000.parquet: episode 0's 'observation.state' at frame 3 holds 1 "
                                        "numbers; expected 2 numbers a row (its shape in info.json)"),
    (_edit_rows(lambda rows: rows[2].update({ACTION_KEY: None})), DatasetError,
     "episode 0's 'action' at frame 2 holds no numbers; expected 2 numbers a row"),
    (_edit_rows(lambda rows: [row.update({ACTION_KEY: str(row[ACTION_KEY])}) for row in rows]), DatasetError,
     "episode 0's 'action' is string; expected 2 numbers a row"),
    # tracebacks before
    (_edit_info(lambda i: i.update(fps="10")), DatasetError,
     "info.json: fps '10'; expected a positive number of frames a second"),
    (_edit_info(lambda i: i.update(features=[])), DatasetError,
     "info.json: features []; expected an object of features, each an object with its dtype and shape"),
    (_audio_only, DatasetError, f"episode 0 (11 frames in meta/episodes): {{folder}}/{VIDEO} holds no video stream"),
    # named the video, but as one too short for the episode's length ("[Errno 1094995529] ...")
    (lambda f: (f / VIDEO).write_bytes(b"\0" * 1000), DatasetError,
     f"{VIDEO} is not a video PyAV decodes (Invalid data found when processing input)"),
    # named as a video of too many frames
    (_video_at_twice_the_rate, DatasetError, f"{VIDEO}: its frame at 0.050 s is frame 0 from 0.000 s at 10 fps, "
                                             "after 1; expected a frame every 1/10 s"),
    (lambda f: (f / "data/chunk-000/file-000.parquet").unlink(), FileNotFoundError, "episode 0's rows"),
    (_edit_info(lambda i: i["features"].pop(STATE_KEY)), DatasetError, "feature 'observation.state' is None"),
    (_edit_info(lambda i: i["features"][IMAGE_KEY].update(dtype="image")), DatasetError,
     f"file-000.parquet lacks the columns ['{IMAGE_KEY}']"),  # the frames of an image feature lie in the rows
    (_edit_info(lambda i: i["features"][IMAGE_KEY].update(dtype="depth")), DatasetError,
     f"cameras ['{IMAGE_KEY}'] have dtype 'depth'; expected one of ['video', 'image']"),
    (_edit_info(lambda i: i.update(codebase_version="v1.6")), DatasetError,
     "codebase_version 'v1.6'; expected one of ['v2.0', 'v2.1', 'v3.0']"),
    (_edit_info(lambda i: i.update(total_episodes=5)), DatasetError, "expected 0 to 4 in order"),
    (_shorten_episodes, DatasetError, "rows of episode 0, frame_index [0, 1, 2, 3, 4]...; expected"),
    (_shift_first_video_start, DatasetError, "episode 0 (11 frames in meta/episodes): {folder}/" + VIDEO
     + ": its frame at 0.0000 s is -0.0300 s from 0.0300 s, not a whole number of frames at 10 fps"),
    (lambda f: (f / "dataset.json").write_text("{}"), DatasetError, "holds both"),
    (lambda f: (f / "meta/info.json").write_text("{"), DatasetError, "info.json: not valid JSON"),
    (lambda f: (f / "data/chunk-000/file-000.parquet").write_bytes(b"PAR1 cut short"), DatasetError,
     "file-000.parquet: not a readable parquet file"),
])
def test_a_malformed_dataset_is_named(datasets, tmp_path, break_it, error, named):
    folder = _broken_copy(datasets, tmp_path, break_it)
    with pytest.raises(error) as raised:
        list(open_dataset(folder))
    assert named.format(folder=folder) in str(raised.value)


def test_a_video_with_too_few_frames_is_named(datasets, tmp_path):
    def drop_last_frame(folder):
        with av.open(str(datasets / "lerobot" / VIDEO)) as source:
            frames = [f.to_ndarray(format="rgb24") for f in source.decode(video=0)][:-1]
        from robots.video import H264Writer

        with H264Writer(folder / VIDEO, 10, 64, 64, "yuv444p", crf=0) as writer:
            for frame in frames:
                writer.write(frame)
    folder = _broken_copy(datasets, tmp_path, drop_last_frame)
    data = open_dataset(folder)
    last = len(data) - 1
    steps = data.entries[last]["num_steps"]
    with pytest.raises(DatasetError, match=rf"episode {last} \({steps + 1} frames in meta/episodes\): .* holds {steps} "
                                           "frames"):
        data[last]


def test_training_cli_names_a_malformed_dataset_in_one_line(datasets, tmp_path, capsys):
    folder = _broken_copy(datasets, tmp_path, _edit_info(lambda i: i["features"].pop(ACTION_KEY)))
    with pytest.raises(SystemExit) as exit_info:
        train_vae_main(["--data", str(folder), "--out", str(tmp_path / "vae"), "--steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "feature 'action' is None" in err.splitlines()[-1]


def test_an_episode_past_a_files_size_limit_starts_the_next_file(datasets, tmp_path):
    originals = list(open_dataset(datasets / "safetensors"))
    writer = LeRobotWriter(tmp_path, fps=10, image_size=originals[0].frames.shape[1], robot_type="pusht",
                           data_file_mb=1e-9, video_file_mb=1e-9)  # every file is full after one episode
    for episode in originals:
        writer.add(episode)
    writer.finish({})
    names = [f"file-{i:03d}" for i in range(len(originals))]
    assert sorted(p.stem for p in (tmp_path / "data/chunk-000").glob("*.parquet")) == names
    assert sorted(p.stem for p in (tmp_path / f"videos/{IMAGE_KEY}/chunk-000").glob("*.mp4")) == names
    rows = pq.read_table(tmp_path / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [(r["data/file_index"], r[f"videos/{IMAGE_KEY}/file_index"]) for r in rows] == [(i, i) for i in range(4)]
    assert all(r[f"videos/{IMAGE_KEY}/from_timestamp"] == 0 for r in rows)  # each video starts with its episode
    for original, read in zip(originals, LeRobotDemoDataset(tmp_path), strict=True):
        np.testing.assert_array_equal(read.actions, original.actions)
        np.testing.assert_array_equal(read.states, original.states)
        assert np.abs(read.frames.astype(int) - original.frames).max() <= 2
    assert LeRobotWriter._place(999) == {"chunk_index": 0, "file_index": 999}
    assert LeRobotWriter._place(1000) == {"chunk_index": 1, "file_index": 0}  # 1000 files make a chunk
