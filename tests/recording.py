"""Test-owned views of what an engine's pipeline computed: the latest tick's output, and a stalled GEN stack."""

from __future__ import annotations

import contextlib
import time

from policy_server.pipeline.policy import PolicyOutput, PolicyPipeline, TickSteps


class RecordingPipeline(PolicyPipeline):
    """The pipeline it is made from (same weights), keeping the output of the latest tick it ran."""

    last_output: PolicyOutput | None = None

    @classmethod
    def of(cls, pipeline: PolicyPipeline) -> RecordingPipeline:
        return cls(pipeline.transformer, pipeline.vae, pipeline.tokenizer, pipeline.embodiments, pipeline.config,
                   pipeline.served_embodiments, pipeline.digest)

    def steps(self, *args, **kwargs) -> TickSteps:
        self.last_output = yield from super().steps(*args, **kwargs)
        return self.last_output


@contextlib.contextmanager
def slow_full_calls(pipeline: PolicyPipeline, delay_ms: float):
    """Every full GEN-stack call `delay_ms` slower while inside (`norm_moe_gen` ends each one)."""
    handle = pipeline.transformer.norm_moe_gen.register_forward_pre_hook(lambda *_: time.sleep(delay_ms / 1e3))
    try:
        yield
    finally:
        handle.remove()
