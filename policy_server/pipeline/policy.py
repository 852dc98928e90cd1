"""`PolicyPipeline`: camera frames + instruction (+ state) -> action chunk and predicted video latents.

One call is one control tick: encode the conditioning frame with the VAE, reuse (or prefill) the
text K/V of each CFG branch, then run the flow-matching sampler. The caller's one say in the step loop
is a `StepControl` (the engine's tick; `FixedSteps` without a deadline): before each step it names the
CFG branches and whether the step is the last, and for each call it runs the GEN stack or has the step
cache estimate it. Each step embeds the generated rows once (they are the same in every branch; only their
rotary positions differ), asks the step control about each branch's call, runs the calls that must run as
one batched GEN stack (cond and uncond each against their own text K/V), decodes velocities with the heads,
masks clean rows, combines CFG and advances the fp32 sampler state. Actions leave in the embodiment's
physical units.

Modes (Cosmos3 `build_sequence_plan_from_mode`):
    policy            first latent frame clean; future frames and the action chunk generated;
    forward_dynamics  first latent frame and all actions clean; future frames generated;
    inverse_dynamics  every latent frame clean; the action chunk generated.
"""

from __future__ import annotations

import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
import torch

from policy_server.cache.controller import CacheRecord, NoCache, StepController
from policy_server.limits import MAX_FRAME_SIDE
from policy_server.model import Cosmos3OmniTransformer, GenInput, UndKV, load_transformer
from policy_server.model.boundary import PaddedGenLayouts
from policy_server.model.checkpoint import CheckpointError, weights_digest
from policy_server.model.config import ConfigError as ModelConfigError
from policy_server.model.gen_layout import GenLayout
from policy_server.model.text_tokenizer import TextTokenizer, TextTokenizerError
from policy_server.model.vae import SmallVideoVAE, VideoTokenizer
from policy_server.pipeline import diffusers_folder
from policy_server.pipeline.conditioning import (
    CanvasPlacement,
    closest_canvas,
    crop_latent_padding,
    prepare_clip,
    side_by_side,
)
from policy_server.pipeline.embodiments import Embodiment, EmbodimentConfigError, EmbodimentRegistry
from policy_server.pipeline.errors import (
    EmptyInstruction,
    InvalidActions,
    InvalidImage,
    InvalidMode,
    InvalidNoise,
    InvalidSamplerSettings,
)
from policy_server.pipeline.hub import CheckpointNotFound, checkpoint_folder, is_hub_id
from policy_server.pipeline.normalization import FeatureNormalizers, NormalizationStatsError
from policy_server.pipeline.packing import ActionLayout, RequestShape, pack_request, request_shape
from policy_server.pipeline.policy_config import PolicyConfig, PolicyConfigError, unguided
from policy_server.pipeline.prompts import PromptPair, action_prompt_pair
from policy_server.pipeline.schedulers import make_sampler
from policy_server.pipeline.tick_work import TickWork
from policy_server.pipeline.wan_vae import WanVideoVAE
from policy_server.specs import frame_sizes_outside, width_beside

MODES = ("policy", "forward_dynamics", "inverse_dynamics")
BRANCHES = ("cond", "uncond")
# GEN layouts kept, the most recently used. A request's shape has its text length, which the client picks (any
# instruction up to 128 tokens), and each layout holds its rotary tables [N_gen, head_dim] on the device: kept all,
# a server running for days would hold one for every text length and chunk it was ever sent. This is room for the
# cond and uncond branch of as many sessions as a server takes (64).
MAX_LAYOUT_SHAPES = 128


class StepControl(Protocol):
    """The caller's one say in the step loop: the engine's `Tick` (plan, deadline guard, SeaCache) or
    `FixedSteps` (a step cache alone). `batch_branches`: the calls of a step that run go as one batch
    (else one by one, in branch order)."""

    batch_branches: bool

    def before_step(self, step: int) -> tuple[tuple[str, ...], bool]:
        """Before sampler step `step`: the CFG branches to run, in call order, and whether it is the last step.
        Raises `Aborted` to abandon the tick."""

    def estimate(self, step: int, branch: str, sigma: float, noisy_vision: list[torch.Tensor],
                 gen_in: torch.Tensor) -> torch.Tensor | None:
        """The GEN stack output `[N_gen, D]` of one call estimated by the step cache, or None when the call
        runs; its output then goes to `ran`. Every branch of a step is asked before any of its calls runs."""

    def ran(self, outs: Mapping[str, torch.Tensor]) -> None:
        """The GEN stack outputs `[N_gen, D]` by branch of the calls of one step that ran together."""

    def record(self) -> CacheRecord:
        """What the step cache decided in this tick."""


class FixedSteps:
    """Step control without a deadline: the uncond pass on every step of `guided`, `cache` (default `NoCache`)
    deciding each GEN-stack call, a step's calls batched unless `batch_branches` is False."""

    def __init__(self, num_steps: int, guided: range, cache: StepController | None = None,
                 batch_branches: bool = True):
        self.guided = guided
        self.cache = cache or NoCache()
        self.batch_branches = batch_branches
        self.cache.begin(num_steps)

    def before_step(self, step: int) -> tuple[tuple[str, ...], bool]:
        return (BRANCHES if step in self.guided else BRANCHES[:1]), False

    def estimate(self, step, branch, sigma, noisy_vision, gen_in) -> torch.Tensor | None:
        return self.cache.estimate(step, branch, sigma, noisy_vision, gen_in)

    def ran(self, outs: Mapping[str, torch.Tensor]) -> None:
        for branch, out in outs.items():
            self.cache.ran(branch, out)

    def record(self) -> CacheRecord:
        return self.cache.record()


@dataclass(frozen=True)
class StackCall:
    """The full GEN-stack calls of one step the step loop waits on, as one input: send back
    `gen_stack(gen, und_kv)`, `[N_gen, D]` for one call, `[B, N_gen, D]` for B. `calls` holds them apart
    (`(GenInput [N_gen, D], UndKV)` each), for a driver that batches them with other ticks' calls; it then
    sends back their rows of its output, `[B, N_gen, D]` (`[N_gen, D]` for one)."""

    gen: GenInput
    und_kv: UndKV
    calls: tuple[tuple[GenInput, UndKV], ...]


