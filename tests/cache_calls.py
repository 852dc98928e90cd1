"""One GEN-stack call through a step cache, for tests that run the stack themselves (as `FixedSteps` and
the engine's tick do it: `estimate`, else `full()` handed to `ran`)."""

from __future__ import annotations


def run_stack(cache, step, branch, sigma, noisy_vision, gen_in, full):
    """The call's output `[N_gen, D]`: the cache's estimate, or `full()`."""
    out = cache.estimate(step, branch, sigma, noisy_vision, gen_in)
    if out is None:
        out = full()
        cache.ran(branch, out)
    return out
