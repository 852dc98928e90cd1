"""Demonstration datasets in LeRobot's layouts, written with pyarrow and PyAV: lerobot itself cannot be installed
beside this project. ``LeRobotWriter`` writes the v3 layout (``codebase_version`` "v3.0", that of LeRobot 0.4.0 to
0.6.2); ``LeRobotDemoDataset`` reads it, and the v2 layout most datasets on disk and on the hub still have ("v2.1",
of LeRobot's releases before 0.4.0, and "v2.0", which differs only in its statistics files, not read here).

    meta/info.json                               features (dtype, shape, names), counts, fps, path templates
    meta/stats.json                              per feature: count, min, max, mean, std, q01, q10, q50, q90, q99
    meta/tasks.parquet                           task (the instruction) -> task_index
    meta/episodes/chunk-000/file-000.parquet     per episode: length, tasks, where its rows and frames lie, its
                                                 statistics (stats/<feature>/<statistic>); also its seed,
                                                 target_color and success
    meta/datagen.json                            how robots.datagen made it: env id and config, units, seeds
    data/chunk-000/file-000.parquet              one row per frame, one row group per episode
    videos/observation.images.image/chunk-000/file-000.mp4   the frames, H.264 yuv444p, a keyframe per episode

Per-frame columns: ``observation.state`` float32 [2] (effector xy, m), ``action`` float32 [2] (effector velocity,
m/s), ``timestamp`` float32 (s in the episode), ``frame_index``, ``episode_index``, ``index`` (over the dataset),
``task_index``; the camera frame ``observation.images.image`` [64, 64, 3] lies in the video at ``from_timestamp +
timestamp``. The reader takes a dataset recorded with LeRobot too: any state and action widths, every feature of
dtype "video" or "image" as a camera, as LeRobot does (``observation.images.<camera>`` named <camera>, another key
less its ``observation.``; their frames put side by side, in the order info.json lists them, as the server's
conditioning does), stored as video or as images (dtype "image": each frame's PNG bytes in its data row, 8 bits a
channel), and no seed/target_color/success columns. LeRobot pairs every frame with an action,
so an episode of T actions is T+1 rows: the last row, the final observation, carries the action that holds the robot
there (this task's zero velocity; a recorded arm's last target), which reading keeps apart, the episode's
``hold_action``. As LeRobot's writer does, an episode starts the next data file once the current
one holds 100 MB of rows, and the next video once it holds 200 MB (some 35 000 episodes of this task); 1000 files
make a chunk.

The v2 layout keeps the same features and columns in a file per episode, ``chunks_size`` (1000) episodes a chunk:

    meta/episodes.jsonl                          a line per episode: {"episode_index", "tasks", "length"}
    meta/tasks.jsonl, meta/episodes_stats.jsonl  tasks and statistics (v2.0: meta/stats.json), not read here
    data/chunk-000/episode_000000.parquet        the episode's rows (info.json's data_path)
    videos/chunk-000/observation.images.image/episode_000000.mp4   its frames from 0 s (info.json's video_path)
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from PIL import Image

from policy_server.json_file import read_json
from policy_server.pipeline.conditioning import side_by_side
from robots.dataset import DatasetError, Episode
from robots.video import H264Writer, read_frames

CODEBASE_VERSION = "v3.0"  # what LeRobotWriter writes
LEGACY_VERSIONS = ("v2.0", "v2.1")  # read too: v2.1 only added meta/episodes_stats.jsonl
READ_VERSIONS = (*LEGACY_VERSIONS, CODEBASE_VERSION)
INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
DATAGEN_PATH = "meta/datagen.json"
EPISODES_DIR = "meta/episodes"
EPISODES_PATH = EPISODES_DIR + "/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
LEGACY_EPISODES_PATH = "meta/episodes.jsonl"
LEGACY_EPISODE_KEYS = ("episode_index", "tasks", "length")
MAX_EPISODE_LINE_BYTES = 1 << 20  # a line of meta/episodes.jsonl: an index, a length and a few instructions
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
CHUNKS_SIZE, DATA_FILES_SIZE_MB, VIDEO_FILES_SIZE_MB = 1000, 100, 200  # LeRobot's defaults

IMAGE_KEY, STATE_KEY, ACTION_KEY = "observation.images.image", "observation.state", "action"
INDEX_KEYS = ("timestamp", "frame_index", "episode_index", "index", "task_index")
VIDEO_PIX_FMT = "yuv444p"
VIDEO_CRF = 0  # lossless in YUV: decoded frames are off by at most 2 levels (the RGB <-> YUV rounding)
QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)  # LeRobot's q01 ... q99

DATA_SCHEMA = pa.schema([
    (STATE_KEY, pa.list_(pa.float32(), 2)),
    (ACTION_KEY, pa.list_(pa.float32(), 2)),
    ("timestamp", pa.float32()),
    ("frame_index", pa.int64()),
    ("episode_index", pa.int64()),
    ("index", pa.int64()),
    ("task_index", pa.int64()),
])
VECTOR_DTYPES = ("float32", "float64")  # of a state or action: LeRobot records float32, datasets converted to it both
CAMERA_PREFIX = "observation.images."  # LeRobot's camera features: observation.images.<camera>
CAMERA_DTYPES = ("video", "image")  # frames in videos/, or each frame's PNG bytes in its data row
# Columns of meta/episodes a reader needs (LeRobot's own; each camera adds its videos/<key>/... four), and ours,
# which datasets recorded elsewhere lack.
EPISODE_COLUMNS = ("episode_index", "tasks", "length", "data/chunk_index", "data/file_index", "dataset_from_index",
                   "dataset_to_index")
VIDEO_COLUMNS = ("chunk_index", "file_index", "from_timestamp", "to_timestamp")
DATAGEN_COLUMNS = ("seed", "target_color", "success")


def is_lerobot_dataset(directory: str | Path) -> bool:
    return (Path(directory) / INFO_PATH).is_file()


def vector_stats(values: np.ndarray) -> dict[str, list]:
    """LeRobot's statistics of ``values`` [N, D], per dimension (quantiles exact, not estimated)."""
    values = np.asarray(values, dtype=np.float64)
    stats = {"count": [len(values)], "min": values.min(0).tolist(), "max": values.max(0).tolist(),
             "mean": values.mean(0).tolist(), "std": values.std(0).tolist()}
    for q in QUANTILES:
        stats[f"q{round(q * 100):02d}"] = np.quantile(values, q, axis=0).tolist()
    return stats