# `PolicyPipeline.steps`: yields None before each sampler step (send back None) and a `StackCall` for the
# full GEN-stack calls of a step (send back their output); returns the tick's `PolicyOutput`.
TickSteps = Generator["StackCall | None", "torch.Tensor | None", "PolicyOutput"]
Condition = tuple[torch.Tensor, tuple[int, int]]  # a request's conditioning latents [C, T_clean, h, w], canvas (h, w)


class CanvasClip(NamedTuple):
    """A request's conditioning frames on their canvas (`PolicyPipeline.prepare_frames`)."""

    clip: torch.Tensor  # VAE-ready, [1, 3, T, canvas_h, canvas_w], float32 in [-1, 1] (bicubic overshoot kept)
    placement: CanvasPlacement


def stepwise(steps: TickSteps, gen_stack: Callable[[GenInput, UndKV], torch.Tensor]):
    """`steps` with its full calls run in place through `gen_stack`: a generator that yields at each sampler-step
    boundary (where its driver may hand the thread to other work) and returns the `PolicyOutput`."""
    sent = None
    try:
        while True:
            try:
                call = steps.send(sent)
            except StopIteration as done:
                return done.value
            if call is None:
                yield
                sent = None
            else:
                sent = gen_stack(call.gen, call.und_kv)
    finally:
        steps.close()  # closed early: the tick ends here, on this thread, not whenever it is collected


def run_steps(steps: TickSteps, gen_stack: Callable[[GenInput, UndKV], torch.Tensor],
              stop: Callable[[], bool] | None = None) -> PolicyOutput:
    """Run `steps` to the end on this thread, each full call through `gen_stack`; `Aborted` at the first step
    boundary where `stop()` is True."""
    pieces = stepwise(steps, gen_stack)
    with torch.no_grad():
        while True:
            try:
                next(pieces)
            except StopIteration as done:
                return done.value
            if stop is not None and stop():
                pieces.close()
                raise Aborted("stopped between two sampler steps")


class Aborted(RuntimeError):
    """The step control abandoned the tick between two denoising steps."""


@dataclass
class PolicyRequest:
    """One tick's inputs.

    images: camera name -> uint8 RGB [H, W, 3]; the embodiment's cameras, concatenated left to right, each one
        shorter than the tallest scaled to its height (`side_by_side`).
    state: float32 [state_dim] in physical units, or None when the embodiment takes no state.
    actions: forward_dynamics only: float32 [K, raw_action_dim] in physical units.
    history_actions: optional float32 [H, raw_action_dim], the actions executed just before this tick
        (most recent last), given to the model as clean rows before the chunk.
    committed_actions: policy only, optional float32 [d, raw_action_dim], 1 <= d < chunk, physical units: the actions
        the robot executes from the observed step on while this tick runs. They are the chunk's first d actions,
        and the rest of the chunk is sampled to continue them (inpainting: every step sets those rows back to
        the committed actions at the step's noise level).
    video: inverse_dynamics only: camera name -> uint8 RGB [K + 1, H, W, 3] frames, the embodiment's cameras, put
        side by side frame by frame as `images` are.
    noise: the initial noise, like diffusers' `latents` / `action_latents`; None draws it from `seed` in
        diffusers' order (vision, then actions).
    """

    images: Mapping[str, np.ndarray]
    instruction: str
    embodiment: str
    state: np.ndarray | None = None
    mode: str = "policy"
    chunk_size: int | None = None
    num_steps: int | None = None
    guidance: float | None = None
    seed: int = 0
    actions: np.ndarray | None = None
    history_actions: np.ndarray | None = None
    committed_actions: np.ndarray | None = None
    video: Mapping[str, np.ndarray] | None = None
    noise: InitialNoise | None = None


@dataclass(frozen=True)
class InitialNoise:
    """The sampler's starting point, float32. Where a row is conditioning (a clean latent frame, given or
    prefix actions) the conditioning replaces it; channels past the embodiment's raw width start at zero.

    vision: [C, T_lat, h, w], the video latents (T_lat = `PolicyPipeline.num_latent_frames(chunk)`; h, w the
        latent grid of the frames' content, `prepare_frames(...).placement.latent_content_hw(vae.spatial_compression)`).
    actions: [chunk, action_dim], the chunk's action rows.
    """

    vision: torch.Tensor
    actions: torch.Tensor


@dataclass(frozen=True)
class StepRecord:
    """What one denoising step did: the CFG `branches` it ran, of which `full` ran their GEN stack (one batch
    when `batched`), and its wall time `ms` (embedding, stacks or estimates, heads, CFG, sampler update)."""

    index: int
    sigma: float
    timestep: float
    branches: tuple[str, ...]
    full: tuple[str, ...]
    batched: bool
    ms: float


@dataclass
class PolicyOutput:
    actions: np.ndarray  # float32 [K, raw_action_dim], physical units
    latents: torch.Tensor  # generated video latents [C, T, H, W] (normalised latent space)
    steps: list[StepRecord]
    timings_ms: dict[str, float]  # encode, prefill, denoise, decode, total
    cache: CacheRecord


@dataclass
class PromptState:
    """Text K/V of each CFG branch for one (instruction, embodiment, clip geometry); reusable across ticks.
    `batch_kv`: with both branches, their K/V as one batch (`UndKV.stack_padded`, cond first)."""

    key: tuple
    input_ids: dict[str, list[int]]
    und_kv: dict[str, UndKV]
    batch_kv: UndKV | None = None


