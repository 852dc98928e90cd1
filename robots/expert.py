"""Scripted expert for the reaching tasks: a proportional controller on privileged state."""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from robots.envs import REACH_ID
from robots.envs.reach import ReachConfig, ReachEnv, ReachScene


class ReachExpert:
    """Drive the effector straight at the named target.

    The command is ``gain * (target - effector)`` in m/s, scaled down as a whole (direction kept) so
    that no axis exceeds the velocity limit: the path is a straight line at full speed that slows
    down over the last few centimetres instead of overshooting.
    """

    def __init__(self, gain: float = 4.0):
        if gain <= 0:
            raise ValueError(f"gain={gain} must be positive (1/s)")
        self.gain = gain

    def command(self, scene: ReachScene, config: ReachConfig) -> np.ndarray:
        """Velocity command, float32 [2] in m/s, within ±``config.max_speed`` per axis."""
        velocity = self.gain * (scene.target_xy - scene.effector_xy)
        peak = np.max(np.abs(velocity))
        if peak > config.max_speed:
            velocity = velocity * (config.max_speed / peak)
        return velocity.astype(np.float32)

    def __call__(self, env: gym.Env) -> np.ndarray:
        """Command for the current state of ``env`` (a ``ReachEnv``, possibly wrapped)."""
        base = env.unwrapped
        if not isinstance(base, ReachEnv):
            raise TypeError(f"ReachExpert needs a ReachEnv, got {type(base).__name__}")
        if base.scene is None:
            raise RuntimeError("the environment has not been reset")
        return self.command(base.scene, base.config)


def expert_observations(count: int, first_seed: int, stride: int = 1, env_id: str = REACH_ID) -> list[dict]:
    """`count` observations of `env_id` along expert episodes on seeds `first_seed`, `first_seed + 1`, ...: every
    `stride`-th control step of each episode, from its first; each with its episode's `instruction`."""
    env = gym.make(env_id)
    expert = ReachExpert()
    observations: list[dict] = []
    episode = 0
    while len(observations) < count:
        obs, _ = env.reset(seed=first_seed + episode)
        step, done = 0, False
        while not done and len(observations) < count:
            if step % stride == 0:
                observations.append({**obs, "instruction": env.unwrapped.task_description})
            obs, _, terminated, truncated, _ = env.step(expert(env))
            step, done = step + 1, terminated or truncated
        episode += 1
    env.close()
    return observations