def image_stats(histogram: np.ndarray, frames: int) -> dict[str, list]:
    """LeRobot's statistics of RGB frames from their per-channel pixel counts ``histogram`` [3, 256], in
    [0, 1] and shaped [3, 1, 1] per statistic, as LeRobot keeps them. The quantiles are numpy's (linear)."""
    levels = np.arange(256, dtype=np.float64)
    n = histogram.sum(1, keepdims=True)
    mean = (histogram * levels).sum(1, keepdims=True) / n
    std = np.sqrt((histogram * (levels - mean) ** 2).sum(1, keepdims=True) / n)
    cumulative = histogram.cumsum(1)

    def level_at_rank(rank: np.ndarray) -> np.ndarray:  # the rank-th smallest pixel value of each channel
        return np.array([np.searchsorted(cumulative[c], rank[c], side="right") for c in range(3)], np.float64)

    stats = {"count": [frames],
             "min": [float(np.flatnonzero(h)[0]) for h in histogram],
             "max": [float(np.flatnonzero(h)[-1]) for h in histogram],
             "mean": mean[:, 0].tolist(), "std": std[:, 0].tolist()}
    for q in QUANTILES:
        position = q * (n[:, 0] - 1)
        below = np.floor(position)
        low, high = level_at_rank(below), level_at_rank(np.minimum(below + 1, n[:, 0] - 1))
        stats[f"q{round(q * 100):02d}"] = (low + (position - below) * (high - low)).tolist()
    return {key: value if key == "count" else [[[v / 255.0]] for v in value] for key, value in stats.items()}


def _feature(dtype: str, shape: list[int], names) -> dict:
    return {"dtype": dtype, "shape": shape, "names": names}


