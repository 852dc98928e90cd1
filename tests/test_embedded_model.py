"""The embedded model shipped in the package: size, layout, and one real tick on the built-in task."""

from pathlib import Path

import gymnasium
import numpy as np

import robots.envs  # noqa: F401  (registers the environments)
from policy_server.pipeline.policy import PolicyPipeline, PolicyRequest, default_model_path
from robots.envs.reach import HELDOUT_SEED_OFFSET


def test_shipped_folder_is_small_and_complete():
    root = default_model_path()
    total = sum(f.stat().st_size for f in Path(root).rglob("*") if f.is_file())
    assert total <= 25 * 2**20
    for name in ("model_index.json", "policy.json", "embodiments.json", "action_stats.json"):
        assert (root / name).is_file()
    for folder in ("transformer", "vae"):
        assert (root / folder / "config.json").is_file()
        assert (root / folder / "diffusion_pytorch_model.safetensors").is_file()
    assert (root / "text_tokenizer" / "tokenizer.json").is_file()


def test_default_pipeline_answers_a_reach_observation():
    pipe = PolicyPipeline.from_pretrained(None)
    assert pipe.served_embodiments == ["pusht"]
    env = gymnasium.make("PolicyServer/Reach-v0")
    obs, _ = env.reset(seed=HELDOUT_SEED_OFFSET)
    out = pipe(PolicyRequest(images={"image": obs["image"]}, instruction=env.unwrapped.task_description,
                             embodiment="pusht", state=obs["state"], num_steps=4))
    assert out.actions.shape == (8, 2)
    assert np.all(np.isfinite(out.actions))


def test_shipped_policy_heads_for_the_disc_the_instruction_names():
    """Held-out scenes, each asked for every disc in turn: the first actions point at the named disc."""
    pipe = PolicyPipeline.from_pretrained(None)
    env = gymnasium.make("PolicyServer/Reach-v0")
    cosines = []
    for index in range(4):
        env.reset(seed=HELDOUT_SEED_OFFSET + index)
        for color in env.unwrapped.scene.object_colors:
            obs, info = env.reset(seed=HELDOUT_SEED_OFFSET + index, options={"target_color": color})
            out = pipe(PolicyRequest(images={"image": obs["image"]}, instruction=env.unwrapped.task_description,
                                     embodiment="pusht", state=obs["state"], num_steps=10, seed=index))
            heading, to_target = out.actions[:4].mean(0), info["target_xy"] - obs["state"]
            cosines.append(heading @ to_target / (np.linalg.norm(heading) * np.linalg.norm(to_target)))
    assert np.median(cosines) > 0.95 and min(cosines) > 0.5, np.round(cosines, 2)


def test_shipped_policy_heads_for_one_of_two_discs_not_between_them():
    """Held-out ReachEither start frames (two discs of the named colour, the blocker between them): the first
    actions point at one disc or the other, and over seeds at both."""
    pipe = PolicyPipeline.from_pretrained(None)
    env = gymnasium.make("PolicyServer/ReachEither-v0")
    cosines, picked = [], set()
    for index in range(6):
        obs, _ = env.reset(seed=HELDOUT_SEED_OFFSET + index)
        discs = env.unwrapped.scene.target_copies_xy() - obs["state"]
        discs /= np.linalg.norm(discs, axis=1, keepdims=True)
        for seed in range(2):
            out = pipe(PolicyRequest(images={"image": obs["image"]}, instruction=env.unwrapped.task_description,
                                     embodiment="pusht", state=obs["state"], num_steps=10, seed=seed))
            heading = out.actions[:4].mean(0)
            aims = discs @ heading / np.linalg.norm(heading)
            cosines.append(aims.max())
            picked.add((index, int(aims.argmax())))
    assert np.median(cosines) > 0.9, np.round(cosines, 2)
    assert {disc for _, disc in picked} == {0, 1}