@dataclass
class DenoiseState:
    """One tick's sampler state (fp32; the transformer runs in its own dtype) and the conditioning it keeps.

    sample: the video latents and the action-stream rows as one flat tensor, which the sampler steps whole (its
    arithmetic is elementwise, and one set of its kernels costs about half of two); vision [C, T_lat, h, w] and
    actions [H + S + K, action_dim] (history, state, chunk) are views of it. Latent frames `clean_frames` and
    action rows `action_layout.clean_rows` are conditioning: the heads give them zero velocity and every step
    restores them, as it keeps the padding action channels (from the embodiment's raw action dim on) at zero.
    Committed chunk rows (`PolicyRequest.committed_actions`) stay noisy to the model, and every step sets them to
    their committed value at its noise level: `given_at(sigma)`.
    """

    sample: torch.Tensor
    vision_shape: torch.Size
    action_shape: torch.Size
    clean_frames: list[int]
    action_layout: ActionLayout  # its `clean_rows`: the clean action rows
    given: torch.Tensor  # like `sample`, bool: the clean frames and rows, the committed rows, the padding channels
    clean: torch.Tensor  # like `sample`: the given values there (zero on the padding channels)
    given_noise: torch.Tensor | None = None  # like `sample`: the committed rows' initial noise, `clean` elsewhere

    @classmethod
    def start(cls, vision: torch.Tensor, actions: torch.Tensor, clean_frames: list[int], clean_actions: torch.Tensor,
              raw_action_dim: int, action_layout: ActionLayout, committed_rows: range = range(0)) -> DenoiseState:
        """The state at the first step: `vision` and `actions` already hold the given values where they are clean,
        and the noise where they are committed (`committed_rows` of `actions`, whose values `clean_actions` holds)."""
        given_vision = torch.zeros(vision.shape, dtype=torch.bool, device=vision.device)
        given_vision[:, clean_frames] = True
        given_actions = torch.zeros(actions.shape, dtype=torch.bool, device=actions.device)
        given_actions[[*action_layout.clean_rows, *committed_rows]] = True
        given_actions[:, raw_action_dim:] = True
        clean = torch.cat((vision.flatten(), clean_actions.flatten()))
        given_noise = None
        if committed_rows:
            noise = clean_actions.clone()
            noise[committed_rows, :raw_action_dim] = actions[committed_rows, :raw_action_dim]
            given_noise = torch.cat((vision.flatten(), noise.flatten()))
        return cls(torch.cat((vision.flatten(), actions.flatten())), vision.shape, actions.shape, clean_frames,
                   action_layout, torch.cat((given_vision.flatten(), given_actions.flatten())), clean, given_noise)

    @property
    def vision(self) -> torch.Tensor:
        return self.sample[: self.vision_shape.numel()].view(self.vision_shape)

    @property
    def actions(self) -> torch.Tensor:
        return self.sample[self.vision_shape.numel():].view(self.action_shape)

    @property
    def noisy_vision(self) -> bool:
        return len(self.clean_frames) < self.vision_shape[1]

    def given_at(self, sigma: float) -> torch.Tensor:
        """What `given` marks, at noise level `sigma`: the conditioning as given, the committed rows noised as flow
        matching noises them, `(1 - sigma) * a + sigma * noise`."""
        return self.clean if self.given_noise is None else torch.lerp(self.clean, self.given_noise, sigma)

    def advance(self, sample: torch.Tensor, sigma: float) -> None:
        """Take the sampler's next state, at noise level `sigma`, with what is given set back (`given_at`). (A
        compiled step sets it back in its graph and sets `sample` itself: `tick_work.CompiledTickWork.advance`.)"""
        self.sample = torch.where(self.given, self.given_at(sigma), sample)


@dataclass(frozen=True)
class Branch:
    """One CFG branch of a tick: the GEN layout of its shape and its text K/V."""

    name: str
    layout: GenLayout
    und_kv: UndKV


@dataclass(frozen=True)
class BranchBatch:
    """A tick's cond and uncond branch as one GEN-stack batch: their layouts and text K/V, padded and stacked."""

    layouts: PaddedGenLayouts
    und_kv: UndKV