class LeRobotWriter:
    """Writes episodes one at a time; ``finish`` writes the metadata. ``fps`` must be a whole number
    (LeRobot's info.json holds an int)."""

    def __init__(self, directory: str | Path, fps: float, image_size: int, robot_type: str,
                 data_file_mb: float = DATA_FILES_SIZE_MB, video_file_mb: float = VIDEO_FILES_SIZE_MB):
        if not float(fps).is_integer():
            raise ValueError(f"fps={fps}; the LeRobot format needs a whole number of frames per second")
        self.directory = Path(directory)
        self.fps, self.image_size, self.robot_type = int(fps), image_size, robot_type
        self.data_file_mb, self.video_file_mb = data_file_mb, video_file_mb
        self.episodes_path = self.directory / EPISODES_PATH.format(chunk_index=0, file_index=0)
        self.episodes_path.parent.mkdir(parents=True, exist_ok=True)
        self.data, self.data_file = None, -1  # the open data file and its number over all chunks
        self.video, self.video_file = None, -1
        self._next_data_file()
        self._next_video_file()
        self.tasks: dict[str, int] = {}
        self.episodes: list[dict] = []  # rows of meta/episodes
        self.columns: dict[str, list[np.ndarray]] = {key: [] for key in (STATE_KEY, ACTION_KEY, *INDEX_KEYS)}
        self.histogram = np.zeros((3, 256), np.int64)
        self.total_frames = 0

    @staticmethod
    def _place(file_number: int) -> dict[str, int]:
        """Where file ``file_number`` (counted over all chunks) lies: ``chunks_size`` files to a chunk."""
        return {"chunk_index": file_number // CHUNKS_SIZE, "file_index": file_number % CHUNKS_SIZE}

    def _next_data_file(self) -> None:
        if self.data is not None:
            self.data.close()
        self.data_file += 1
        self.data_path = self.directory / DATA_PATH.format(**self._place(self.data_file))
        self.data_path.parent.mkdir(parents=True, exist_ok=True)
        self.data = pq.ParquetWriter(self.data_path, DATA_SCHEMA, compression="snappy")
        self.data_rows = 0  # in this file

    def _next_video_file(self) -> None:
        if self.video is not None:
            self.video.close()
        self.video_file += 1
        self.video_path = self.directory / VIDEO_PATH.format(video_key=IMAGE_KEY, **self._place(self.video_file))
        self.video_path.parent.mkdir(parents=True, exist_ok=True)
        self.video = H264Writer(self.video_path, self.fps, self.image_size, self.image_size, VIDEO_PIX_FMT, VIDEO_CRF)

    def add(self, episode: Episode) -> dict:
        """Append one episode; return its entry (as in dataset.json)."""
        index, start, length = len(self.episodes), self.total_frames, episode.num_steps + 1
        # As LeRobot's writer: an episode that finds its file past the size limit starts the next one.
        if self.data_rows and self.data_path.stat().st_size >= self.data_file_mb * 2**20:
            self._next_data_file()
        if self.video.bytes_written >= self.video_file_mb * 2**20:
            self._next_video_file()
        video_start = self.video.frames_written  # frames of this video before the episode's
        task_index = self.tasks.setdefault(episode.instruction, len(self.tasks))
        columns = {
            STATE_KEY: episode.states.astype(np.float32),
            ACTION_KEY: np.concatenate([episode.actions, episode.hold_action[None]]).astype(np.float32),
            "timestamp": (np.arange(length) / self.fps).astype(np.float32),
            "frame_index": np.arange(length),
            "episode_index": np.full(length, index),
            "index": np.arange(start, start + length),
            "task_index": np.full(length, task_index),
        }
        arrays = [pa.FixedSizeListArray.from_arrays(pa.array(values.ravel()), values.shape[1]) if values.ndim == 2
                  else pa.array(values) for values in columns.values()]
        self.data.write_table(pa.Table.from_arrays(arrays, schema=DATA_SCHEMA))
        self.data_rows += length
        for key, values in columns.items():
            self.columns[key].append(values)
        for i, frame in enumerate(episode.frames):
            self.video.write(frame, keyframe=i == 0)  # each episode decodes from its own first frame
        histogram = np.stack([np.bincount(episode.frames[..., c].ravel(), minlength=256) for c in range(3)])
        self.histogram += histogram
        self.total_frames += length
        # LeRobot keeps every feature's statistics per episode too, as columns "stats/<feature>/<statistic>"
        # of meta/episodes (what it aggregates when datasets are merged).
        episode_stats = {key: vector_stats(values.reshape(length, -1)) for key, values in columns.items()}
        episode_stats[IMAGE_KEY] = image_stats(histogram, length)
        self.episodes.append({
            "episode_index": index, "tasks": [episode.instruction], "length": length,
            **{f"data/{key}": value for key, value in self._place(self.data_file).items()},
            "dataset_from_index": start, "dataset_to_index": start + length,
            **{f"videos/{IMAGE_KEY}/{key}": value for key, value in self._place(self.video_file).items()},
            f"videos/{IMAGE_KEY}/from_timestamp": video_start / self.fps,
            f"videos/{IMAGE_KEY}/to_timestamp": (video_start + length) / self.fps,
            "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0,
            "seed": episode.seed, "target_color": episode.target_color, "success": episode.success,
            **{f"stats/{key}/{name}": value for key, stats in episode_stats.items() for name, value in stats.items()},
        })
        return {"seed": episode.seed, "instruction": episode.instruction, "target_color": episode.target_color,
                "num_steps": episode.num_steps, "success": episode.success}

    def finish(self, datagen: dict) -> None:
        """Close the files and write meta/: ``datagen`` goes to meta/datagen.json."""
        self.data.close()
        self.video.close()
        pq.write_table(pa.Table.from_pylist(self.episodes), self.episodes_path)
        tasks = pa.table({"task_index": pa.array(list(self.tasks.values()), pa.int64()),
                          "task": pa.array(list(self.tasks), pa.string())})
        # LeRobot reads this file with pandas and looks tasks up by the "task" index: say it is the index.
        pandas_index = {"index_columns": ["task"], "column_indexes": [], "columns": [
            {"name": "task_index", "field_name": "task_index", "pandas_type": "int64", "numpy_type": "int64",
             "metadata": None},
            {"name": "task", "field_name": "task", "pandas_type": "unicode", "numpy_type": "object",
             "metadata": None}]}
        pq.write_table(tasks.replace_schema_metadata({"pandas": json.dumps(pandas_index)}), self.directory / TASKS_PATH)

        size = self.image_size
        features = {
            IMAGE_KEY: {**_feature("video", [size, size, 3], ["height", "width", "channels"]), "info": {
                "video.height": size, "video.width": size, "video.codec": "h264", "video.pix_fmt": VIDEO_PIX_FMT,
                "video.fps": self.fps, "video.channels": 3, "video.crf": VIDEO_CRF, "video.video_backend": "pyav",
                "is_depth_map": False, "has_audio": False}},
            STATE_KEY: _feature("float32", [2], ["x", "y"]),
            ACTION_KEY: _feature("float32", [2], ["vx", "vy"]),
            "timestamp": _feature("float32", [1], None),
            **{key: _feature("int64", [1], None) for key in INDEX_KEYS[1:]},
        }
        info = {
            "codebase_version": CODEBASE_VERSION, "robot_type": self.robot_type,
            "total_episodes": len(self.episodes), "total_frames": self.total_frames, "total_tasks": len(self.tasks),
            "chunks_size": CHUNKS_SIZE, "data_files_size_in_mb": DATA_FILES_SIZE_MB,
            "video_files_size_in_mb": VIDEO_FILES_SIZE_MB, "fps": self.fps,
            "splits": {"train": f"0:{len(self.episodes)}"},
            "data_path": DATA_PATH, "video_path": VIDEO_PATH, "features": features,
        }
        stats = {key: vector_stats(np.concatenate(values).reshape(self.total_frames, -1))
                 for key, values in self.columns.items()}
        stats[IMAGE_KEY] = image_stats(self.histogram, self.total_frames)
        for path, content in ((INFO_PATH, info), (STATS_PATH, stats), (DATAGEN_PATH, datagen)):
            (self.directory / path).write_text(json.dumps(content, indent=2) + "\n")


class LeRobotDemoDataset:
    """Read access to a LeRobot dataset, v3.0 (``robots.datagen --format lerobot``'s, or recorded with LeRobot) or
    v2.x; yields the same ``Episode`` objects as ``DemoDataset``. A malformed dataset raises DatasetError or, for a
    file its layout names that is not there, FileNotFoundError: the message names the file and what was expected."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        info_path = self.directory / INFO_PATH
        self.info = read_json(info_path, DatasetError)
        if not isinstance(self.info, dict):
            raise DatasetError(f"{info_path}: expected a JSON object")
        version = self.info.get("codebase_version")
        if version not in READ_VERSIONS:
            raise DatasetError(f"{info_path} has codebase_version {version!r}; expected one of {list(READ_VERSIONS)} "
                               "(LeRobot's layouts this reader knows)")
        self.legacy = version in LEGACY_VERSIONS  # one data file per episode, one video per episode and camera
        missing = [key for key in ("fps", "total_episodes", "data_path", "features") if key not in self.info]
        if missing:
            raise DatasetError(f"{info_path} lacks {missing}")
        features, fps = self.info["features"], self.info["fps"]
        if not (isinstance(features, dict) and all(isinstance(feature, dict) for feature in features.values())):
            raise DatasetError(f"{info_path}: features {features!r:.80}; expected an object of features, each an "
                               "object with its dtype and shape")
        if isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps < math.inf:
            raise DatasetError(f"{info_path}: fps {fps!r}; expected a positive number of frames a second")
        for key in (STATE_KEY, ACTION_KEY):
            found = features.get(key)
            if found is None or found.get("dtype") not in VECTOR_DTYPES or not _is_width(found.get("shape")):
                raise DatasetError(f"{info_path}: feature {key!r} is {found}; expected dtype "
                                   f"{' or '.join(VECTOR_DTYPES)} with a 1-d shape (features here: {sorted(features)})")
        # The cameras, in info.json's order: the order their frames are put side by side, and the served one. As
        # LeRobot's camera_keys, every feature of a camera's dtype, whatever its key (pusht's "observation.image").
        self.camera_keys = [key for key in features
                            if key.startswith(CAMERA_PREFIX) or features[key].get("dtype") in CAMERA_DTYPES]
        if not self.camera_keys:
            raise DatasetError(f"{info_path}: no camera; expected a feature of dtype 'video' or 'image' "
                               f"({CAMERA_PREFIX}<camera>) (features here: {sorted(features)})")
        if unknown := [key for key in self.camera_keys if features[key].get("dtype") not in CAMERA_DTYPES]:
            raise DatasetError(f"{info_path}: cameras {unknown} have dtype {features[unknown[0]].get('dtype')!r}; "
                               f"expected one of {list(CAMERA_DTYPES)}")
        # Each camera's frame size (height, width), its shape in info.json, which its frames are checked against.
        sizes = {key: _camera_size(info_path, key, features[key]) for key in self.camera_keys}
        # Frames stored as images lie in the data files' rows (PNG bytes).
        self.image_sizes = {key: size for key, size in sizes.items() if features[key]["dtype"] == "image"}
        needed = ["chunks_size"] if self.legacy else []
        if len(self.image_sizes) < len(self.camera_keys):
            needed.append("video_path")  # LeRobot writes null where no camera is a video
        if missing := [key for key in needed if self.info.get(key) is None]:
            raise DatasetError(f"{info_path} lacks {missing}")
        if self.legacy and not (isinstance(self.info["chunks_size"], int) and self.info["chunks_size"] > 0):
            raise DatasetError(f"{info_path}: chunks_size {self.info['chunks_size']!r}; expected a positive integer "
                               "(episodes a chunk folder holds)")
        if not (isinstance(self.info["total_episodes"], int) and self.info["total_episodes"] >= 0):
            raise DatasetError(f"{info_path}: total_episodes {self.info['total_episodes']!r}; expected a count")
        self.camera_names = {key: camera_name(key) for key in self.camera_keys}
        if len(set(self.camera_names.values())) < len(self.camera_keys):
            raise DatasetError(f"{info_path}: cameras {self.camera_keys} are named {list(self.camera_names.values())}; "
                               "expected distinct names (a key less its observation.images. or observation. prefix)")
        self.cameras = list(self.camera_names.values())
        self.camera_sizes = {self.camera_names[key]: size for key, size in sizes.items()}
        self.fps = fps
        self.robot_type = self.info.get("robot_type")
        if self.robot_type is not None and not isinstance(self.robot_type, str):  # it names the embodiment trained
            raise DatasetError(f"{info_path}: robot_type {self.robot_type!r}; expected a string (the robot's name) or "
                               "null")
        self.dims = {key: features[key]["shape"][0] for key in (STATE_KEY, ACTION_KEY)}
        # Channel names where info.json lists one per channel (LeRobot also nests them, {"motors": [...]}).
        self.state_names, self.action_names = (_channel_names(features[key].get("names"), self.dims[key])
                                               for key in (STATE_KEY, ACTION_KEY))

        self.index_name = LEGACY_EPISODES_PATH if self.legacy else EPISODES_DIR  # what says where episodes lie
        self.episodes = self._legacy_episodes() if self.legacy else self._episodes()
        numbers = [row["episode_index"] for row in self.episodes]
        if numbers != list(range(self.info["total_episodes"])):
            raise DatasetError(f"{self.directory / self.index_name} numbers its {len(numbers)} episodes "
                               f"{numbers[:5]}...; expected 0 to {self.info['total_episodes'] - 1} in order "
                               "(total_episodes in info.json)")
        for row in self.episodes:
            tasks, length = row["tasks"], row["length"]
            if not (isinstance(tasks, list) and tasks and all(isinstance(t, str) for t in tasks)
                    and isinstance(length, int) and length > 0):
                raise DatasetError(f"{self.directory / self.index_name}: episode {row['episode_index']} has tasks "
                                   f"{tasks!r:.80} and length {length!r}; expected a list of instructions and a "
                                   "positive number of frames")
        self.entries = [{"seed": row.get("seed"), "instruction": row["tasks"][0],
                         "target_color": row.get("target_color"), "num_steps": row["length"] - 1,
                         "success": row.get("success")} for row in self.episodes]
        # The data file read last: a v3 file holds consecutive episodes, so reading in order reads each once.
        self._table_path: Path | None = None
        self._table: pa.Table | None = None

    def _episodes(self) -> list[dict]:
        """v3.0: meta/episodes/chunk-*/file-*.parquet, a row per episode, with where its rows and frames lie."""
        episodes_dir = self.directory / EPISODES_DIR
        files = sorted(episodes_dir.glob("chunk-*/file-*.parquet"))
        if not files:
            raise FileNotFoundError(f"{episodes_dir}/chunk-*/file-*.parquet not found; expected the episode index")
        table = pa.concat_tables([_read_table(path) for path in files])
        videos = [key for key in self.camera_keys if key not in self.image_sizes]
        needed = [*EPISODE_COLUMNS, *(f"videos/{key}/{c}" for key in videos for c in VIDEO_COLUMNS)]
        missing = [column for column in needed if column not in table.column_names]
        if missing:
            raise DatasetError(f"{episodes_dir} lacks the columns {missing}; expected LeRobot v3's episode index")
        ours = [column for column in DATAGEN_COLUMNS if column in table.column_names]
        return table.select([*needed, *ours]).to_pylist()

    def _legacy_episodes(self) -> list[dict]:
        """v2.x: meta/episodes.jsonl, a line per episode: {"episode_index": ..., "tasks": [...], "length": ...}.
        Read a line at a time, each at most `MAX_EPISODE_LINE_BYTES`, and one line past total_episodes at most."""
        path = self.directory / LEGACY_EPISODES_PATH
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found; expected the episode index of a LeRobot "
                                    f"{self.info['codebase_version']} dataset")
        episodes = []
        with path.open("rb") as file:
            for number, line in enumerate(iter(lambda: file.readline(MAX_EPISODE_LINE_BYTES + 1), b""), 1):
                if len(line) > MAX_EPISODE_LINE_BYTES:
                    raise DatasetError(f"{path}: line {number} is over {MAX_EPISODE_LINE_BYTES} bytes; expected an "
                                       "episode's index, tasks and length")
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line, strict=False)  # as LeRobot's reader: tabs and newlines in a task
                except ValueError as error:  # also a line that is not UTF-8
                    raise DatasetError(f"{path}: line {number} is not valid JSON ({error})") from None
                if not (isinstance(entry, dict) and all(key in entry for key in LEGACY_EPISODE_KEYS)
                        and isinstance(entry["episode_index"], int)):
                    raise DatasetError(f"{path}: line {number} is {line[:80].decode(errors='replace').strip()!r}; "
                                       f"expected a JSON object with {list(LEGACY_EPISODE_KEYS)}, an integer "
                                       "episode_index")
                episodes.append(entry)
                if len(episodes) > self.info["total_episodes"]:
                    break  # one too many: the numbering check names it
        return sorted(episodes, key=lambda entry: entry["episode_index"])  # LeRobot's order, whatever the lines'

    def __len__(self) -> int:
        return len(self.episodes)

    def _file(self, template_key: str, index: int, what: str, **fields) -> Path:
        """The file info.json's ``template_key`` names with ``fields``, which must exist: episode ``index``'s
        ``what``."""
        template = self.info[template_key]
        try:
            path = self.directory / template.format(**fields)
        except (KeyError, IndexError, ValueError, AttributeError) as error:
            raise DatasetError(f"{self.directory / INFO_PATH}: {template_key} {template!r} does not name a file "
                               f"with {sorted(fields)} ({type(error).__name__}: {error}); expected LeRobot "
                               f"{self.info['codebase_version']}'s template") from None
        if not path.is_file():
            source = f"{INFO_PATH}'s {template_key}" if self.legacy else self.index_name
            raise FileNotFoundError(f"{path} not found; {source} puts episode {index}'s {what} there")
        return path

    def _chunk(self, index: int) -> dict[str, int]:
        """Where v2.x puts episode ``index``'s files: ``chunks_size`` episodes a chunk folder."""
        return {"episode_chunk": index // self.info["chunks_size"], "episode_index": index}

    def _rows(self, index: int, row: dict) -> tuple[Path, pa.Table]:
        """The data file of episode ``index`` and its rows there, checked against its length."""
        if self.legacy:
            path = self._file("data_path", index, "rows", **self._chunk(index))
        else:
            path = self._file("data_path", index, "rows", chunk_index=row["data/chunk_index"],
                              file_index=row["data/file_index"])
        if path != self._table_path:
            self._table = _read_table(path, ["episode_index", "frame_index", STATE_KEY, ACTION_KEY,
                                             *self.image_sizes])
            self._table_path = path
        rows = self._table.filter(pc.equal(self._table["episode_index"], index))
        numbers = rows["frame_index"].to_pylist()
        if numbers != list(range(row["length"])):
            raise DatasetError(f"{path} holds {len(numbers)} rows of episode {index}, frame_index {numbers[:5]}...; "
                               f"expected {row['length']} (its length in {self.index_name}) numbered from 0")
        return path, rows

    def _vectors(self, path: Path, index: int, rows: pa.Table, key: str) -> np.ndarray:
        """Column ``key`` of episode ``index``'s ``rows`` in ``path``: float32 [rows, D], D its shape in info.json.
        LeRobot keeps a feature of shape [1] as a number a row, a wider one as a list of numbers."""
        column, dim = rows[key].combine_chunks(), self.dims[key]
        expected = f"expected {dim} numbers a row (its shape in info.json)"
        listed = pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or \
            pa.types.is_fixed_size_list(column.type)
        values = column.flatten() if listed else column
        if not (pa.types.is_floating(values.type) or pa.types.is_integer(values.type)) or not (listed or dim == 1):
            raise DatasetError(f"{path}: episode {index}'s {key!r} is {column.type}; {expected}")
        lengths = pc.list_value_length(column).to_pylist() if listed else []  # None for a null row
        if (frame := next((i for i, n in enumerate(lengths) if n != dim), None)) is not None:
            raise DatasetError(f"{path}: episode {index}'s {key!r} at frame {frame} holds {lengths[frame] or 'no'} "
                               f"numbers; {expected}")
        return values.to_numpy(zero_copy_only=False).reshape(rows.num_rows, dim).astype(np.float32)

    def __getitem__(self, index: int) -> Episode:
        row = self.episodes[index]
        path, rows = self._rows(index, row)
        cameras = [_decode_images(path, rows[key], key, self.image_sizes[key]) if key in self.image_sizes
                   else self._video_frames(index, row, key) for key in self.camera_keys]
        if len({frames.shape[0] for frames in cameras}) > 1:
            raise DatasetError(f"episode {index}: its cameras {self.cameras} decode to "
                               f"{[len(f) for f in cameras]} frames; expected {row['length']} each")
        actions = self._vectors(path, index, rows, ACTION_KEY)
        return Episode(
            frames=side_by_side(cameras),
            states=self._vectors(path, index, rows, STATE_KEY),
            actions=actions[:-1],
            hold_action=actions[-1],  # the final observation's
            instruction=row["tasks"][0],
            seed=row.get("seed"),
            target_color=row.get("target_color"),
            success=row.get("success"),
        )

    def _video_frames(self, index: int, row: dict, key: str) -> np.ndarray:
        """Episode ``index``'s frames of the video feature ``key``: uint8 [length, H, W, 3]. v3.0 puts them from
        the episode's from_timestamp of a video of many; v2.x in a video of their own."""
        what = f"frames of {key}"
        if self.legacy:
            video, start = self._file("video_path", index, what, video_key=key, **self._chunk(index)), 0.0
        else:
            video = self._file("video_path", index, what, video_key=key, chunk_index=row[f"videos/{key}/chunk_index"],
                               file_index=row[f"videos/{key}/file_index"])
            start = row[f"videos/{key}/from_timestamp"]
        try:
            frames = read_frames(video, start, row["length"], self.fps)
        except ValueError as error:
            raise DatasetError(f"episode {index} ({row['length']} frames in {self.index_name}): {error}") from None
        if (size := frames.shape[1:3]) != (expected := self.camera_sizes[self.camera_names[key]]):
            raise DatasetError(f"{video}: episode {index}'s frames of {key} are {size[0]}x{size[1]} px; expected "
                               f"{expected[0]}x{expected[1]} (its shape in info.json)")
        return frames

    def __iter__(self):
        for index in range(len(self)):
            yield self[index]


def camera_name(key: str) -> str:
    """The served name of the camera feature ``key``: ``observation.images.<camera>``'s <camera>, else the key less an
    ``observation.`` prefix (pusht's ``observation.image``: ``image``)."""
    return key.removeprefix(CAMERA_PREFIX) if key.startswith(CAMERA_PREFIX) else key.removeprefix("observation.")


def _camera_size(info_path: Path, key: str, feature: dict) -> tuple[int, int]:
    """(height, width) of the camera feature ``key`` (video or image): its shape in info.json, [H, W, C] unless its
    names say otherwise (LeRobot's ["height", "width", "channels"]; some converted datasets are channels first)."""
    shape, names = feature.get("shape"), feature.get("names")
    if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(n, int) and n > 0 for n in shape)):
        raise DatasetError(f"{info_path}: feature {key!r} has shape {shape!r}; expected [height, width, channels]")
    if isinstance(names, list) and "height" in names and "width" in names:
        return shape[names.index("height")], shape[names.index("width")]
    return shape[0], shape[1]


