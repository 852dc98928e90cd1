"""`ServedModel`: the pipeline and what every part of the engine shares about it.

Ticks (`engine/tick.py`), warmup (`engine/warmup.py`), dynamics calls (`engine/dynamics.py`), the
reasoner (`engine/reasoning.py`) and admission all read the served embodiments, the cost model, the
budget and the cost keys from here, so each rule about them is written once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from policy_server.budget.cost_model import CALL_KINDS, FULL, PAIR, CostModel
from policy_server.budget.planner import MAX_CACHING, CacheSetting, PlannerConfig
from policy_server.budget.profile import ProfilePoint, QualityProfile, frontier
from policy_server.budget.tick import PREVIEW_STAGE, TickBudget
from policy_server.cache.controller import StepController
from policy_server.cache.sea_filter import SeaFilter
from policy_server.engine import api
from policy_server.engine.sessions import SessionState
from policy_server.limits import MAX_INSTRUCTION_TOKENS, MAX_REASON_CALLS
from policy_server.model.text_tokenizer import TextTokenizer
from policy_server.pipeline.compiled_stack import CompileUnavailableError, PrecompiledGenStack, compile_unavailable
from policy_server.pipeline.cuda_graphs import GraphedGenStack
from policy_server.pipeline.embodiments import Embodiment
from policy_server.pipeline.policy import FixedSteps, PolicyPipeline, PromptState
from policy_server.pipeline.tick_work import CompiledTickWork

# Ticks attend to their instruction's text K/V, so each call costs more with a longer instruction.
# Costs are learned per instruction-length group, and warmup fills each group at its longest.
INSTRUCTION_TOKEN_GROUPS = (32, MAX_INSTRUCTION_TOKENS)
GRID_SAMPLES = 8  # ticks at a smaller latent grid before they are planned at its own costs
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings:
    """Serving knobs. `cache_threshold` / `max_consecutive_cached` define the middle of the planner's ladder (the
    published Cosmos3 default 0.25 / 2). `max_batch`: the most queued ticks of one shape that run together as a
    micro-batch (1 = one tick at a time). `max_reason_calls`: reasoner calls at once; `max_dynamics_calls`: forward
    / inverse dynamics calls at once (0: none, and admission reserves nothing for them). `session_idle_s`: a session
    with no call for this long (s) is closed, so that a client that went away does not hold its place and its share
    of the worker. `quality_profile`: plan ticks on its frontier (`policy_server.budget.profile`); without one,
    `calibrate_at_warmup` measures a bounded one before the engine is ready, else ticks are planned on the ladder.
    `cuda_graphs`: on a CUDA device, replay the GEN stack from CUDA graphs captured at warmup and at each session's
    opening (`pipeline/cuda_graphs.py`). `compile_gen_stack`: run the GEN stack compiled, compiled at warmup (on CUDA
    `Cosmos3OmniTransformer.compiled_gen_stack`; on a CPU the whole stack by inductor, `pipeline/compiled_stack.py`,
    and the rest of a tick's model work, `pipeline/tick_work.py`); None: wherever torch can compile
    (`compile_unavailable`), eagerly with a warning elsewhere: on a CPU too, where the controller erred less on it
    at every budget of sessions 25-27's bench runs (README, Measured results)."""

    default_budget_ms: float = 120.0
    max_sessions: int = 4
    session_idle_s: float = 300.0
    diffusion_cache: bool = True
    cache_threshold: float = 0.25
    residual_order: int = 1
    max_consecutive_cached: int = 2
    warmup_ticks: int = 4
    max_reason_tokens: int = 256
    max_reason_calls: int = MAX_REASON_CALLS
    max_dynamics_calls: int = 0
    max_batch: int = 4
    quality_profile: QualityProfile | None = None
    calibrate_at_warmup: bool = False
    cuda_graphs: bool = True
    compile_gen_stack: bool | None = None


def user_text_ids(tokenizer: TextTokenizer, text: str, field: str) -> list[int]:
    """Token ids of a client's text (an instruction, a prompt); InvalidArgument when it holds a control token."""
    ids = tokenizer.tokenize(text)
    control = [i for i in ids if i in tokenizer.control_ids]
    if control:
        raise api.InvalidArgument(field, "text without the chat template's control tokens",
                                  f"{tokenizer.decode(control[:1], skip_special_tokens=False)!r} in the text",
                                  reason="BAD_VALUE")
    return ids


def instruction_tokens(tokenizer: TextTokenizer, text: str, field: str) -> int:
    """Token count of an instruction; InvalidArgument over the limit or with a control token."""
    count = len(user_text_ids(tokenizer, text, field))
    if count > MAX_INSTRUCTION_TOKENS:
        raise api.InvalidArgument(field, f"at most {MAX_INSTRUCTION_TOKENS} tokens", f"{count} tokens",
                                  reason="TOO_LONG")
    return count


def cache_ladder(threshold: float, cap: int) -> tuple[CacheSetting, ...]:
    """Least to most aggressive settings around (threshold > 0, cap; 0 = no cap); (0.25, 2) gives the planner's
    default ladder. With a cap of 1 its rung is the cap-1 rung of that threshold, so the ladder has one rung less."""
    looser_cap = 0 if cap == 0 else cap + 1  # no cap is the loosest already
    rungs = ((0.4 * threshold, 1), (threshold, 1), (threshold, cap), (2 * threshold, cap), (4 * threshold, looser_cap))
    return (*(CacheSetting(f"t{_threshold_name(t)}-c{c}", t, c) for t, c in dict.fromkeys(rungs)), MAX_CACHING)


def _threshold_name(threshold: float) -> str:
    """Two decimals where they say it exactly (0.10, 0.25), else four significant digits: 0.004 is not 0.00."""
    two_decimals = f"{threshold:.2f}"
    return two_decimals if float(two_decimals) == threshold else f"{threshold:.4g}"


class ServedModel:
    """One pipeline on one device, with its cost model and budget. `closing` is set when the engine shuts
    down: running work stops at its next step. `gen_stack` runs the GEN-stack calls of live work (`compiled` or not);
    `capturing_gen_stack` those of warm-up work, which may also capture CUDA graphs (`graphs`, None without) or
    compile a call pattern. `tick_work` and `capturing_tick_work`: the same for a tick's model work besides the stack
    (`pipeline/tick_work.py`: the prefill, and each sampler step's work around the stack; compiled on a CPU with the
    stack)."""

    def __init__(self, pipeline: PolicyPipeline, settings: EngineSettings, clock: Callable[[], float]):
        self.pipeline = pipeline
        self.settings = settings
        self.clock = clock
        self.cost_model = CostModel()
        planner = PlannerConfig(ladder=cache_ladder(settings.cache_threshold, settings.max_consecutive_cached))
        self.budget = TickBudget(self.cost_model, planner, clock=clock, post_stages=("decode", PREVIEW_STAGE),
                                 guided=pipeline.guided_steps)
        self.sea_filter = SeaFilter()  # its gain cache serves every tick
        cuda = pipeline.device.type == "cuda"
        wanted = settings.compile_gen_stack is not False
        unavailable = compile_unavailable(pipeline.device) if wanted else None
        if unavailable and settings.compile_gen_stack:
            raise CompileUnavailableError(f"the GEN stack cannot run compiled: {unavailable}")
        if unavailable:
            logger.warning("the GEN stack runs eagerly, slower: %s", unavailable)
        self.compiled = wanted and unavailable is None
        transformer = pipeline.transformer
        self.tick_work = self.capturing_tick_work = pipeline.tick_work
        if not self.compiled:
            stack = live_stack = transformer.gen_stack
        elif cuda:  # shape-generic around attention; the graphs below remove the launches
            stack = live_stack = transformer.compiled_gen_stack()
        else:  # one graph per call; a pattern warmup never ran runs eagerly rather than compiling live
            live_stack = PrecompiledGenStack(transformer)
            stack = live_stack.compile
            self.tick_work = CompiledTickWork(transformer)  # likewise: graphs made at warmup, eager elsewhere
            self.capturing_tick_work = self.tick_work.compiling()
        self.graphs = GraphedGenStack(stack) if settings.cuda_graphs and cuda else None
        self.gen_stack = live_stack if self.graphs is None else self.graphs
        self.capturing_gen_stack = stack if self.graphs is None else self.graphs.capture
        self.embodiments = {name: pipeline.embodiments.get(name) for name in pipeline.served_embodiments}
        canvas_h, canvas_w = pipeline.config.canvas_hw
        m = pipeline.vae.spatial_compression
        self.full_grid = (canvas_h // m, canvas_w // m)  # the largest latent grid: what admission plans for
        self.closing = threading.Event()
        self._frontiers: dict[str, tuple[ProfilePoint, ...]] = {}
        self.profile = settings.quality_profile  # warmup may measure one

    @property
    def profile(self) -> QualityProfile | None:
        return self._profile

    @profile.setter
    def profile(self, profile: QualityProfile | None) -> None:
        if profile is not None and profile.digest != self.pipeline.digest:
            raise ValueError(f"the quality profile was measured on weights {profile.digest[:19]}, these are "
                             f"{self.pipeline.digest[:19]}")
        self._profile = profile
        self._frontiers = {} if profile is None else {name: frontier(points)
                                                      for name, points in profile.embodiments.items()}

    def frontier(self, embodiment: str) -> tuple[ProfilePoint, ...] | None:
        """The quality profile's frontier that ticks of `embodiment` are planned on; None: the ladder."""
        return self._frontiers.get(embodiment) if self.budget_controlled else None

    @property
    def num_steps(self) -> int:
        return self.pipeline.config.num_steps

    @property
    def passes(self) -> int:
        """CFG passes per step: 2 with guidance, else 1."""
        return 2 if self.pipeline.config.guidance != 1.0 else 1

    @property
    def budget_controlled(self) -> bool:
        """Whether ticks are planned and guarded: the cache is on and the step count leaves steps between
        the always-full first and last ones (with 1 or 2 steps nothing can be skipped)."""
        return self.settings.diffusion_cache and self.num_steps > 2

    def cost_key(self, embodiment: str, chunk: int, instruction_tokens: int) -> tuple[int, bool, int]:
        """What a tick's costs depend on: the video's latent frames, whether a state row comes with the actions,
        and the instruction-length group. Embodiments alike in these share costs."""
        group = next(bound for bound in INSTRUCTION_TOKEN_GROUPS if instruction_tokens <= bound)
        return self.pipeline.num_latent_frames(chunk), self.embodiments[embodiment].state_dim > 0, group

    def grid_keys(self, key: tuple, grid: tuple[int, int], unused: set[str]) -> tuple[tuple, tuple]:
        """`(the key a tick's costs teach, the key it is planned with)` for frames making latent `grid` under the
        full-grid cost key `key`, for a tick that skips the `unused` stages. A smaller grid has costs of its own;
        until its calls have been seen `GRID_SAMPLES` times, and every stage the tick runs at least once, the
        tick is planned at the full grid's, the most it can cost."""
        if grid == self.full_grid:
            return key, key
        grid_key = (*key, grid)
        seen = self.cost_model.samples(grid_key)
        stages = set(self.cost_model.samples(key)) - set(CALL_KINDS) - unused
        known = max(seen[FULL], seen[PAIR]) >= GRID_SAMPLES and stages <= set(seen)
        return grid_key, grid_key if known else key

    def instruction_tokens(self, text: str, field: str) -> int:
        return instruction_tokens(self.pipeline.tokenizer, text, field)

    def prompt_fits(self, prompt: PromptState | None, instruction: str, embodiment: Embodiment, chunk: int,
                    canvas_hw: tuple[int, int]) -> bool:
        """Whether `prompt` holds the text K/V of `instruction` for clips of `chunk` on `canvas_hw`."""
        key = self.pipeline.prompt_key(instruction, embodiment, chunk, self.passes == 2, canvas_hw)
        return prompt is not None and prompt.key == key

    def prompt(self, instruction: str, embodiment: Embodiment, chunk: int, canvas_hw: tuple[int, int],
               reuse: PromptState | None) -> tuple[PromptState, float]:
        """The text K/V of `instruction` for frames on `canvas_hw`: `reuse` when it fits, else prefilled now.
        Returns them and the ms spent."""
        if self.prompt_fits(reuse, instruction, embodiment, chunk, canvas_hw):
            return reuse, 0.0
        started = self.clock()
        prompt = self.pipeline.encode_prompt(instruction, embodiment, chunk, self.passes == 2, canvas_hw,
                                             self.tick_work)
        return prompt, self.clock() - started

    def fixed_steps(self, num_steps: int, cache: StepController | None = None,
                    batch_branches: bool = True) -> FixedSteps:
        """The step control of a call without a deadline at the served guidance (`PolicyPipeline.fixed_steps`)."""
        return self.pipeline.fixed_steps(num_steps, self.pipeline.config.guidance, cache, batch_branches)

    @staticmethod
    def check_epoch(session: SessionState, epoch: int) -> None:
        """StaleEpoch unless the caller's `epoch` is the session's (a reset starts a new one)."""
        if epoch != session.epoch:
            raise api.StaleEpoch(session.session_id, session.epoch, epoch)
