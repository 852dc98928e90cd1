"""Coloured-target reaching on a table top: a planar end-effector must touch the object the
instruction names.

The scene is a square table seen from above. Several discs of distinct colours lie on it; the
instruction ("reach the red circle") picks one of them. A policy that ignores the instruction can
at best guess, so it fails most episodes. Actions are planar end-effector velocities (the Cosmos3
``pusht`` embodiment: domain id 4, raw action width 2).

Units: positions in metres in the table frame (origin at the bottom-left corner, x right, y up),
velocities in m/s, one control step lasts ``1 / control_hz`` seconds.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, replace

import cv2
import gymnasium as gym
import numpy as np
from gymnasium import spaces

# RGB, chosen to stay distinct after VAE compression and from the table colour.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 40),
    "green": (35, 165, 60),
    "blue": (40, 75, 215),
    "yellow": (235, 200, 25),
}
TABLE_RGB = (196, 186, 166)  # at the table centre; see `ReachConfig.table_tint`
EFFECTOR_RGB = (30, 30, 30)

EMBODIMENT = "pusht"
DOMAIN_ID = 4
ACTION_DIM = 2
STATE_DIM = 2

# Seeds 0 .. HELDOUT_SEED_OFFSET-1 are for demonstrations; evaluation uses seeds from the offset on,
# so a policy is never scored on a scene it was trained on.
HELDOUT_SEED_OFFSET = 1_000_000

_INSTRUCTION_CHARSET = frozenset(string.ascii_lowercase + " ")
_INSTRUCTION_MAX_LENGTH = 64
# Subpixel precision for OpenCV drawing: coordinates are scaled by 2**_SHIFT.
_SHIFT = 4


@dataclass(frozen=True)
class ReachConfig:
    """Geometry and dynamics of one task variant (all lengths in metres)."""

    table_size: float = 0.5  # side of the square workspace, m
    num_objects: int = 3
    # Discs of the named colour (the rest are distractors); reaching any of them succeeds, and the expert heads
    # for one of them at random: the demonstrations of a scene have that many modes.
    target_copies: int = 1
    # With two discs of the named colour: the third disc, a distractor, sits between them, on the bisector of the
    # directions from the effector's start to each; touching it ends the episode as a failure. The straight paths
    # to either disc clear it, but the average of the two (what a sampler that averages the modes drives) runs
    # into it.
    blocker: bool = False
    blocker_clearance: float = 0.09  # least distance from the blocker centre to either straight path, m
    colors: tuple[str, ...] = ("red", "green", "blue", "yellow")
    object_radius: float = 0.035  # m
    effector_half_size: float = 0.018  # half side of the drawn square, m
    success_radius: float = 0.03  # effector centre within this distance of the target centre, m
    min_separation: float = 0.12  # between any two objects and between effector start and objects, m
    object_margin: float = 0.06  # object centres keep this distance from the table edge, m
    max_speed: float = 0.2  # per-axis velocity limit, m/s
    control_hz: float = 10.0
    max_episode_steps: int = 80
    # A cycle time: when set, an episode is also truncated once it has run this many times the steps that a straight
    # path at the velocity limit needs to reach the farther disc of the named colour (``ReachScene.step_limit``).
    # A reach that is right but slow then fails like a wrong one, as on a line that moves on without the robot.
    time_limit_factor: float | None = None
    image_size: int = 64  # observation image side, pixels
    instruction_template: str = "reach the {color} circle"
    # The table mat is tinted: red grows to the right and green to the top, by up to this many RGB
    # levels at the edges. Every image patch thus shows where it lies on the table. The Cosmos3
    # transformer has only relative (RoPE) positions, so on a plain mat a patch's content would not
    # say where it is and the policy could not read the target's position from it.
    table_tint: int = 40

    def __post_init__(self) -> None:
        unknown = [c for c in self.colors if c not in COLORS]
        if unknown:
            raise ValueError(f"unknown colours {unknown}; expected names from {sorted(COLORS)}")
        if not 1 <= self.target_copies < self.num_objects:
            raise ValueError(
                f"target_copies={self.target_copies} must be at least 1 and leave a distractor "
                f"(below num_objects={self.num_objects})"
            )
        if not 2 <= self.num_objects - self.target_copies + 1 <= len(self.colors):
            raise ValueError(
                f"num_objects={self.num_objects} with target_copies={self.target_copies} needs between 2 and "
                f"{len(self.colors)} distinct colours (the number of colours)"
            )
        if self.blocker and (self.target_copies, self.num_objects) != (2, 3):
            raise ValueError(
                f"blocker=True needs target_copies=2 and num_objects=3 (two discs of the named colour and the "
                f"blocker); got target_copies={self.target_copies}, num_objects={self.num_objects}"
            )
        if self.time_limit_factor is not None and not 1.0 <= self.time_limit_factor <= 10.0:
            raise ValueError(
                f"time_limit_factor={self.time_limit_factor} must be between 1 (the fastest straight path) and 10, "
                f"or None for no cycle time"
            )
        if not 0 <= self.table_tint <= 60:
            raise ValueError(f"table_tint={self.table_tint} must be between 0 and 60 RGB levels")
        for color in self.colors:
            text = self.instruction_template.format(color=color)
            if not set(text) <= _INSTRUCTION_CHARSET or len(text) > _INSTRUCTION_MAX_LENGTH:
                raise ValueError(
                    f"instruction {text!r}: expected at most {_INSTRUCTION_MAX_LENGTH} lowercase letters and spaces"
                )

    @property
    def dt(self) -> float:
        """Duration of one control step, s."""
        return 1.0 / self.control_hz


@dataclass
class ReachScene:
    """Privileged simulator state (what a scripted expert may read)."""

    effector_xy: np.ndarray  # [2] float64, m
    object_xy: np.ndarray  # [N, 2] float64, m
    object_colors: tuple[str, ...]  # [N]
    target_index: int  # the disc the expert heads for; any disc of its colour counts as reached
    blocker_index: int | None = None  # the disc whose touch fails the episode (``ReachConfig.blocker``)
    step_limit: int = ReachConfig.max_episode_steps  # the episode is truncated after this many steps
    steps: int = 0
    success: bool = False
    collided: bool = False  # the effector touched the blocker

    @property
    def target_xy(self) -> np.ndarray:
        return self.object_xy[self.target_index]

    @property
    def target_color(self) -> str:
        return self.object_colors[self.target_index]

    def distance_to_target(self) -> float:
        """Distance from the effector to the nearest disc of the target colour, m."""
        return float(np.min(np.linalg.norm(self.target_copies_xy() - self.effector_xy, axis=1)))

    def target_copies_xy(self) -> np.ndarray:
        """Centres of every disc of the target colour, [K, 2] m."""
        return self.object_xy[[c == self.target_color for c in self.object_colors]]


def table_background(size: int, tint: int) -> np.ndarray:
    """The empty table mat, uint8 [size, size, 3]: `TABLE_RGB` at the centre, red +-`tint` from left
    to right, green +-`tint` from bottom to top (pixel centres)."""
    ramp = (np.arange(size) + 0.5) / size * 2 - 1  # -1 .. 1 across the image
    image = np.empty((size, size, 3), np.float64)
    image[:] = TABLE_RGB
    image[..., 0] += tint * ramp[None, :]
    image[..., 1] += tint * -ramp[:, None]  # rows grow downwards, y upwards
    return np.clip(np.round(image), 0, 255).astype(np.uint8)


class ReachEnv(gym.Env):
    """Reach the coloured disc named by the instruction.

    Observation (dict):
        ``image``: uint8 [S, S, 3] RGB top-down view (S = ``config.image_size``),
        ``state``: float32 [2] effector xy, m.
    The instruction ("reach the red circle") is not in the observation: it is the attribute
    ``task_description`` (also ``task``), the names LeRobot's evaluation reads from each sub-environment
    of a vector env (``envs.call("task_description")``). A text space cannot travel in the shared memory
    of gymnasium's async vector env: it would arrive blank.
    Action: float32 [2] effector velocity (vx, vy) in m/s, each within ±``config.max_speed``;
    larger values are clipped, non-finite values raise ``ValueError``.
    Reward: 1.0 on the step that reaches the target, else 0.0. The episode terminates on success and
    is truncated after ``config.max_episode_steps`` steps, or earlier at the scene's cycle time
    (``config.time_limit_factor``).
    ``info``: ``is_success``, ``distance`` (m), ``target_color``, ``target_xy`` (m), ``collided``, ``step_limit``.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(
        self,
        render_mode: str | None = None,
        render_size: int = 256,
        config: ReachConfig | None = None,
        **config_overrides,
    ):
        """``config_overrides`` replace single ``ReachConfig`` fields, e.g. ``num_objects=4``, so that
        ``gymnasium.make("PolicyServer/Reach-v0", num_objects=4)`` works."""
        unknown = sorted(set(config_overrides) - set(ReachConfig.__dataclass_fields__))
        if unknown:
            raise TypeError(
                f"unknown ReachConfig fields {unknown}; expected some of {sorted(ReachConfig.__dataclass_fields__)}"
            )
        self.config = replace(config or ReachConfig(), **config_overrides)
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode={render_mode!r} is not supported; expected None or 'rgb_array'")
        self.render_mode = render_mode
        self.render_size = int(render_size)
        self.metadata = {**self.metadata, "render_fps": self.config.control_hz}

        cfg = self.config
        speed = np.full(ACTION_DIM, cfg.max_speed, dtype=np.float32)
        self.action_space = spaces.Box(-speed, speed, dtype=np.float32)
        self.observation_space = spaces.Dict(
            {
                "image": spaces.Box(0, 255, (cfg.image_size, cfg.image_size, 3), dtype=np.uint8),
                "state": spaces.Box(0.0, cfg.table_size, (STATE_DIM,), dtype=np.float32),
            }
        )
        # Table backgrounds per render size, cached because the table never changes.
        self._backgrounds: dict[int, np.ndarray] = {}
        self.scene: ReachScene | None = None

    # ------------------------------------------------------------------ gymnasium API

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Sample a new scene. ``options={"target_color": "red"}`` fixes the named colour; with several discs of
        it, ``"target_copy": k`` (0 .. ``target_copies`` - 1) picks the one the expert heads for."""
        super().reset(seed=seed)
        options = options or {}
        unknown = sorted(set(options) - {"target_color", "target_copy"})
        if unknown:
            raise ValueError(f"unknown reset options {unknown}; expected 'target_color' and/or 'target_copy'")
        target_color = options.get("target_color")
        if target_color is not None and target_color not in self.config.colors:
            raise ValueError(f"target_color={target_color!r} is not one of {list(self.config.colors)}")
        target_copy = options.get("target_copy")
        if target_copy is not None and target_copy not in range(self.config.target_copies):
            raise ValueError(
                f"target_copy={target_copy!r}: expected an integer from 0 to {self.config.target_copies - 1}"
            )
        self.scene = self._sample_scene(target_color, target_copy)
        self.scene.step_limit = step_limit(self.config, self.scene.effector_xy, self.scene.target_copies_xy())
        return self._observation(), self._info()

    def step(self, action):
        if self.scene is None:
            raise RuntimeError("step() called before reset()")
        action = np.asarray(action, dtype=np.float64)
        if action.shape != (ACTION_DIM,):
            raise ValueError(f"action has shape {action.shape}; expected ({ACTION_DIM},) effector velocity in m/s")
        if not np.all(np.isfinite(action)):
            raise ValueError(f"action {action.tolist()} contains NaN or Inf; expected finite velocities in m/s")
        cfg = self.config
        scene = self.scene
        velocity = np.clip(action, -cfg.max_speed, cfg.max_speed)
        scene.effector_xy = np.clip(scene.effector_xy + velocity * cfg.dt, 0.0, cfg.table_size)
        scene.steps += 1
        scene.success = scene.distance_to_target() <= cfg.success_radius
        if scene.blocker_index is not None and not scene.success:
            gap = np.linalg.norm(scene.effector_xy - scene.object_xy[scene.blocker_index])
            scene.collided = bool(gap <= cfg.object_radius + cfg.effector_half_size)
        terminated = scene.success or scene.collided
        truncated = not terminated and scene.steps >= scene.step_limit
        reward = 1.0 if scene.success else 0.0
        return self._observation(), reward, terminated, truncated, self._info()

    def render(self):
        if self.render_mode != "rgb_array":
            return None
        return self.draw(self.render_size)

    # ------------------------------------------------------------------ helpers

    @property
    def task_description(self) -> str:
        """The episode's instruction, e.g. "reach the red circle"."""
        if self.scene is None:
            raise RuntimeError("no instruction before reset()")
        return self.config.instruction_template.format(color=self.scene.target_color)

    @property
    def task(self) -> str:
        """The instruction again: LeRobot reads ``task`` where an environment has no ``task_description``, and
        warns when either is missing."""
        return self.task_description

    def draw(self, size: int) -> np.ndarray:
        """Top-down RGB view of the current scene, uint8 [size, size, 3]."""
        if self.scene is None:
            raise RuntimeError("nothing to draw before reset()")
        cfg = self.config
        if size not in self._backgrounds:
            self._backgrounds[size] = table_background(size, cfg.table_tint)
        image = self._backgrounds[size].copy()
        scale = size / cfg.table_size * (1 << _SHIFT)  # fixed-point pixels per metre

        def to_pixel(xy: np.ndarray) -> tuple[int, int]:
            # y points up on the table but rows grow downwards in the image.
            return int(round(xy[0] * scale)), int(round((cfg.table_size - xy[1]) * scale))

        radius = int(round(cfg.object_radius * scale))
        for xy, color in zip(self.scene.object_xy, self.scene.object_colors, strict=True):
            cv2.circle(image, to_pixel(xy), radius, COLORS[color], -1, cv2.LINE_AA, _SHIFT)
        cx, cy = to_pixel(self.scene.effector_xy)
        half = int(round(cfg.effector_half_size * scale))
        cv2.rectangle(image, (cx - half, cy - half), (cx + half, cy + half), EFFECTOR_RGB, -1, cv2.LINE_AA, _SHIFT)
        return image

    def _observation(self) -> dict:
        return {
            "image": self.draw(self.config.image_size),
            "state": self.scene.effector_xy.astype(np.float32),
        }

    def _info(self) -> dict:
        scene = self.scene
        return {
            "is_success": scene.success,
            "distance": scene.distance_to_target(),
            "target_color": scene.target_color,
            "target_xy": scene.target_xy.copy(),
            "collided": scene.collided,
            "step_limit": scene.step_limit,
        }

    def _sample_scene(self, target_color: str | None, target_copy: int | None) -> ReachScene:
        cfg = self.config
        rng = self.np_random
        distinct = cfg.num_objects - cfg.target_copies + 1
        colors = tuple(str(c) for c in rng.permutation(list(cfg.colors))[:distinct])
        if target_color is not None and target_color not in colors:
            colors = (target_color,) + colors[1:]  # replace one distractor by the requested colour
        if cfg.blocker:
            return self._sample_blocked_scene(colors, target_color, target_copy)
        lo, hi = cfg.object_margin, cfg.table_size - cfg.object_margin
        # Rejection sampling: with the default geometry a valid layout is found in a few draws.
        for _ in range(10_000):
            points = rng.uniform(lo, hi, size=(cfg.num_objects + 1, 2))
            gaps = np.linalg.norm(points[:, None] - points[None], axis=-1)
            if np.all(gaps[np.triu_indices(len(points), 1)] >= cfg.min_separation):
                break
        else:
            raise RuntimeError(f"could not place {cfg.num_objects} objects with separation {cfg.min_separation} m")
        if target_color is None:
            target_color = colors[int(rng.integers(distinct))]
        colors += (target_color,) * (cfg.target_copies - 1)
        copies = [i for i, c in enumerate(colors) if c == target_color]
        if target_copy is None:
            target_copy = int(rng.integers(len(copies))) if len(copies) > 1 else 0
        target_index = copies[target_copy]
        return ReachScene(
            effector_xy=points[-1], object_xy=points[:-1], object_colors=colors, target_index=target_index
        )

    def _sample_blocked_scene(self, colors: tuple[str, ...], target_color: str | None,
                              target_copy: int | None) -> ReachScene:
        """Two discs of the target colour (objects 0 and 1), the effector's start as far from one as from the
        other, and the blocker (object 2) half way from the start towards the point between them.

        The expert heads for either disc at random, and from its first step on it is nearer to the one it heads
        for: only the start is ambiguous. A sampler that averages the two modes there keeps the effector as far
        from one as from the other, straight towards the blocker.
        """
        cfg = self.config
        rng = self.np_random
        if target_color is None:
            target_color = colors[int(rng.integers(len(colors)))]
        distractor = next(c for c in colors if c != target_color)
        lo, hi = cfg.object_margin, cfg.table_size - cfg.object_margin
        # Rejection sampling: about one draw in 100 fits the table and leaves both paths clear of the blocker.
        for _ in range(100_000):
            copies = rng.uniform(lo, hi, size=(2, 2))
            middle, half = copies.mean(axis=0), (copies[1] - copies[0]) / 2
            normal = np.array([-half[1], half[0]]) / np.linalg.norm(half)
            start = middle + normal * rng.uniform(-cfg.table_size, cfg.table_size)
            approach = middle - start
            if np.linalg.norm(approach) < cfg.min_separation:
                continue
            blocker = start + approach / np.linalg.norm(approach) * 0.5 * np.linalg.norm(copies[0] - start)
            points = np.stack([*copies, blocker, start])
            gaps = np.linalg.norm(points[:, None] - points[None], axis=-1)
            if (np.all((lo <= points) & (points <= hi)) and np.all(gaps[np.triu_indices(4, 1)] >= cfg.min_separation)
                    and all(_distance_to_segment(blocker, start, c) >= cfg.blocker_clearance for c in copies)):
                break
        else:
            raise RuntimeError("could not place the blocker clear of both paths")
        if target_copy is None:
            target_copy = int(rng.integers(2))
        return ReachScene(effector_xy=start, object_xy=points[:3],
                          object_colors=(target_color, target_color, distractor), target_index=target_copy,
                          blocker_index=2)


def _distance_to_segment(point: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    """Distance from `point` to the segment from `a` to `b`, m."""
    t = np.clip(np.dot(point - a, b - a) / np.dot(b - a, b - a), 0.0, 1.0)
    return float(np.linalg.norm(point - (a + t * (b - a))))


def step_limit(config: ReachConfig, start_xy: np.ndarray, targets_xy: np.ndarray) -> int:
    """Steps an episode may run from `start_xy` [2] m with target discs at `targets_xy` [K, 2] m:
    `config.max_episode_steps`, or the cycle time when that is shorter (`config.time_limit_factor` times the steps
    a straight path at the velocity limit needs to the farther disc)."""
    if config.time_limit_factor is None:
        return config.max_episode_steps
    offsets = targets_xy - start_xy
    distance = np.linalg.norm(offsets, axis=1)
    # Along a straight line the axis with the larger offset moves at the limit.
    step_length = config.max_speed * config.dt * distance / np.max(np.abs(offsets), axis=1)
    fastest = np.ceil((distance - config.success_radius) / step_length).max()
    return int(min(config.max_episode_steps, max(1, np.ceil(config.time_limit_factor * fastest))))
