"""On-disk format of demonstration datasets, shared by data generation and training.

A dataset is a directory::

    dataset.json              metadata: env id and config, units, per-episode index, statistics
    episode_000000.safetensors
    episode_000001.safetensors
    ...

Each episode file holds (T = number of actions):
    ``frames``  uint8   [T+1, S, S, 3]  RGB observations; frame i is seen before action i
    ``states``  float32 [T+1, 2]        effector xy, m
    ``actions`` float32 [T, 2]          effector velocity, m/s; action i moves frame i to frame i+1
After the last action the effector holds still: zero velocity (an ``Episode``'s ``hold_action``).
Strings (instruction, colour) live in ``dataset.json``, never in the tensor files.

``robots.lerobot_dataset`` holds the same episodes in the LeRobot v3 layout (and reads LeRobot's v2 layout too);
``open_dataset`` reads any of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

if TYPE_CHECKING:
    from robots.lerobot_dataset import LeRobotDemoDataset

METADATA_FILE = "dataset.json"
FORMAT_VERSION = 1


class DatasetError(ValueError):
    """A dataset folder whose files are not what its layout says: the message names the file and what was
    expected."""


@dataclass
class Episode:
    """One demonstration. Shapes as in the module docstring."""

    frames: np.ndarray
    states: np.ndarray
    actions: np.ndarray
    # [A]: what the robot is sent once the demonstration is over, the action past its end: zero velocity for the
    # Reach task; a LeRobot dataset's final row's (a position-controlled arm's last target holds it where it ended).
    hold_action: np.ndarray
    instruction: str
    seed: int | None  # None (the three of them) for demonstrations not made by robots.datagen
    target_color: str | None
    success: bool | None

    def __post_init__(self) -> None:
        steps = len(self.actions)
        if self.frames.dtype != np.uint8 or self.frames.ndim != 4 or self.frames.shape[-1] != 3:
            raise ValueError(f"frames must be uint8 [T+1, H, W, 3], got {self.frames.dtype} {self.frames.shape}")
        if len(self.frames) != steps + 1 or len(self.states) != steps + 1:
            raise ValueError(
                f"expected T+1 = {steps + 1} frames and states for T = {steps} actions, "
                f"got {len(self.frames)} frames and {len(self.states)} states"
            )

    @property
    def num_steps(self) -> int:
        return len(self.actions)


def episode_file(index: int) -> str:
    return f"episode_{index:06d}.safetensors"


def save_episode(directory: Path, index: int, episode: Episode) -> dict:
    """Write the tensors of one episode; return its entry for ``dataset.json``."""
    tensors = {
        "frames": np.ascontiguousarray(episode.frames),
        "states": np.ascontiguousarray(episode.states, dtype=np.float32),
        "actions": np.ascontiguousarray(episode.actions, dtype=np.float32),
    }
    save_file(tensors, str(Path(directory) / episode_file(index)))
    return {
        "file": episode_file(index),
        "seed": episode.seed,
        "instruction": episode.instruction,
        "target_color": episode.target_color,
        "num_steps": episode.num_steps,
        "success": episode.success,
    }


def array_stats(values: np.ndarray) -> dict[str, list[float]]:
    """Per-dimension statistics of ``values`` [N, D] (the inputs of min-max, mean-std and quantile
    normalisation)."""
    values = np.asarray(values, dtype=np.float64)
    return {
        "min": values.min(0).tolist(),
        "max": values.max(0).tolist(),
        "mean": values.mean(0).tolist(),
        "std": values.std(0).tolist(),
        "q01": np.quantile(values, 0.01, axis=0).tolist(),
        "q99": np.quantile(values, 0.99, axis=0).tolist(),
    }


def write_metadata(directory: Path, metadata: dict) -> None:
    path = Path(directory) / METADATA_FILE
    path.write_text(json.dumps({"format_version": FORMAT_VERSION, **metadata}, indent=2, sort_keys=True) + "\n")


class DemoDataset:
    """Read access to a dataset directory written by ``robots.datagen``."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        path = self.directory / METADATA_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found; expected a dataset written by `python -m robots.datagen`")
        try:
            self.metadata = json.loads(path.read_text())
        except ValueError as error:
            raise DatasetError(f"{path}: not valid JSON ({error})") from None
        if not isinstance(self.metadata, dict):
            raise DatasetError(f"{path}: expected a JSON object")
        if self.metadata.get("format_version") != FORMAT_VERSION:
            raise DatasetError(
                f"{path} has format_version {self.metadata.get('format_version')!r}; expected {FORMAT_VERSION}"
            )
        self.entries: list[dict] = self.metadata["episodes"]
        self.fps: float = self.metadata["fps"]  # the control rate the demonstrations were recorded at, Hz
        self.cameras = ["image"]  # the Reach task's one camera
        self.camera_sizes = {"image": (self.metadata["image"]["height"], self.metadata["image"]["width"])}  # (H, W)
        self.robot_type = None
        self.state_names = self.action_names = None

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> Episode:
        entry = self.entries[index]
        path = self.directory / entry["file"]
        try:
            tensors = load_file(str(path))
        except SafetensorError as error:
            raise DatasetError(f"{path}: not a readable safetensors file ({error})") from None
        return Episode(
            frames=tensors["frames"],
            states=tensors["states"],
            actions=tensors["actions"],
            hold_action=np.zeros(tensors["actions"].shape[1], np.float32),
            instruction=entry["instruction"],
            seed=entry["seed"],
            target_color=entry["target_color"],
            success=entry["success"],
        )

    def __iter__(self):
        for index in range(len(self)):
            yield self[index]


def open_dataset(directory: str | Path) -> DemoDataset | LeRobotDemoDataset:
    """The dataset in ``directory``, in either layout: ``dataset.json`` (this module's) or ``meta/info.json``
    (LeRobot v3.0 or v2.x, ``robots.lerobot_dataset.LeRobotDemoDataset``, which reads the same way)."""
    from robots.lerobot_dataset import LeRobotDemoDataset, is_lerobot_dataset  # it imports Episode from here

    directory = Path(directory)
    if is_lerobot_dataset(directory) and (directory / METADATA_FILE).is_file():
        raise DatasetError(f"{directory} holds both a {METADATA_FILE} dataset and a LeRobot one (meta/info.json); "
                           "expected one")
    if is_lerobot_dataset(directory):
        return LeRobotDemoDataset(directory)
    if not (directory / METADATA_FILE).is_file():
        raise FileNotFoundError(f"{directory / METADATA_FILE} not found, nor {directory / 'meta' / 'info.json'} "
                                "(LeRobot); expected a dataset written by `python -m robots.datagen`")
    return DemoDataset(directory)
