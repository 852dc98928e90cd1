"""Built-in simulated tasks, registered with gymnasium on import.

``import robots.envs`` makes ``gymnasium.make("PolicyServer/Reach-v0")`` available.
"""

import gymnasium

from robots.envs.reach import (
    COLORS,
    DOMAIN_ID,
    EMBODIMENT,
    HELDOUT_SEED_OFFSET,
    ReachConfig,
    ReachEnv,
    ReachScene,
)

REACH_ID = "PolicyServer/Reach-v0"
REACH_HARD_ID = "PolicyServer/ReachHard-v0"
REACH_EITHER_ID = "PolicyServer/ReachEither-v0"
REACH_EITHER_TIMED_ID = "PolicyServer/ReachEitherTimed-v0"

_REGISTRATIONS = {
    # Three discs drawn from four colours: a language-blind policy succeeds about one time in three.
    REACH_ID: {},
    # All four colours on the table: a language-blind policy succeeds about one time in four.
    REACH_HARD_ID: {"num_objects": 4},
    # Two discs of the named colour, either of which succeeds, and a third disc between them whose touch fails.
    # The demonstrations head for either, so a sampler that averages the two modes runs into the third disc:
    # meant to tell samplers apart (the shipped weights are fine-tuned on it; robots/README.md).
    REACH_EITHER_ID: {"target_copies": 2, "blocker": True, "instruction_template": "reach a {color} circle"},
    # The same scenes with a cycle time of 1.25 times the fastest straight path (the scripted expert needs at most
    # one step more than that path): a sampler that reaches the right disc slowly fails too.
    REACH_EITHER_TIMED_ID: {"target_copies": 2, "blocker": True, "instruction_template": "reach a {color} circle",
                            "time_limit_factor": 1.25},
}

ENV_IDS = tuple(_REGISTRATIONS)  # every task registered here

for _env_id, _kwargs in _REGISTRATIONS.items():
    if _env_id not in gymnasium.registry:
        gymnasium.register(
            id=_env_id,
            entry_point="robots.envs.reach:ReachEnv",
            max_episode_steps=ReachConfig().max_episode_steps,
            kwargs=_kwargs,
        )

__all__ = [
    "COLORS",
    "DOMAIN_ID",
    "EMBODIMENT",
    "ENV_IDS",
    "HELDOUT_SEED_OFFSET",
    "REACH_EITHER_ID",
    "REACH_EITHER_TIMED_ID",
    "REACH_HARD_ID",
    "REACH_ID",
    "ReachConfig",
    "ReachEnv",
    "ReachScene",
]
