"""Robot side of policy-server: simulated tasks, scripted experts, data generation, training, rollouts.

Importing the package registers the built-in gymnasium environments (``PolicyServer/Reach-v0``, ...).
"""

import robots.envs  # noqa: F401  (registers the gymnasium ids)
