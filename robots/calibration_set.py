"""The embedded model's calibration set: expert observations of a built-in task, in the calibration format.

    python -m robots.calibration_set [--count 96] [--env-id PolicyServer/ReachEither-v0]
        [--out policy_server/assets/calibration/reach_either.safetensors]

Observations come every `--stride` control steps along expert episodes on seeds of their own (neither the
demonstrations' nor the bench's held-out ones), so the set spans the start, the approach and the arrival. The
shipped set is ReachEither's: its start frames, where the demonstrations have two modes, are where the sampler's
quality shows most, and its later frames look like Reach's. `policy-server calibrate` uses the file by default
(`policy_server.engine.calibration.DEFAULT_OBSERVATIONS`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from policy_server.engine.calibration import DEFAULT_OBSERVATIONS, Observation, save_observations
from robots.envs import EMBODIMENT, ENV_IDS, HELDOUT_SEED_OFFSET, REACH_EITHER_ID
from robots.expert import expert_observations

CALIBRATION_SEED_OFFSET = HELDOUT_SEED_OFFSET + 500_000


def collect(count: int, stride: int, env_id: str = REACH_EITHER_ID) -> list[Observation]:
    return [Observation(EMBODIMENT, {"image": obs["image"]}, obs["state"], obs["instruction"])
            for obs in expert_observations(count, CALIBRATION_SEED_OFFSET, stride, env_id)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=96, help="observations (96)")
    parser.add_argument("--stride", type=int, default=4, help="control steps between two observations (4)")
    parser.add_argument("--env-id", default=REACH_EITHER_ID, choices=ENV_IDS,
                        help=f"the task (default {REACH_EITHER_ID})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OBSERVATIONS,
                        help=f"observations file to write (default: the shipped set, {DEFAULT_OBSERVATIONS})")
    args = parser.parse_args(argv)
    save_observations(args.out, collect(args.count, args.stride, args.env_id))
    print(f"wrote {args.count} observations to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
