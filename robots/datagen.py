"""Generate scripted-expert demonstrations.

    python -m robots.datagen --episodes 400 --out runs/data/reach-400
    python -m robots.datagen --episodes 400 --out runs/data/reach-400-lerobot --format lerobot

``--format safetensors`` (the default) writes ``dataset.json`` and a safetensors file per episode
(``robots.dataset``); ``--format lerobot`` writes the LeRobot v3 layout (``robots.lerobot_dataset``),
parquet rows and an H.264 video, about 18 times smaller. Training reads either.

Episode i is rolled out from seed ``seed_offset + i // targets_per_scene``, so a dataset is reproducible
from its arguments alone. Keep the seeds below ``robots.envs.HELDOUT_SEED_OFFSET``: seeds from there on
are reserved for evaluation.

With ``--targets-per-scene K`` every scene is demonstrated K times, once per target object (the first K
objects of the scene). The same first frame then comes with different instructions and different
actions, which is what teaches a policy to read the instruction instead of guessing the target from
the scene alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

import gymnasium as gym
import numpy as np
from tqdm import tqdm

from robots.dataset import METADATA_FILE, Episode, array_stats, save_episode, write_metadata
from robots.envs import DOMAIN_ID, EMBODIMENT, ENV_IDS, HELDOUT_SEED_OFFSET, REACH_ID
from robots.expert import ReachExpert
from robots.lerobot_dataset import INFO_PATH, LeRobotWriter

FORMATS = ("safetensors", "lerobot")


def collect_episode(env: gym.Env, expert: ReachExpert, seed: int, target: int | None = None) -> Episode:
    """Roll out ``expert`` in ``env`` from ``seed`` until success or the time limit. ``target``: index of
    the object to reach in the scene, or with several discs of the named colour, which of them (default: the
    one the seed picks)."""
    obs, info = env.reset(seed=seed)
    if target is not None and env.unwrapped.config.target_copies > 1:
        obs, info = env.reset(seed=seed, options={"target_copy": target})  # same scene, this disc
    elif target is not None:
        color = env.unwrapped.scene.object_colors[target]
        obs, info = env.reset(seed=seed, options={"target_color": color})  # same scene, this target
    frames, states, actions = [obs["image"]], [obs["state"]], []
    instruction = env.unwrapped.task_description
    done = False
    while not done:
        action = expert(env)
        obs, _, terminated, truncated, info = env.step(action)
        frames.append(obs["image"])
        states.append(obs["state"])
        actions.append(action)
        done = terminated or truncated
    return Episode(
        frames=np.stack(frames),
        states=np.stack(states).astype(np.float32),
        actions=np.stack(actions).astype(np.float32),
        hold_action=np.zeros(env.action_space.shape, np.float32),  # zero velocity: the effector stays where it ended
        instruction=instruction,
        seed=seed,
        target_color=info["target_color"],
        success=bool(info["is_success"]),
    )


def generate(
    out_dir: str | Path,
    episodes: int,
    env_id: str = REACH_ID,
    seed_offset: int = 0,
    overwrite: bool = False,
    progress: bool = True,
    targets_per_scene: int = 1,
    format: str = "safetensors",
) -> dict:
    """Write ``episodes`` demonstrations to ``out_dir`` in ``format`` (one of ``FORMATS``); return the
    metadata (dataset.json, or meta/datagen.json plus the episode entries for LeRobot)."""
    if format not in FORMATS:
        raise ValueError(f"format={format!r}; expected one of {', '.join(FORMATS)}")
    if episodes < 1:
        raise ValueError(f"episodes={episodes}; expected at least 1")
    env = gym.make(env_id)
    config = env.unwrapped.config
    targets = config.target_copies if config.target_copies > 1 else config.num_objects
    if not 1 <= targets_per_scene <= targets:
        raise ValueError(f"targets_per_scene={targets_per_scene}; expected 1 to {targets} "
                         f"({'discs of the named colour' if config.target_copies > 1 else 'objects'} per scene)")
    scenes = -(-episodes // targets_per_scene)
    if seed_offset < 0 or seed_offset + scenes > HELDOUT_SEED_OFFSET:
        raise ValueError(
            f"seeds {seed_offset}..{seed_offset + scenes - 1} overlap the held-out evaluation seeds "
            f"(>= {HELDOUT_SEED_OFFSET}); expected 0 <= seed_offset and "
            f"seed_offset + episodes / targets_per_scene <= {HELDOUT_SEED_OFFSET}"
        )
    out = Path(out_dir)
    if ((out / METADATA_FILE).exists() or (out / INFO_PATH).exists()) and not overwrite:
        raise FileExistsError(f"{out} already holds a dataset; pass overwrite=True (--overwrite) to replace it")
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("episode_*.safetensors"), out / METADATA_FILE]:
        stale.unlink(missing_ok=True)
    if (out / INFO_PATH).exists():  # overwriting a LeRobot dataset
        for folder in ("meta", "data", "videos"):
            shutil.rmtree(out / folder)

    base = env.unwrapped
    writer = LeRobotWriter(out, config.control_hz, config.image_size, EMBODIMENT) if format == "lerobot" else None
    expert = ReachExpert()
    entries, all_actions, all_states = [], [], []
    bar = tqdm(range(episodes), desc=f"demos -> {out}", unit="ep", disable=not progress)
    for index in bar:
        seed = seed_offset + index // targets_per_scene
        target = None if targets_per_scene == 1 else index % targets_per_scene
        episode = collect_episode(env, expert, seed, target)
        entries.append(writer.add(episode) if writer else save_episode(out, index, episode))
        all_actions.append(episode.actions)
        all_states.append(episode.states)
        successes = sum(e["success"] for e in entries)
        bar.set_postfix(success=f"{successes / len(entries):.1%}", steps=episode.num_steps, refresh=False)
    env.close()

    metadata = {
        "env_id": env_id,
        "env_config": dataclasses.asdict(config),
        "embodiment": EMBODIMENT,
        "domain_id": DOMAIN_ID,
        "fps": config.control_hz,
        "image": {"height": config.image_size, "width": config.image_size, "channels": "RGB"},
        "action": {
            "meaning": "effector velocity (vx, vy)",
            "units": "m/s",
            "low": base.action_space.low.tolist(),
            "high": base.action_space.high.tolist(),
            "stats": array_stats(np.concatenate(all_actions)),
        },
        "state": {
            "meaning": "effector position (x, y)",
            "units": "m",
            "stats": array_stats(np.concatenate(all_states)),
        },
        "seed_offset": seed_offset,
        "num_episodes": episodes,
        "targets_per_scene": targets_per_scene,
        "success_rate": sum(e["success"] for e in entries) / episodes,
    }
    if writer:
        writer.finish(metadata)
    else:
        write_metadata(out, {**metadata, "episodes": entries})
    return {**metadata, "episodes": entries}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, required=True, help="number of demonstrations")
    parser.add_argument("--out", required=True, help="output directory, created with its parents (e.g. runs/data/NAME)")
    parser.add_argument("--env-id", default=REACH_ID, choices=ENV_IDS,
                        help=f"gymnasium id (default {REACH_ID})")
    parser.add_argument("--seed-offset", type=int, default=0, help="seed of episode 0 (default 0)")
    parser.add_argument("--targets-per-scene", type=int, default=1,
                        help="demonstrate each scene once per target object, up to the objects per scene; "
                             "with several discs of the named colour, once per disc (1)")
    parser.add_argument("--format", choices=FORMATS, default="safetensors",
                        help="safetensors: dataset.json + a file per episode (default); lerobot: LeRobot v3 layout")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing dataset in --out")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    if not args.out:
        parser.error("--out: expected a directory path")
    try:
        metadata = generate(
            args.out,
            args.episodes,
            env_id=args.env_id,
            seed_offset=args.seed_offset,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            targets_per_scene=args.targets_per_scene,
            format=args.format,
        )
    except ValueError as error:  # bad arguments: one line, not a traceback
        parser.error(str(error))
    except OSError as error:  # --out exists, or cannot be made
        parser.error(f"--out {args.out}: {error.strerror or error}")
    lengths = [e["num_steps"] for e in metadata["episodes"]]
    print(
        f"wrote {metadata['num_episodes']} episodes to {args.out}: success {metadata['success_rate']:.1%}, "
        f"steps mean {np.mean(lengths):.1f} max {max(lengths)}"
    )


if __name__ == "__main__":
    main()
