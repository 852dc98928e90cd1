"""The built-in reaching task: determinism, instructions, success test, action limits, rendering."""

from dataclasses import replace

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from robots.envs import (
    COLORS,
    REACH_EITHER_ID,
    REACH_EITHER_TIMED_ID,
    REACH_HARD_ID,
    REACH_ID,
    ReachConfig,
    ReachEnv,
)
from robots.envs.reach import TABLE_RGB, step_limit, table_background


def rollout_images(seed: int, actions: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    env = gym.make(REACH_ID)
    obs, _ = env.reset(seed=seed)
    images, states = [obs["image"]], [obs["state"]]
    for action in actions:
        obs, *_ = env.step(action)
        images.append(obs["image"])
        states.append(obs["state"])
    return images, states


def test_passes_gymnasium_env_checker():
    check_env(gym.make(REACH_ID, render_mode="rgb_array").unwrapped, skip_render_check=False)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_vector_envs_carry_each_instruction_and_the_single_env_observations(mode):
    """`make_vec` as LeRobot's evaluation uses it: `envs.call("task_description")` gives each sub-environment's
    instruction (an async env's shared memory would blank a text observation), and every sub-environment sees
    what a single environment on its seed sees, after a reset of all and after a masked reset of one."""
    seeds = [11, 12, 13]
    actions = np.random.default_rng(1).uniform(-0.2, 0.2, size=(5, 3, 2)).astype(np.float32)
    singles = [gym.make(REACH_ID) for _ in seeds]
    expected = [env.reset(seed=seed)[0] for env, seed in zip(singles, seeds, strict=True)]
    envs = gym.make_vec(REACH_ID, num_envs=3, vectorization_mode=mode)
    try:
        obs, _ = envs.reset(seed=seeds)
        for step in range(len(actions) + 1):
            for i in range(3):
                np.testing.assert_array_equal(obs["image"][i], expected[i]["image"])
                np.testing.assert_array_equal(obs["state"][i], expected[i]["state"])
            instructions = [env.unwrapped.task_description for env in singles]
            assert list(envs.call("task_description")) == list(envs.call("task")) == instructions
            if step < len(actions):
                obs, *_ = envs.step(actions[step])
                expected = [env.step(a)[0] for env, a in zip(singles, actions[step], strict=True)]
        assert len(set(instructions)) > 1  # the seeds pick different targets: no sub-env answers for another
        obs, _ = envs.reset(seed=[None, 99, None], options={"reset_mask": np.array([False, True, False])})
        expected[1] = singles[1].reset(seed=99)[0]
        for i in range(3):
            np.testing.assert_array_equal(obs["image"][i], expected[i]["image"])
        assert envs.call("task_description")[1] == singles[1].unwrapped.task_description
    finally:
        envs.close()


def test_registered_ids_make_envs_with_time_limit():
    env = gym.make(REACH_ID)
    assert isinstance(env.unwrapped, ReachEnv)
    assert env.spec.max_episode_steps == ReachConfig().max_episode_steps
    hard = gym.make(REACH_HARD_ID)
    assert hard.unwrapped.config.num_objects == 4
    overridden = gym.make(REACH_ID, num_objects=2, max_speed=0.1)
    assert overridden.unwrapped.config.num_objects == 2
    assert overridden.unwrapped.action_space.high.tolist() == pytest.approx([0.1, 0.1])


def test_unknown_config_override_is_rejected():
    with pytest.raises(TypeError, match="num_objcts"):
        ReachEnv(num_objcts=4)
    with pytest.raises(ValueError, match="purple"):
        ReachEnv(colors=("red", "purple", "blue"))
    with pytest.raises(ValueError, match="lowercase"):
        ReachEnv(instruction_template="Reach the {color} circle!")


def test_same_seed_same_episode_different_seed_different_scene():
    actions = np.random.default_rng(0).uniform(-0.2, 0.2, size=(6, 2)).astype(np.float32)
    images_a, states_a = rollout_images(7, actions)
    images_b, states_b = rollout_images(7, actions)
    for a, b in zip(images_a, images_b, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.stack(states_a), np.stack(states_b))
    images_c, _ = rollout_images(8, actions)
    assert not np.array_equal(images_a[0], images_c[0])


def test_observation_shapes_dtypes_and_units():
    env = ReachEnv()
    obs, info = env.reset(seed=3)
    assert obs["image"].shape == (64, 64, 3) and obs["image"].dtype == np.uint8
    assert obs["state"].shape == (2,) and obs["state"].dtype == np.float32
    assert env.observation_space.contains(obs)
    np.testing.assert_allclose(obs["state"], env.scene.effector_xy.astype(np.float32))
    assert set(obs) == {"image", "state"}  # the instruction is an attribute: see the vector env tests
    assert env.task_description == env.task == f"reach the {info['target_color']} circle"
    # the named colour is actually drawn: some pixel is close to it
    color = np.array(COLORS[info["target_color"]], dtype=np.int32)
    assert np.min(np.abs(obs["image"].astype(np.int32) - color).sum(-1)) < 30


def test_render_sizes():
    env = ReachEnv(render_mode="rgb_array", render_size=128)
    env.reset(seed=0)
    frame = env.render()
    assert frame.shape == (128, 128, 3) and frame.dtype == np.uint8
    assert ReachEnv().render() is None  # no render mode: nothing to return


def test_instruction_variants_cover_all_colours_and_match_a_present_object():
    env = ReachEnv()
    seen = set()
    for seed in range(60):
        _, info = env.reset(seed=seed)
        seen.add(env.task_description)
        assert info["target_color"] in env.scene.object_colors
        assert len(set(env.scene.object_colors)) == env.config.num_objects  # colours are distinct
    assert seen == {f"reach the {c} circle" for c in ReachConfig().colors}


def test_reset_option_fixes_target_colour():
    env = ReachEnv()
    for seed in range(10):
        _, info = env.reset(seed=seed, options={"target_color": "yellow"})
        assert info["target_color"] == "yellow" and env.task_description == "reach the yellow circle"
    with pytest.raises(ValueError, match="purple"):
        env.reset(seed=0, options={"target_color": "purple"})


def test_table_tint_tells_every_image_patch_where_it_lies():
    table = table_background(64, 40)
    red, green = table[..., 0].astype(int), table[..., 1].astype(int)
    assert red[:, -1].min() - red[:, 0].max() >= 70  # red grows to the right (x)
    assert green[0].min() - green[-1].max() >= 70  # green grows to the top (y), i.e. up the image
    assert np.all(np.diff(red[0]) >= 0) and np.all(np.diff(green[:, 0]) <= 0)
    plain = table_background(64, 0)
    assert np.all(plain == np.array(TABLE_RGB, np.uint8))
    with pytest.raises(ValueError, match="table_tint"):
        ReachConfig(table_tint=90)


def test_scene_respects_separation():
    env = ReachEnv()
    cfg = env.config
    for seed in range(50):
        env.reset(seed=seed)
        points = np.vstack([env.scene.object_xy, env.scene.effector_xy])
        gaps = np.linalg.norm(points[:, None] - points[None], axis=-1)[np.triu_indices(len(points), 1)]
        assert gaps.min() >= cfg.min_separation


def test_success_is_geometric_and_terminates():
    env = ReachEnv()
    env.reset(seed=1)
    cfg = env.config
    target = env.scene.target_xy.copy()
    # place the effector just outside the success radius, then step onto the target
    env.scene.effector_xy = target + np.array([cfg.success_radius + 0.005, 0.0])
    _, reward, terminated, _, info = env.step(np.zeros(2, np.float32))
    assert not terminated and reward == 0.0 and not info["is_success"]
    _, reward, terminated, truncated, info = env.step(np.array([-0.01 / cfg.dt, 0.0], np.float32))
    assert terminated and not truncated and reward == 1.0 and info["is_success"]
    assert info["distance"] == pytest.approx(cfg.success_radius - 0.005)


def test_reaching_a_distractor_is_not_success():
    env = ReachEnv()
    env.reset(seed=2)
    distractor = next(i for i in range(env.config.num_objects) if i != env.scene.target_index)
    env.scene.effector_xy = env.scene.object_xy[distractor].copy()
    _, reward, terminated, _, info = env.step(np.zeros(2, np.float32))
    assert not terminated and reward == 0.0 and not info["is_success"]


def test_truncates_at_time_limit():
    env = gym.make(REACH_ID)
    env.reset(seed=0)
    limit = env.spec.max_episode_steps
    for step in range(1, limit + 1):
        _, _, terminated, truncated, _ = env.step(np.zeros(2, np.float32))
        assert not terminated
        assert truncated == (step == limit)


def test_actions_are_clipped_to_declared_limits_and_workspace():
    env = ReachEnv()
    env.reset(seed=4)
    cfg = env.config
    assert env.action_space.high.tolist() == pytest.approx([cfg.max_speed] * 2)
    start = env.scene.effector_xy.copy()
    env.step(np.array([10.0, -10.0], np.float32))
    np.testing.assert_allclose(env.scene.effector_xy - start, [cfg.max_speed * cfg.dt, -cfg.max_speed * cfg.dt])
    for _ in range(40):  # push into the corner: the effector stays on the table
        obs, *_ = env.step(np.array([cfg.max_speed, cfg.max_speed], np.float32))
    assert env.observation_space["state"].contains(obs["state"])
    np.testing.assert_allclose(obs["state"], [cfg.table_size, cfg.table_size])


@pytest.mark.parametrize("bad", [[np.nan, 0.0], [0.0, np.inf], [0.1, 0.1, 0.1]])
def test_bad_actions_raise(bad):
    env = ReachEnv()
    env.reset(seed=0)
    with pytest.raises(ValueError, match="action"):
        env.step(np.array(bad, np.float32))


def test_language_blind_policy_fails_most_episodes():
    """Going to the nearest object (ignoring the instruction) succeeds about one time in three."""
    env = ReachEnv()
    successes = 0
    for seed in range(100):
        env.reset(seed=seed)
        nearest = np.argmin(np.linalg.norm(env.scene.object_xy - env.scene.effector_xy, axis=-1))
        successes += int(nearest == env.scene.target_index)
    assert successes < 50


def either_episode(seed: int, command, env_id: str = REACH_EITHER_ID) -> dict:
    """One episode of `env_id` driven by `command(scene, config)` (m/s); its last info."""
    env = gym.make(env_id)
    env.reset(seed=seed)
    done = False
    while not done:
        _, _, terminated, truncated, info = env.step(command(env.unwrapped.scene, env.unwrapped.config))
        done = terminated or truncated
    return info


def test_either_scene_starts_as_far_from_both_discs_with_the_blocker_clear_of_both_paths():
    env = gym.make(REACH_EITHER_ID)
    cfg = env.unwrapped.config
    picked = set()
    for seed in range(40):
        env.reset(seed=seed)
        scene = env.unwrapped.scene
        a, b, blocker = scene.object_xy
        start = scene.effector_xy
        assert scene.object_colors[0] == scene.object_colors[1] == scene.target_color != scene.object_colors[2]
        assert env.unwrapped.task_description == f"reach a {scene.target_color} circle"
        assert np.linalg.norm(start - a) == pytest.approx(np.linalg.norm(start - b))
        for disc in (a, b):  # the straight path to either disc keeps the blocker at the clearance
            t = np.clip(np.dot(blocker - start, disc - start) / np.dot(disc - start, disc - start), 0, 1)
            assert np.linalg.norm(blocker - (start + t * (disc - start))) >= cfg.blocker_clearance
        picked.add(scene.target_index)
    assert picked == {0, 1}  # the expert's disc is drawn per seed


def test_either_succeeds_on_either_disc_and_fails_on_the_blocker():
    """The expert (heading for its own disc) and a policy heading for the other disc both succeed; the average of
    the two commands, what a sampler averaging the modes would drive, runs into the blocker every time."""
    from robots.expert import ReachExpert

    expert = ReachExpert()

    def towards(index):
        def command(scene, config):
            return expert.command(replace(scene, target_index=index), config)
        return command

    def average(scene, config):
        return (towards(0)(scene, config) + towards(1)(scene, config)) / 2

    for seed in range(20):
        for index in (0, 1):
            info = either_episode(seed, towards(index))
            assert info["is_success"] and not info["collided"]
        info = either_episode(seed, average)
        assert info["collided"] and not info["is_success"]


def test_either_reset_options_and_config_are_checked():
    env = gym.make(REACH_EITHER_ID)
    env.reset(seed=5)
    layout = env.unwrapped.scene.object_xy.copy()
    for copy in (0, 1):
        env.reset(seed=5, options={"target_copy": copy})
        assert env.unwrapped.scene.target_index == copy
        np.testing.assert_array_equal(env.unwrapped.scene.object_xy, layout)  # same scene, the other disc
    with pytest.raises(ValueError, match="target_copy=2"):
        env.reset(seed=5, options={"target_copy": 2})
    with pytest.raises(ValueError, match="unknown reset options"):
        env.reset(seed=5, options={"target": 1})
    with pytest.raises(ValueError, match="blocker=True needs target_copies=2"):
        ReachConfig(blocker=True)
    with pytest.raises(ValueError, match="target_copies=3"):
        ReachConfig(target_copies=3)


def test_timed_either_has_the_same_scenes_and_truncates_a_slow_reach_at_its_cycle_time():
    """The expert makes the cycle time on every scene; its path at 60% of its speed makes it on none."""
    from robots.expert import ReachExpert

    expert = ReachExpert()

    def slow(scene, config):
        return 0.6 * expert.command(scene, config)

    timed, plain = gym.make(REACH_EITHER_TIMED_ID), gym.make(REACH_EITHER_ID)
    for seed in range(30):
        obs, info = timed.reset(seed=seed)
        plain_obs, plain_info = plain.reset(seed=seed)
        np.testing.assert_array_equal(obs["image"], plain_obs["image"])
        assert plain_info["step_limit"] == plain.unwrapped.config.max_episode_steps
        assert 10 <= info["step_limit"] < plain_info["step_limit"]
        assert either_episode(seed, expert.command, REACH_EITHER_TIMED_ID)["is_success"]
        assert either_episode(seed, slow)["is_success"]
        info = either_episode(seed, slow, REACH_EITHER_TIMED_ID)
        assert not info["is_success"] and info["distance"] > timed.unwrapped.config.success_radius


def test_step_limit_is_the_factor_times_the_fastest_straight_path():
    config = ReachConfig(time_limit_factor=1.5)
    # The farther disc is 0.3 m right and 0.1 m up: x moves at 0.02 m a step, so the path covers 0.0211 m a step
    # and needs 14 steps to come within 3 cm (0.316 - 0.03 = 0.286 m); 1.5 x 14 = 21.
    start = np.array([0.1, 0.1])
    targets = np.array([[0.2, 0.15], [0.4, 0.2]])
    assert step_limit(config, start, targets) == 21
    assert step_limit(ReachConfig(), start, targets) == ReachConfig().max_episode_steps
    for bad in (0.5, 11.0):
        with pytest.raises(ValueError, match=f"time_limit_factor={bad}"):
            ReachConfig(time_limit_factor=bad)
