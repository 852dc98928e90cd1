"""The engine: sessions, one model worker, deadlines and warmup.

`engine.api` (the transport's contract) imports no torch; `build_engine` loads the model lazily so
that the server and client packages stay importable without it.
"""

from __future__ import annotations

import logging


def build_engine(config):
    """A `ModelEngine` for the CLI's `ServerConfig`, its model loaded; `start()` warms it up in the background."""
    import torch

    from policy_server.engine.calibration import resolve_profile
    from policy_server.engine.engine import ModelEngine, resolve_device, resolve_dtype, settings_from_config
    from policy_server.pipeline.policy import PolicyPipeline

    device = resolve_device(config.device, setting="device")
    # One intra-op thread on every device. On a CPU the embedded model's matrices are too small to
    # split. On CUDA torch's CPU work is each caller's frame preparation, on its own gRPC thread, and
    # with OpenMP every calling thread gets a team the size of the pool: several callers would
    # oversubscribe the cores that the worker needs to launch kernels on time.
    torch.set_num_threads(1)
    pipeline = PolicyPipeline.from_pretrained(config.checkpoint, device=device,
                                              dtype=resolve_dtype(config.dtype, device))
    for embodiment in pipeline.untrained_embodiments:
        # Served anyway: checking a robot's wiring (cameras, state, rate, limits) before any training is a use.
        logging.getLogger(__name__).warning(
            "embodiment %r is served on domain row %d, which these weights were never trained on (policy.json: "
            "trained_domain_ids %s): its actions come from untrained projections. Train it: python -m "
            "robots.train_policy --data <its demonstrations> --embodiment %s --out <folder>", embodiment.name,
            embodiment.domain_id, list(pipeline.config.trained_domain_ids), embodiment.name)
    profile, calibrate = resolve_profile(config.quality_profile, pipeline.folder, pipeline.digest,
                                         pipeline.served_embodiments, pipeline.config, config.ladder_settings_given())
    return ModelEngine(pipeline, settings_from_config(config, profile, calibrate))