class PolicyPipeline:
    """The Cosmos3 policy: transformer + video VAE + text tokenizer + embodiments + sampler defaults.

    `embodiments` is the full Cosmos3 registry extended by the checkpoint's file; `served_embodiments`
    names the entries that file declares, the ones the server offers. `digest` identifies the weights; `folder`
    is where they were loaded from (None: built in memory)."""

    def __init__(
        self,
        transformer: Cosmos3OmniTransformer,
        vae: VideoTokenizer,
        tokenizer: TextTokenizer,
        embodiments: EmbodimentRegistry,
        config: PolicyConfig,
        served_embodiments: list[str],
        digest: str = "",
        folder: Path | None = None,
    ):
        self.transformer = transformer.eval()
        self.tick_work = TickWork(self.transformer)
        self.vae = vae.eval()
        self.tokenizer = tokenizer
        self.embodiments = embodiments
        self.config = config
        self.served_embodiments = served_embodiments  # what this checkpoint was trained for
        self.digest = digest
        self.folder = folder
        # GEN layouts by request shape: ticks of the same shape share one object, which is what lets
        # the engine run their GEN stacks as one batch (`GenInput.stack`); and by the shapes of a cond and
        # uncond branch, their layouts as one batch.
        self._gen_layouts: OrderedDict[RequestShape, GenLayout] = OrderedDict()  # at most MAX_LAYOUT_SHAPES
        self._branch_layouts: dict[tuple[RequestShape, RequestShape], PaddedGenLayouts] = {}
        self._normalizers: dict[str, FeatureNormalizers] = {}
        # The negative prompt's text K/V by its tokens: it names no instruction, so every prompt of a clip length
        # shares it, and a new instruction prefills only its own branch.
        self._negative_kv: dict[tuple[int, ...], UndKV] = {}
        # Each step's time embedding by sampler schedule: a schedule's timesteps are the same every tick.
        self._time_embeddings: dict[tuple[float, ...], list[torch.Tensor]] = {}

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, device: str = "cpu",
                        dtype: torch.dtype | None = None) -> PolicyPipeline:
        """Load a checkpoint folder or Hugging Face Hub id (`org/name[@revision]`, `pipeline.hub`); None loads the
        embedded model shipped in the package.

        Two layouts: a diffusers `Cosmos3OmniPipeline` folder exactly as `save_pretrained` writes it
        (`policy_server.pipeline.diffusers_folder`), or the embedded model's (`transformer/`, `vae/`,
        `text_tokenizer/`, `policy.json`, `embodiments.json`). `dtype`: the weights' dtype (None keeps the
        transformer's stored one, and a diffusers folder's Wan VAE loads in fp32 as diffusers loads it); the time
        embedder and the sampler state stay fp32. A folder that cannot be served raises
        `CheckpointLoadError`, whose message names the file and what was expected."""
        try:
            root = checkpoint_folder(path) if path is not None else default_model_path()
            if not root.is_dir():
                raise CheckpointError(f"{root} is not a directory")
            index = diffusers_folder.read_model_index(root)
            if index is not None:
                # A Hub snapshot's folder is named after its commit: such a model is named after its Hub id. A folder
                # given as `.` or `sub/..` is named after the folder it is, not '' or '..'.
                name = str(path) if path is not None and is_hub_id(path) else Path(os.path.abspath(root)).name
                pipeline = cls._from_diffusers_folder(root, index, name, device, dtype)
            else:
                pipeline = cls._from_policy_folder(root, device, dtype)
            pipeline._check_parts_fit(root)
            for name in pipeline.served_embodiments:  # stats files are read now, not at the first tick
                pipeline.normalizers(pipeline.embodiments.get(name))
        except _LOAD_ERRORS as error:
            raise CheckpointLoadError(f"cannot serve checkpoint {path or root}: {error}") from error
        return pipeline

    def _check_parts_fit(self, root: Path) -> None:
        """The tokenizer's ids fit the transformer's embedding, the served embodiments its action rows and their
        declared camera sizes the frames the server takes, and the canvases the VAE's latent grid."""
        rows = self.transformer.config.vocab_size
        if self.tokenizer.id_bound > rows:  # an id past the embedding's rows fails the first tick (CUDA: the device)
            raise CheckpointError(f"{root / 'text_tokenizer'}: the tokenizer emits ids up to "
                                  f"{self.tokenizer.id_bound - 1}; expected ids below the transformer's "
                                  f"vocab_size={rows} ({root / 'transformer' / 'config.json'})")
        width = self.transformer.config.action_dim  # an action row holds an action or the state
        served = [self.embodiments.get(name) for name in self.served_embodiments]
        if too_wide := [e.name for e in served if max(e.raw_action_dim, e.state_dim) > width]:
            raise CheckpointError(f"{root / self.config.embodiments_file}: {too_wide} have more action or state "
                                  f"channels than the transformer's action_dim={width}")
        step = self.vae.spatial_compression
        for embodiment in served:  # advertised, so they must be sizes the server takes (min_side is the VAE's)
            if embodiment.camera_sizes and (problem := frame_sizes_outside(embodiment.camera_sizes, step)):
                raise CheckpointError(f"{root / self.config.embodiments_file}: {embodiment.name}'s camera_sizes: "
                                      f"{problem}")
        if bad := [list(hw) for hw in self.config.canvases if hw[0] % step or hw[1] % step]:
            raise CheckpointError(f"{root / 'policy.json'}: canvases {bad}; expected sides that are multiples of "
                                  f"the VAE's spatial compression, {step} px")
        cameras = max(len(embodiment.cameras) for embodiment in served)
        if wide := [list(hw) for hw in self.config.canvases if hw[1] > cameras * MAX_FRAME_SIDE]:
            raise CheckpointError(f"{root / 'policy.json'}: canvases {wide}; expected widths of at most "
                                  f"{cameras * MAX_FRAME_SIDE} px, the {cameras} camera(s) of a served embodiment "
                                  f"side by side at {MAX_FRAME_SIDE} px each (a wider canvas is all padding there)")

    @classmethod
    def _from_policy_folder(cls, root: Path, device: str, dtype: torch.dtype | None) -> PolicyPipeline:
        if not (root / "model_index.json").is_file() and not (root / "policy.json").is_file():
            raise CheckpointError(f"{root}: no model_index.json; expected a Cosmos3OmniPipeline folder as diffusers' "
                                  "save_pretrained writes it (or the embedded model's layout, with a policy.json)")
        config = PolicyConfig.load(root / "policy.json")
        embodiments = EmbodimentRegistry.cosmos3()
        served = embodiments.load_config(root / config.embodiments_file)
        return cls(
            transformer=load_transformer(root / "transformer", device=device, dtype=dtype),
            vae=SmallVideoVAE.from_pretrained(root / "vae").to(device, dtype),
            tokenizer=TextTokenizer.from_dir(root / "text_tokenizer"),
            embodiments=embodiments,
            config=config,
            served_embodiments=served,
            digest=weights_digest(root),
            folder=root,
        )

    @classmethod
    def _from_diffusers_folder(cls, root: Path, index: dict, name: str, device: str,
                               dtype: torch.dtype | None) -> PolicyPipeline:
        flags = diffusers_folder.model_index_flags(root, index)
        config = diffusers_folder.policy_config(root, name, flags)
        transformer = load_transformer(root / "transformer", device=device, dtype=dtype)
        if not transformer.config.action_gen:
            raise CheckpointError(f"{root / 'transformer' / 'config.json'}: action_gen=false; "
                                  "a policy needs the action head (action_gen=true)")
        embodiments = EmbodimentRegistry.cosmos3()
        served = diffusers_folder.served_embodiments(root, embodiments, transformer.config.action_dim,
                                                     config.embodiments_file)
        return cls(
            transformer=transformer,
            vae=WanVideoVAE.from_pretrained(root / "vae", device, dtype),
            tokenizer=TextTokenizer.from_dir(root / "text_tokenizer"),
            embodiments=embodiments,
            config=config,
            served_embodiments=served,
            digest=weights_digest(root),
            folder=root,
        )

    @property
    def untrained_embodiments(self) -> list[Embodiment]:
        """Served embodiments whose domain row `policy.json`'s `trained_domain_ids` does not list: their actions come
        from projections no training touched (none when the folder does not record its trained domains)."""
        trained = self.config.trained_domain_ids
        if trained is None:
            return []
        served = (self.embodiments.get(name) for name in self.served_embodiments)
        return [embodiment for embodiment in served if embodiment.domain_id not in trained]

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    def normalizers(self, embodiment: Embodiment) -> FeatureNormalizers:
        """The embodiment's action/state normalisers, loaded from its stats file once."""
        if embodiment.name not in self._normalizers:
            self._normalizers[embodiment.name] = embodiment.load_normalizers()
        return self._normalizers[embodiment.name]

    # ------------------------------------------------------------------------------------ prompt

    def encode_prompt(self, instruction: str, embodiment: Embodiment, chunk_size: int, cfg: bool,
                      canvas_hw: tuple[int, int], work: TickWork | None = None) -> PromptState:
        """Tokenize the action caption (and negative prompt) and prefill the text K/V of each branch (the negative
        prompt's once per clip length) through `work` (default: eagerly)."""
        work = work or self.tick_work
        pair = policy_prompt_pair(self.config, instruction, embodiment.viewpoint, embodiment.fps, chunk_size,
                                  canvas_hw)
        texts = {"cond": pair.cond, "uncond": pair.uncond}
        input_ids, und_kv = {}, {}
        for branch in BRANCHES if cfg else BRANCHES[:1]:
            ids = self.tokenizer.encode(texts[branch], system_prompt=pair.system_prompt)
            input_ids[branch] = ids
            if branch == "uncond" and tuple(ids) in self._negative_kv:
                und_kv[branch] = self._negative_kv[tuple(ids)]
                continue
            ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
            positions = torch.arange(len(ids), dtype=torch.float32, device=self.device).repeat(3, 1)
            with torch.no_grad():
                und_kv[branch] = work.prefill(ids_t, positions)
            if branch == "uncond":
                self._negative_kv[tuple(ids)] = und_kv[branch]
        batch_kv = UndKV.stack_padded([und_kv[branch] for branch in BRANCHES]) if cfg else None
        return PromptState(self.prompt_key(instruction, embodiment, chunk_size, cfg, canvas_hw), input_ids, und_kv,
                           batch_kv)

    def prompt_for(self, request: PolicyRequest, canvas_hw: tuple[int, int], work: TickWork | None = None
                   ) -> PromptState:
        """`encode_prompt` of a valid `request`'s instruction, embodiment, chunk size and guidance, for frames on
        `canvas_hw` (`encode_condition`'s)."""
        return self.encode_prompt(request.instruction, self.embodiments.get(request.embodiment), self._chunk(request),
                                  self._guidance(request) != 1.0, canvas_hw, work)

    @staticmethod
    def prompt_key(instruction: str, embodiment: Embodiment, chunk_size: int, cfg: bool,
                   canvas_hw: tuple[int, int]) -> tuple:
        return (instruction, embodiment.name, chunk_size, cfg, canvas_hw)

    # ------------------------------------------------------------------------------------ tick

    def __call__(self, request: PolicyRequest, prompt: PromptState | None = None,
                 cache: StepController | None = None) -> PolicyOutput:
        """Check `request` (a `PolicyInputError` names what is wrong), then run one tick without a deadline: the
        uncond pass wherever the guidance interval allows it, `cache` (default `NoCache`) deciding each
        GEN-stack call. `prompt`: reusable text K/V (see `run`)."""
        self.validate(request)
        return self.run(request, prompt, self.fixed_steps(self._num_steps(request), self._guidance(request), cache))

    def run(self, request: PolicyRequest, prompt: PromptState | None, control: StepControl) -> PolicyOutput:
        """`steps(...)` run to the end on this thread, each full GEN-stack call through the transformer."""
        return run_steps(self.steps(request, prompt, control), self.transformer.gen_stack)

    def steps(self, request: PolicyRequest, prompt: PromptState | None, control: StepControl,
              work: TickWork | None = None, frames: CanvasClip | None = None,
              condition: Condition | None = None) -> TickSteps:
        """One tick of a valid `request` under `control`, the one say the caller has in the step loop (the
        engine builds its requests from what the transport validated), as a generator (`TickSteps`): whoever
        drives it runs the full GEN-stack calls, alone or batched with other ticks', and may stop between
        sampler steps. The driver disables grad (`run_steps`, the engine's worker thread): a grad-mode context
        held across the yields would be restored out of order by interleaved ticks, or on another thread when
        an abandoned tick is collected. `prompt`: the session's text K/V (prefilled here when missing or
        stale). `work`: how the tick prefills, and each step embeds and decodes around the GEN stack (default:
        eagerly). `frames`: the request's `prepare_frames`, and `condition`: their `encode_condition`, when the
        caller has them (made here if not)."""
        work = work or self.tick_work
        t_start = time.perf_counter()
        embodiment = self.embodiments.get(request.embodiment)
        chunk = self._chunk(request)
        steps, guidance = self._num_steps(request), self._guidance(request)
        cfg = guidance != 1.0
        timings: dict[str, float] = {}

        clock = time.perf_counter()
        clean_latent, canvas_hw = condition or self.encode_condition(frames or self.prepare_frames(request))
        timings["encode"] = _ms_since(clock)

        clock = time.perf_counter()
        key = self.prompt_key(request.instruction, embodiment, chunk, cfg, canvas_hw)
        if prompt is None or prompt.key != key:
            prompt = self.prompt_for(request, canvas_hw, work)
        timings["prefill"] = _ms_since(clock)

        clock = time.perf_counter()
        state = self._initial_state(request, embodiment, chunk, clean_latent)
        branches = self._branches(prompt, state, embodiment.fps)
        batch = self._branch_batch(branches, prompt) if len(branches) == 2 else None
        steps_done = yield from self._sample(state, branches, batch, steps, guidance, control, work)
        timings["denoise"] = _ms_since(clock)

        clock = time.perf_counter()
        action_rows = state.actions[-chunk:, : embodiment.raw_action_dim].double().cpu().numpy()
        physical = self.normalizers(embodiment).action.denormalize(action_rows).astype(np.float32)
        if request.committed_actions is not None:  # exactly as sent, not through the normalisation's round trip
            physical[: len(request.committed_actions)] = request.committed_actions
        timings["decode"] = _ms_since(clock)
        timings["total"] = _ms_since(t_start)
        return PolicyOutput(physical, state.vision, steps_done, timings, control.record())

    def fixed_steps(self, num_steps: int, guidance: float, cache: StepController | None = None,
                    batch_branches: bool = True) -> FixedSteps:
        """The step control of a tick without a deadline: the uncond pass on the guided steps when `guidance`
        is on, `cache` (default `NoCache`) deciding each call, a step's calls batched unless `batch_branches`
        is False."""
        return FixedSteps(num_steps, self.guided_steps(num_steps) if guidance != 1.0 else range(0), cache,
                          batch_branches)

    def guided_steps(self, num_steps: int) -> range:
        """The sampler steps of a `num_steps` tick on which the uncond pass runs when guidance is on
        (`PolicyConfig.guided_steps`)."""
        return self.config.guided_steps(num_steps)

    def num_latent_frames(self, chunk: int) -> int:
        """Latent frames of the video a chunk of `chunk` actions lives in. The chunk spans `chunk + 1` frames;
        the VAE keeps frame 0 and encodes whole groups of `tc` after it, dropping the rest (diffusers' rule)."""
        return chunk // self.vae.temporal_compression + 1

    def num_video_frames(self, chunk: int) -> int:
        """Pixel frames the VAE encodes and decodes for a chunk of `chunk` actions: `tc * (T_lat - 1) + 1`."""
        return self.vae.temporal_compression * (self.num_latent_frames(chunk) - 1) + 1

    def canvas_for(self, embodiment: Embodiment, images: Mapping[str, np.ndarray]) -> tuple[int, int]:
        """The canvas (h, w) a tick's camera frames go on: their side-by-side size (`side_by_side`) floored to the
        VAE's multiple, binned by aspect ratio (what the tick's prompt caption names)."""
        return closest_canvas(*self._floored_hw(embodiment, images), self.config.canvases)

    def _floored_hw(self, embodiment: Embodiment, images: Mapping[str, np.ndarray]) -> tuple[int, int]:
        sizes = [images[camera].shape[:2] for camera in embodiment.cameras]
        height = max(h for h, _ in sizes)
        width = sum(width_beside(h, w, height) for h, w in sizes)
        m = self.vae.spatial_compression
        return height - height % m, width - width % m

    def decode_video(self, latents: torch.Tensor) -> np.ndarray:
        """Predicted frames: latents [C, T_lat, h, w] -> uint8 RGB [num_video_frames, h * 16, w * 16, 3]."""
        with torch.no_grad():
            video = self.vae.decode(latents.unsqueeze(0).to(self.device, self._vae_dtype))[0].float()
        frames = ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return frames.permute(1, 2, 3, 0).cpu().numpy()

    @property
    def _vae_dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype

    # ------------------------------------------------------------------------------------ parts

    def validate(self, request: PolicyRequest) -> None:
        """Raise the `PolicyInputError` that names what is wrong with `request`, if anything is."""
        if request.mode not in MODES:
            raise InvalidMode(request.mode, MODES)
        embodiment = self.embodiments.get(request.embodiment)
        if request.mode != "inverse_dynamics" and not request.instruction.strip():
            raise EmptyInstruction(request.mode)
        chunk = embodiment.check_chunk_size(self._chunk(request))
        steps = self._num_steps(request)
        if not isinstance(steps, int) or not 1 <= steps <= 1000:
            raise InvalidSamplerSettings("num_steps", f"num_steps={steps!r}; expected an integer in [1, 1000]")
        guidance = self._guidance(request)
        if not math.isfinite(guidance) or guidance < 1.0:
            raise InvalidSamplerSettings("guidance", f"guidance={guidance!r}; expected a finite value >= 1")
        if guidance != 1.0 and not self.guided_steps(steps):  # asked for, guidance would silently never run
            default = self.config.num_steps
            raise InvalidSamplerSettings("num_steps", f"num_steps={steps} with guidance={guidance:g}: "
                                         f"{unguided(self.config, steps)}; expected a num_steps whose timesteps the "
                                         f"interval holds (the checkpoint's {default} has "
                                         f"{len(self.guided_steps(default))} guided), or guidance=1 (no CFG)")
        self._validate_images(request, embodiment)
        embodiment.check_state(request.state)
        if request.history_actions is not None:
            embodiment.check_actions(request.history_actions, field="history_actions")
        if request.mode == "forward_dynamics":
            actions = embodiment.check_actions(request.actions)
            if actions.shape[0] != chunk:
                raise InvalidActions(f"got {actions.shape[0]} actions; expected chunk_size={chunk}")
        if request.committed_actions is not None:
            if request.mode != "policy":
                raise InvalidActions(f"given in mode {request.mode!r}; expected only in mode 'policy'",
                                     field="committed_actions")
            committed = embodiment.check_actions(request.committed_actions, field="committed_actions")
            if committed.shape[0] >= chunk:
                raise InvalidActions(f"got {committed.shape[0]} actions; expected fewer than chunk_size={chunk}",
                                     field="committed_actions")

    def _chunk(self, request: PolicyRequest) -> int:
        """The request's chunk size, the embodiment's default where it gives none."""
        embodiment = self.embodiments.get(request.embodiment)
        return embodiment.default_chunk_size if request.chunk_size is None else request.chunk_size

    def _num_steps(self, request: PolicyRequest) -> int:
        return request.num_steps or self.config.num_steps

    def _guidance(self, request: PolicyRequest) -> float:
        return self.config.guidance if request.guidance is None else float(request.guidance)

    def _validate_images(self, request: PolicyRequest, embodiment: Embodiment) -> None:
        m = self.vae.spatial_compression  # frames are floored to multiples of it, so they need at least that
        video = request.mode == "inverse_dynamics"
        frames = request.video if video else request.images
        what, shape = ("video", "[K + 1, H >= {m}, W >= {m}, 3]") if video else ("image", "[H >= {m}, W >= {m}, 3]")
        if not isinstance(frames, Mapping) or sorted(frames) != sorted(embodiment.cameras):
            got = sorted(frames) if isinstance(frames, Mapping) else type(frames).__name__
            raise InvalidImage(f"cameras {got}; expected exactly {list(embodiment.cameras)}", field=f"{what}s")
        for name in embodiment.cameras:
            array = frames[name]
            if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 3 + video \
                    or array.shape[-1] != 3 or min(array.shape[-3:-1]) < m or (video and len(array) < 1):
                got = f"{getattr(array, 'dtype', type(array).__name__)} {getattr(array, 'shape', '')}"
                raise InvalidImage(f"{what} {name!r} is {got}; expected uint8 RGB {shape.format(m=m)}",
                                   field=f"{what}s[{name}]")
        if video and len({len(frames[name]) for name in embodiment.cameras}) > 1:
            lengths = {name: len(frames[name]) for name in embodiment.cameras}
            raise InvalidImage(f"videos of {lengths} frames; expected one length", field="videos")

    def prepare_frames(self, request: PolicyRequest) -> CanvasClip:
        """A valid `request`'s conditioning frames put on their canvas: its camera images (`prepare_images`), or
        an inverse_dynamics request's cameras' videos side by side frame by frame, extended with the last frame where
        they are shorter than the chunk's."""
        if request.mode == "inverse_dynamics":
            cameras = [request.video[c] for c in self.embodiments.get(request.embodiment).cameras]
            return self._on_canvas(side_by_side(cameras), self.num_video_frames(self._chunk(request)))
        return self.prepare_images(request.embodiment, request.images)

    def prepare_images(self, embodiment: str, images: Mapping[str, np.ndarray]) -> CanvasClip:
        """Valid camera images of `embodiment`, side by side (`side_by_side`: one shorter than the tallest scaled to
        its height), put on their canvas, on the CPU. No model runs, so the engine does this on the caller's thread:
        frames of any allowed size then cost the model worker, which every session shares, only the VAE encode of
        the canvas."""
        cams = [images[c][None] for c in self.embodiments.get(embodiment).cameras]
        # The VAE is causal in time: latent frame 0 depends on pixel frame 0 only, so the clean conditioning
        # latent needs just that frame.
        return self._on_canvas(side_by_side(cams), 1)

    def _on_canvas(self, frames: np.ndarray, num_frames: int) -> CanvasClip:
        return CanvasClip(*prepare_clip(frames, num_frames, self.config.canvases, self.vae.spatial_compression,
                                        self.config.pad_mode))

    def encode_condition(self, frames: CanvasClip) -> Condition:
        """VAE latents of `prepare_frames`' clip, padding cropped: [C, T_clean, h, w], and the canvas (h, w)."""
        clip, placement = frames
        latents = self.vae.encode(clip.to(self.device, self._vae_dtype))
        latents = crop_latent_padding(latents, placement, self.vae.spatial_compression)
        return latents[0].float(), placement.canvas_hw

    # ------------------------------------------------------------------------------------ denoising

    def _initial_state(self, request: PolicyRequest, embodiment: Embodiment, chunk: int,
                       clean_latent: torch.Tensor) -> DenoiseState:
        """The sampler's start: noise on the generated rows, the request's conditioning on the clean ones."""
        num_latent_frames = self.num_latent_frames(chunk)
        channels, _, height, width = clean_latent.shape
        noise_v, noise_a = self._initial_noise(request, (channels, num_latent_frames, height, width),
                                               (chunk, self.transformer.config.action_dim))
        clean_frames = list(range(num_latent_frames)) if request.mode == "inverse_dynamics" else [0]
        vision = noise_v.to(self.device, copy=True)  # the clean frames are written in; the caller's noise stays
        vision[:, : clean_latent.shape[1]] = clean_latent[:, :num_latent_frames]
        actions, clean_actions, layout = self._action_rows(request, embodiment, chunk, noise_a)
        committed = 0 if request.committed_actions is None else len(request.committed_actions)
        return DenoiseState.start(vision, actions, clean_frames, clean_actions, embodiment.raw_action_dim, layout,
                                  committed_rows=range(layout.num_prefix, layout.num_prefix + committed))

    def _action_rows(self, request: PolicyRequest, embodiment: Embodiment, chunk: int,
                     noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, ActionLayout]:
        """Action-stream rows `[history (H) | state (0 or 1) | chunk (K)]`, everything before the chunk clean
        (and the chunk too in forward_dynamics): the initial rows and the clean values (the committed actions' too),
        both [H + S + K, action_dim], and their layout. `noise`: [K, action_dim]."""
        normalizers = self.normalizers(embodiment)
        history = [] if request.history_actions is None else list(np.asarray(request.history_actions, np.float64))
        has_state = embodiment.state_dim > 0
        num_prefix = len(history) + (1 if has_state else 0)
        action_dim = self.transformer.config.action_dim
        rows = num_prefix + chunk
        clean_actions = torch.zeros((rows, action_dim), device=self.device)
        if history:
            past = normalizers.action.normalize(np.stack(history))
            clean_actions[: len(history), : embodiment.raw_action_dim] = torch.from_numpy(past).float()
        if has_state:
            state = normalizers.state.normalize(np.asarray(request.state, dtype=np.float64))
            clean_actions[num_prefix - 1, : len(state)] = torch.from_numpy(state).float()
        if request.committed_actions is not None:
            committed = normalizers.action.normalize(np.asarray(request.committed_actions, dtype=np.float64))
            clean_actions[num_prefix: num_prefix + len(committed), : embodiment.raw_action_dim] = \
                torch.from_numpy(committed).float()
        clean_rows = list(range(num_prefix))
        if request.mode == "forward_dynamics":
            given = normalizers.action.normalize(np.asarray(request.actions, dtype=np.float64))
            clean_actions[num_prefix:, : embodiment.raw_action_dim] = torch.from_numpy(given).float()
            clean_rows.extend(range(num_prefix, rows))
        mask = torch.zeros((rows, 1), device=self.device)
        mask[clean_rows] = 1.0
        noise_rows = torch.cat([torch.zeros((num_prefix, action_dim)), noise]).to(self.device)
        actions = mask * clean_actions + (1 - mask) * noise_rows
        actions[:, embodiment.raw_action_dim:] = 0
        return actions, clean_actions, ActionLayout(chunk, num_prefix, tuple(clean_rows), embodiment.domain_id)

    def _branches(self, prompt: PromptState, state: DenoiseState, fps: float) -> dict[str, Branch]:
        """Each CFG branch the prompt holds, with the GEN layout of its shape."""
        return {name: Branch(name, self._gen_layout(ids, state, fps), prompt.und_kv[name])
                for name, ids in prompt.input_ids.items()}

    def _gen_layout(self, input_ids: list[int], state: DenoiseState, fps: float) -> GenLayout:
        """The one layout of the request's shape, built (from the packed request) at the first tick of that shape:
        ticks that share it can run their GEN stacks as one batch (`GenLayout.key`, `GenInput.stack`)."""
        args = (input_ids, tuple(state.vision.shape), state.clean_frames, fps, state.action_layout)
        key = request_shape(*args)
        layout = self._gen_layouts.get(key)
        if layout is not None:
            self._gen_layouts.move_to_end(key)
            return layout
        packed = pack_request(self.transformer.config, *args, device=self.device)
        dtype = self.transformer.dtype
        layout = self._gen_layouts[key] = self.transformer.gen_layout(
            key=key, **packed.model_kwargs(state.vision.to(dtype), state.actions.to(dtype), timestep=0.0))
        if len(self._gen_layouts) > MAX_LAYOUT_SHAPES:
            evicted, _ = self._gen_layouts.popitem(last=False)
            # A pair batches only the very layout objects it was built from (`GenInput.stack_varied`).
            self._branch_layouts = {pair: batch for pair, batch in self._branch_layouts.items() if evicted not in pair}
        return layout

    def _branch_batch(self, branches: dict[str, Branch], prompt: PromptState) -> BranchBatch:
        """The cond and uncond branch as one batch; their layouts are built once per pair of shapes. The shapes
        differ only in text length, so both branches have the same generated rows (one embedding serves both)."""
        cond, uncond = branches["cond"].layout.key, branches["uncond"].layout.key
        assert replace(cond, und_len=0) == replace(uncond, und_len=0), "branches differ only in their text"
        key = (cond, uncond)
        if key not in self._branch_layouts:
            self._branch_layouts[key] = PaddedGenLayouts.build([branches[name].layout for name in BRANCHES])
        return BranchBatch(self._branch_layouts[key], prompt.batch_kv)

    def _sampler(self, num_steps: int):
        return make_sampler(self.config.sampler, num_steps, self.config.shift, solver_order=self.config.solver_order,
                            karras=self.config.karras)

    def _sample(self, state: DenoiseState, branches: dict[str, Branch], batch: BranchBatch | None, steps: int,
                guidance: float, control: StepControl, work: TickWork
                ) -> Generator[StackCall | None, torch.Tensor | None, list[StepRecord]]:
        """The flow-matching step loop: advances `state` in place and returns what each step did. `control`
        names each step's CFG branches; a step it makes the last jumps straight to the clean estimate."""
        sampler = self._sampler(steps)
        time_embeddings = self._step_time_embeddings(sampler.timesteps)
        # Both branches' layouts have the same generated rows: the cond one lays out what the tick work reads. It
        # holds the request's indexes and the time embedding its timestep: only the latents are new each step.
        layout = branches["cond"].layout
        if state.given_noise is not None:  # committed rows at the first step's noise level
            state.advance(state.sample, sampler.sigmas[0])
        records: list[StepRecord] = []
        for i in range(steps):
            yield None  # a step boundary: the driver may run other work, or stop the tick, here
            run_branches, last = control.before_step(i)
            clock = time.perf_counter()
            sigma = sampler.sigmas[i]
            timestep = float(sampler.timesteps[i])
            if i == 0:  # later steps' rows come embedded from the step before (`TickWork.advance`)
                hidden = work.embed(layout, state.sample, time_embeddings[0])
            gens = {name: GenInput(hidden, branches[name].layout) for name in run_branches}
            noisy_vision = [state.vision] if state.noisy_vision else []
            stack_out, full = {}, []
            for name in run_branches:
                estimate = control.estimate(i, name, sigma, noisy_vision, hidden)
                if estimate is None:
                    full.append(name)
                else:
                    stack_out[name] = estimate
            batched = control.batch_branches and len(full) == 2
            for group in [full] if batched else [[name] for name in full]:
                out = yield self._stack_call(group, gens, branches, batch)
                outs = dict(zip(group, out, strict=True)) if len(group) > 1 else {group[0]: out}
                control.ran(outs)
                stack_out.update(outs)
            if last:  # out of time: jump to the clean estimate
                work.finish(layout, stack_out["cond"], stack_out.get("uncond"), guidance, sampler, state)
            else:
                hidden = work.advance(layout, stack_out["cond"], stack_out.get("uncond"), guidance, sampler, state,
                                      time_embeddings[i + 1] if i + 1 < steps else None)
            if state.sample.is_cuda:  # a step's time is its device time: the deadline guard paces on it
                torch.cuda.synchronize(state.sample.device)
            records.append(StepRecord(i, sigma, timestep, run_branches, tuple(full), batched, _ms_since(clock)))
            if last:
                break
        return records

    def warm_schedule(self, num_steps: int) -> None:
        """Make what every tick of `num_steps` sampler steps shares: each step's time embedding and sampler
        coefficients. A tick that makes them spends up to a millisecond more on each step (UniPC's), which its
        deadline guard would read as a slowdown and the cost model learn as the step's cost."""
        sampler = self._sampler(num_steps)
        with torch.no_grad():
            self._step_time_embeddings(sampler.timesteps)
        sample = torch.zeros(1)
        for _ in range(num_steps):
            sample = sampler.step(torch.zeros(1), sample)

    def _step_time_embeddings(self, timesteps: torch.Tensor) -> list[torch.Tensor]:
        """Each step's time embedding `[1, D]` for a schedule's `timesteps` `[N]`, made at its first tick (the
        weights are fixed once loaded): what `embed_gen` would compute from the step's timestep."""
        key = tuple(float(t) for t in timesteps)
        if key not in self._time_embeddings:
            self._time_embeddings[key] = [self.transformer.timestep_embedding(torch.tensor([t], device=self.device))
                                          for t in key]
        return self._time_embeddings[key]

    @staticmethod
    def _stack_call(group: list[str], gens: dict[str, GenInput], branches: dict[str, Branch],
                    batch: BranchBatch | None) -> StackCall:
        """The GEN-stack input of one branch's call, or of both branches' as one batch (`batch`, cond first)."""
        calls = tuple((gens[name], branches[name].und_kv) for name in group)
        if len(calls) == 1:
            return StackCall(*calls[0], calls)
        return StackCall(GenInput.stack_varied([gen for gen, _ in calls], batch.layouts), batch.und_kv, calls)

    @staticmethod
    def _initial_noise(request: PolicyRequest, vision_shape: tuple[int, ...],
                       action_shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Vision noise `vision_shape` and chunk action noise `action_shape` (float32, CPU): the request's, or
        drawn from its seed in diffusers' order, so a seed gives the same noise there and here."""
        if request.noise is None:
            generator = torch.Generator(device="cpu").manual_seed(request.seed)
            return torch.randn(vision_shape, generator=generator), torch.randn(action_shape, generator=generator)
        noise = []
        for name, shape in (("vision", vision_shape), ("actions", action_shape)):
            tensor = getattr(request.noise, name)
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32 or tuple(tensor.shape) != shape \
                    or not torch.isfinite(tensor).all():
                got = f"{getattr(tensor, 'dtype', type(tensor).__name__)} {tuple(getattr(tensor, 'shape', ()))}"
                raise InvalidNoise(f"is {got}; expected finite float32 {list(shape)}", field=f"noise.{name}")
            noise.append(tensor.cpu())
        return noise[0], noise[1]


def policy_prompt_pair(config: PolicyConfig, instruction: str, view_point: str | None, fps: float,
                       chunk_size: int, canvas_hw: tuple[int, int]) -> PromptPair:
    """The CFG prompt pair of a tick on a `canvas_hw` canvas: the JSON action caption and the empty negative
    (training uses it too, so that both see the same text)."""
    height, width = canvas_hw
    return action_prompt_pair(instruction, view_point=view_point, num_frames=chunk_size + 1, fps=fps,
                              height=height, width=width, use_system_prompt=config.use_system_prompt)


class CheckpointLoadError(ValueError):
    """A checkpoint folder that cannot be served; the message names the file and what was expected."""


# What bad files raise while a folder loads: each names the file and the field at fault.
_LOAD_ERRORS = (CheckpointError, ModelConfigError, PolicyConfigError, EmbodimentConfigError, NormalizationStatsError,
                TextTokenizerError, CheckpointNotFound, OSError)


def default_model_path() -> Path:
    """The embedded model shipped inside the package."""
    return Path(__file__).resolve().parent.parent / "assets" / "embedded"


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3