def _decode_images(path: Path, column: pa.ChunkedArray, key: str, size: tuple[int, int]) -> np.ndarray:
    """The frames of the image feature ``key`` in rows of the data file ``path``: uint8 RGB [rows, H, W, 3].
    LeRobot keeps each as Hugging Face datasets' Image, a struct of its encoded bytes (PNG) and a path; an image's
    size is checked from its header, before its pixels are decoded."""
    column = column.combine_chunks()
    if not (pa.types.is_struct(column.type) and column.type.get_field_index("bytes") >= 0):
        raise DatasetError(f"{path}: column {key!r} is {column.type}; expected images as LeRobot stores them, "
                           "struct<bytes: binary, path: string>")
    frames = []
    for frame_index, encoded in enumerate(column.field("bytes").to_pylist()):
        where = f"{path}: frame {frame_index} of {key!r}"
        if encoded is None:
            raise DatasetError(f"{where} holds no image bytes; expected the image itself (PNG), not only a path")
        try:
            with Image.open(io.BytesIO(encoded)) as image:
                if image.mode in ("I", "F") or image.mode.startswith("I;"):  # PIL's RGB of them clips at 255
                    raise DatasetError(f"{where} is a {image.mode} image (PIL's mode: 16 or 32 bits a pixel); "
                                       "expected 8 bits a channel (RGB, RGBA, L or P), as LeRobot records frames")
                if (image_hw := image.size[::-1]) != size:  # PIL's size is (width, height)
                    raise DatasetError(f"{where} is {image_hw[0]}x{image_hw[1]} px; expected "
                                       f"{size[0]}x{size[1]} (its shape in info.json)")
                frames.append(np.asarray(image.convert("RGB")))
        except (OSError, Image.DecompressionBombError) as error:  # not an image, or cut short
            raise DatasetError(f"{where} is not a readable image ({error})") from None
    return np.stack(frames)


def _is_width(shape: object) -> bool:
    """Whether ``shape`` is that of a vector, [D], D a positive integer."""
    return isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int) and shape[0] > 0


def _channel_names(names: object, dim: int) -> list[str] | None:
    """``names`` if it is a list of ``dim`` non-empty strings (or a dict holding only such a list, as LeRobot often
    nests them: ``{"motors": [...]}``), else None."""
    if isinstance(names, dict) and len(names) == 1:
        (names,) = names.values()
    ok = isinstance(names, list) and len(names) == dim and all(isinstance(n, str) and n for n in names)
    return names if ok else None


def _read_table(path: Path, columns: list[str] | None = None) -> pa.Table:
    """The parquet file ``path``, or only its ``columns`` (all of which it must have)."""
    try:
        if columns is not None and (missing := [c for c in columns if c not in pq.read_schema(path).names]):
            raise DatasetError(f"{path} lacks the columns {missing}; expected {columns} (info.json's features)")
        return pq.read_table(path, columns=columns)
    except (pa.ArrowInvalid, OSError) as error:
        raise DatasetError(f"{path}: not a readable parquet file ({error})") from None
