"""The scripted expert solves the task from privileged state."""

import gymnasium as gym
import numpy as np

from robots.envs import REACH_HARD_ID, REACH_ID
from robots.expert import ReachExpert


def success_rate(env_id: str, seeds: range) -> tuple[float, list[int]]:
    env = gym.make(env_id)
    expert = ReachExpert()
    successes, lengths = 0, []
    for seed in seeds:
        env.reset(seed=seed)
        done, steps = False, 0
        while not done:
            action = expert(env)
            assert env.action_space.contains(action)
            _, _, terminated, truncated, info = env.step(action)
            done, steps = terminated or truncated, steps + 1
        successes += int(info["is_success"])
        lengths.append(steps)
    return successes / len(seeds), lengths


def test_expert_succeeds_at_least_98_percent():
    rate, lengths = success_rate(REACH_ID, range(100))
    assert rate >= 0.98
    assert max(lengths) < gym.spec(REACH_ID).max_episode_steps


def test_expert_on_hard_variant():
    rate, _ = success_rate(REACH_HARD_ID, range(50))
    assert rate >= 0.98


def test_expert_moves_towards_named_target_within_limits():
    env = gym.make(REACH_ID)
    env.reset(seed=5)
    scene = env.unwrapped.scene
    action = ReachExpert()(env)
    direction = scene.target_xy - scene.effector_xy
    cosine = float(action @ direction) / (np.linalg.norm(action) * np.linalg.norm(direction))
    assert cosine > 0.999
    assert np.max(np.abs(action)) <= env.unwrapped.config.max_speed + 1e-7
