"""`PolicyPipeline`: camera frames + instruction (+ state) -> action chunk and predicted video latents.

One call is one control tick: encode the conditioning frame with the VAE, reuse (or prefill) the
text K/V of each CFG branch, then run the flow-matching sampler. Each step and branch embeds the
generated rows, lets the step controller decide whether the GEN stack runs or its residual is
extrapolated (SeaCache, deadline guard), decodes velocities with the heads, masks clean rows,
combines CFG and advances the fp32 sampler state. Actions leave in the embodiment's physical units.

Modes (Cosmos3 `build_sequence_plan_from_mode`):
    policy            first latent frame clean; future frames and the action chunk generated;
    forward_dynamics  first latent frame and all actions clean; future frames generated;
    inverse_dynamics  every latent frame clean; the action chunk generated.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from policy_server.cache.controller import CacheRecord, NoCache, StepController
from policy_server.model import Cosmos3OmniTransformer, GenInput, UndKV, load_transformer
from policy_server.model.checkpoint import CheckpointError, weights_digest
from policy_server.model.config import ConfigError as ModelConfigError
from policy_server.model.gen_layout import GenLayout
from policy_server.model.text_tokenizer import TextTokenizer, TextTokenizerError
from policy_server.model.vae import SmallVideoVAE
from policy_server.pipeline.conditioning import crop_latent_padding, fit_to_canvas, frames_to_clip
from policy_server.pipeline.embodiments import Embodiment, EmbodimentConfigError, EmbodimentRegistry
from policy_server.pipeline.errors import (
    EmptyInstruction,
    InvalidActions,
    InvalidImage,
    InvalidMode,
    InvalidSamplerSettings,
)
from policy_server.pipeline.normalization import FeatureNormalizers, NormalizationStatsError
from policy_server.pipeline.packing import ActionLayout, PackedSequence, pack_request
from policy_server.pipeline.policy_config import PolicyConfig, PolicyConfigError
from policy_server.pipeline.prompts import PromptPair, action_prompt_pair
from policy_server.pipeline.schedulers import make_sampler

MODES = ("policy", "forward_dynamics", "inverse_dynamics")
BRANCHES = ("cond", "uncond")


class StepPacer(Protocol):
    """Lets a deadline guard shorten a running tick (`policy_server.budget.guard.DeadlineGuard`)."""

    def pace(self, step: int, use_uncond: bool) -> tuple[bool, bool]:
        """Before sampler step `step`: `(run the uncond pass, make this the last step)`."""


class Aborted(RuntimeError):
    """`should_abort()` returned True between two denoising steps; the tick was abandoned."""


@dataclass
class PolicyRequest:
    """One tick's inputs.

    images: camera name -> uint8 RGB [H, W, 3]; the embodiment's cameras, concatenated left to right.
    state: float32 [state_dim] in physical units, or None when the embodiment takes no state.
    actions: forward_dynamics only: float32 [K, raw_action_dim] in physical units.
    history_actions: optional float32 [H, raw_action_dim], the actions executed just before this tick
        (most recent last), given to the model as clean rows before the chunk.
    video: inverse_dynamics only: uint8 RGB [K + 1, H, W, 3] frames (single camera).
    cfg_steps: run the unconditional CFG pass only on the first `cfg_steps` steps (budget fallback);
        None runs it wherever the guidance interval allows.
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
    video: np.ndarray | None = None
    cfg_steps: int | None = None


@dataclass
class StepRecord:
    """What one denoising step did. `ms[branch]` is the wall time of that branch's embed + stack + heads."""

    index: int
    sigma: float
    timestep: float
    branches: tuple[str, ...]
    ms: dict[str, float] = field(default_factory=dict)


@dataclass
class PolicyOutput:
    actions: np.ndarray  # float32 [K, raw_action_dim], physical units
    latents: torch.Tensor  # generated video latents [C, T, H, W] (normalised latent space)
    steps: list[StepRecord]
    timings_ms: dict[str, float]  # encode, prefill, denoise, decode, total
    cache: CacheRecord


@dataclass
class PromptState:
    """Text K/V of each CFG branch for one (instruction, embodiment, clip geometry); reusable across ticks."""

    key: tuple
    input_ids: dict[str, list[int]]
    und_kv: dict[str, UndKV]


class PolicyPipeline:
    """The Cosmos3 policy: transformer + video VAE + text tokenizer + embodiments + sampler defaults.

    `embodiments` is the full Cosmos3 registry extended by the checkpoint's file; `served_embodiments`
    names the entries that file declares, the ones the server offers. `digest` identifies the weights."""

    def __init__(
        self,
        transformer: Cosmos3OmniTransformer,
        vae: SmallVideoVAE,
        tokenizer: TextTokenizer,
        embodiments: EmbodimentRegistry,
        config: PolicyConfig,
        served_embodiments: list[str],
        digest: str = "",
    ):
        self.transformer = transformer.eval()
        self.vae = vae.eval()
        self.tokenizer = tokenizer
        self.embodiments = embodiments
        self.config = config
        self.served_embodiments = served_embodiments  # what this checkpoint was trained for
        self.digest = digest
        # GEN layouts by request shape: ticks of the same shape share one object, which is what lets
        # the engine run their GEN stacks as one batch (`GenInput.stack`).
        self._gen_layouts: dict[tuple, GenLayout] = {}
        self._normalizers: dict[str, FeatureNormalizers] = {}

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, device: str = "cpu") -> PolicyPipeline:
        """Load a pipeline folder (`transformer/`, `vae/`, `text_tokenizer/`, `policy.json`);
        None loads the embedded model shipped in the package. A folder that cannot be served raises
        `CheckpointLoadError`, whose message names the file and what was expected."""
        root = Path(path) if path is not None else default_model_path()
        try:
            if not root.is_dir():
                raise CheckpointError(f"{root} is not a directory")
            if not (root / "policy.json").is_file() and _pipeline_class(root) == "Cosmos3OmniPipeline":
                raise CheckpointError(
                    f"{root / 'model_index.json'} names a Cosmos3OmniPipeline as diffusers saves it; this server "
                    "serves pipeline folders with policy.json and embodiments.json (the embedded model's layout)"
                )
            config = PolicyConfig.load(root / "policy.json")
            embodiments = EmbodimentRegistry.cosmos3()
            served = embodiments.load_config(root / config.embodiments_file)
            pipeline = cls(
                transformer=load_transformer(root / "transformer", device=device),
                vae=SmallVideoVAE.from_pretrained(root / "vae").to(device),
                tokenizer=TextTokenizer.from_dir(root / "text_tokenizer"),
                embodiments=embodiments,
                config=config,
                served_embodiments=served,
                digest=weights_digest(root),
            )
            for name in served:  # stats files are read now, not at the first tick
                pipeline.normalizers(embodiments.get(name))
        except _LOAD_ERRORS as error:
            raise CheckpointLoadError(f"cannot serve checkpoint {root}: {error}") from error
        return pipeline

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    def normalizers(self, embodiment: Embodiment) -> FeatureNormalizers:
        """The embodiment's action/state normalisers, loaded from its stats file once."""
        if embodiment.name not in self._normalizers:
            self._normalizers[embodiment.name] = embodiment.load_normalizers()
        return self._normalizers[embodiment.name]

    # ------------------------------------------------------------------------------------ prompt

    def encode_prompt(self, instruction: str, embodiment: Embodiment, chunk_size: int, cfg: bool) -> PromptState:
        """Tokenize the action caption (and negative prompt) and prefill the text K/V of each branch."""
        pair = policy_prompt_pair(self.config, instruction, embodiment.viewpoint, embodiment.fps, chunk_size)
        texts = {"cond": pair.cond, "uncond": pair.uncond}
        input_ids, und_kv = {}, {}
        for branch in BRANCHES if cfg else BRANCHES[:1]:
            ids = self.tokenizer.encode(texts[branch], system_prompt=pair.system_prompt)
            input_ids[branch] = ids
            ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
            positions = torch.arange(len(ids), dtype=torch.float32, device=self.device).expand(3, -1)
            with torch.no_grad():
                und_kv[branch] = self.transformer.prefill_und(ids_t, positions)
        return PromptState(self.prompt_key(instruction, embodiment, chunk_size, cfg), input_ids, und_kv)

    @staticmethod
    def prompt_key(instruction: str, embodiment: Embodiment, chunk_size: int, cfg: bool) -> tuple:
        return (instruction, embodiment.name, chunk_size, cfg)

    # ------------------------------------------------------------------------------------ tick

    def __call__(
        self,
        request: PolicyRequest,
        prompt: PromptState | None = None,
        controller: StepController | None = None,
        should_abort: Callable[[], bool] | None = None,
        pacer: StepPacer | None = None,
        stack: Callable[[GenInput, UndKV], torch.Tensor] | None = None,
    ) -> PolicyOutput:
        """Run one tick. `prompt`: the session's text K/V (prefilled here when missing or stale);
        `controller`: the step cache (default `NoCache`); `should_abort`: checked before every step;
        `pacer`: the deadline guard's say before every step; `stack`: runs the GEN stack of a full call
        (default the transformer's; the engine's batcher when several ticks run together)."""
        t_start = time.perf_counter()
        embodiment, chunk, steps, guidance = self._validate(request)
        controller = controller or NoCache()
        cfg = guidance != 1.0
        timings: dict[str, float] = {}

        with torch.no_grad():
            clock = time.perf_counter()
            clean_latent, placement_hw = self._encode_condition(request, chunk)
            timings["encode"] = _ms_since(clock)

            clock = time.perf_counter()
            key = self.prompt_key(request.instruction, embodiment, chunk, cfg)
            if prompt is None or prompt.key != key:
                prompt = self.encode_prompt(request.instruction, embodiment, chunk, cfg)
            timings["prefill"] = _ms_since(clock)

            clock = time.perf_counter()
            latents, actions, steps_done = self._denoise(
                request, embodiment, chunk, steps, guidance, clean_latent, prompt, controller, should_abort, pacer,
                stack or self.transformer.gen_stack,
            )
            timings["denoise"] = _ms_since(clock)

            clock = time.perf_counter()
            action_rows = actions[-chunk:, : embodiment.raw_action_dim].double().cpu().numpy()
            physical = self.normalizers(embodiment).action.denormalize(action_rows).astype(np.float32)
            timings["decode"] = _ms_since(clock)
        timings["total"] = _ms_since(t_start)
        return PolicyOutput(physical, latents, steps_done, timings, controller.record())

    def clip_frames(self, chunk: int) -> int:
        """Pixel frames of the clip a chunk of `chunk` actions lives in: the `chunk + 1` frames rounded up to
        the VAE's temporal grid (`4k + 1`). Frames past `chunk + 1` are padding, generated and dropped."""
        tc = self.vae.temporal_compression
        return tc * math.ceil(chunk / tc) + 1

    def decode_video(self, latents: torch.Tensor, chunk: int) -> np.ndarray:
        """Predicted frames of a chunk of `chunk` actions: latents [C, T, h, w] -> uint8 RGB
        [chunk + 1, H, W, 3] on the canvas (the temporal padding dropped)."""
        with torch.no_grad():
            video = self.vae.decode(latents.unsqueeze(0).to(self.device))[0]
        frames = ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return frames.permute(1, 2, 3, 0)[: chunk + 1].cpu().numpy()

    # ------------------------------------------------------------------------------------ parts

    def _validate(self, request: PolicyRequest) -> tuple[Embodiment, int, int, float]:
        if request.mode not in MODES:
            raise InvalidMode(request.mode, MODES)
        embodiment = self.embodiments.get(request.embodiment)
        if request.mode != "inverse_dynamics" and not request.instruction.strip():
            raise EmptyInstruction(request.mode)
        chunk = embodiment.check_chunk_size(
            embodiment.default_chunk_size if request.chunk_size is None else request.chunk_size
        )
        steps = request.num_steps or self.config.num_steps
        if not isinstance(steps, int) or not 1 <= steps <= 1000:
            raise InvalidSamplerSettings("num_steps", f"num_steps={steps!r}; expected an integer in [1, 1000]")
        guidance = self.config.guidance if request.guidance is None else float(request.guidance)
        if not math.isfinite(guidance) or guidance < 1.0:
            raise InvalidSamplerSettings("guidance", f"guidance={guidance!r}; expected a finite value >= 1")
        self._validate_images(request, embodiment)
        embodiment.check_state(request.state)
        if request.history_actions is not None:
            embodiment.check_actions(request.history_actions, field="history_actions")
        if request.mode == "forward_dynamics":
            actions = embodiment.check_actions(request.actions)
            if actions.shape[0] != chunk:
                raise InvalidActions(f"got {actions.shape[0]} actions; expected chunk_size={chunk}")
        return embodiment, chunk, steps, guidance

    def _validate_images(self, request: PolicyRequest, embodiment: Embodiment) -> None:
        if request.mode == "inverse_dynamics":
            video = request.video
            if not isinstance(video, np.ndarray) or video.dtype != np.uint8 or video.ndim != 4 \
                    or video.shape[-1] != 3:
                raise InvalidImage("inverse_dynamics needs a uint8 RGB video [K+1, H, W, 3]", field="video")
            return
        missing = [c for c in embodiment.cameras if c not in request.images]
        extra = [c for c in request.images if c not in embodiment.cameras]
        if missing or extra:
            raise InvalidImage(f"cameras {sorted(request.images)}; expected exactly {list(embodiment.cameras)}")
        heights = set()
        for name in embodiment.cameras:
            image = request.images[name]
            if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 \
                    or image.shape[-1] != 3 or min(image.shape[:2]) < 1:
                got = f"{getattr(image, 'dtype', type(image).__name__)} {getattr(image, 'shape', '')}"
                raise InvalidImage(f"image {name!r} is {got}; expected uint8 RGB [H >= 1, W >= 1, 3]",
                                   field=f"images[{name}]")
            heights.add(image.shape[0])
        if len(heights) > 1:
            raise InvalidImage(f"camera images have heights {sorted(heights)}; expected one common height")

    def _encode_condition(self, request: PolicyRequest, chunk: int) -> tuple[torch.Tensor, tuple[int, int]]:
        """VAE latents of the conditioning frames, padding cropped: [C, T_clean, h, w]."""
        if request.mode == "inverse_dynamics":
            frames = request.video
            num_frames = self.clip_frames(chunk)  # the last frame repeated over the temporal padding
        else:
            cams = [request.images[c] for c in self.embodiments.get(request.embodiment).cameras]
            frames = np.concatenate(cams, axis=1) if len(cams) > 1 else cams[0]
            # The VAE is causal in time: latent frame 0 depends on pixel frame 0 only, so the clean
            # conditioning latent needs just that frame.
            num_frames = 1
        clip = frames_to_clip(frames, num_frames).to(self.device)
        canvas, placement = fit_to_canvas(clip, self.config.canvas_hw, pad_mode=self.config.pad_mode)
        latents = self.vae.encode(canvas)
        latents = crop_latent_padding(latents, placement, self.vae.spatial_compression)
        return latents[0].float(), placement.content_hw

    def _denoise(self, request, embodiment, chunk, steps, guidance, clean_latent, prompt, controller,
                 should_abort, pacer, stack):
        config = self.transformer.config
        device = self.device
        generator = torch.Generator(device="cpu").manual_seed(request.seed)
        num_latent_frames = self.vae.num_latent_frames(self.clip_frames(chunk))
        channels, _, height, width = clean_latent.shape
        latent_shape = (channels, num_latent_frames, height, width)

        # Clean rows and initial state (fp32 sampler state; the transformer runs in its own dtype).
        if request.mode == "inverse_dynamics":
            clean_frames = list(range(num_latent_frames))
        else:
            clean_frames = [0]
        noise_v = torch.randn(latent_shape, generator=generator).to(device)
        vision = noise_v.clone()
        vision[:, : clean_latent.shape[1]] = clean_latent[:, :num_latent_frames]
        clean_vision = vision[:, clean_frames].clone()

        # Action stream rows: [history (H) | state (0 or 1) | chunk (K)]; everything before the chunk is clean.
        normalizers = self.normalizers(embodiment)
        history = [] if request.history_actions is None else list(np.asarray(request.history_actions, np.float64))
        has_state = embodiment.state_dim > 0
        num_prefix = len(history) + (1 if has_state else 0)
        action_dim = config.action_dim
        rows = num_prefix + chunk
        noise_a = torch.randn((rows, action_dim), generator=generator).to(device)
        clean_actions = torch.zeros((rows, action_dim), device=device)
        if history:
            past = normalizers.action.normalize(np.stack(history))
            clean_actions[: len(history), : embodiment.raw_action_dim] = torch.from_numpy(past).float()
        if has_state:
            state = normalizers.state.normalize(np.asarray(request.state, dtype=np.float64))
            clean_actions[num_prefix - 1, : len(state)] = torch.from_numpy(state).float()
        clean_rows = list(range(num_prefix))
        if request.mode == "forward_dynamics":
            given = normalizers.action.normalize(np.asarray(request.actions, dtype=np.float64))
            clean_actions[num_prefix:, : embodiment.raw_action_dim] = torch.from_numpy(given).float()
            clean_rows.extend(range(num_prefix, rows))
        action_mask = torch.zeros((rows, 1), device=device)
        action_mask[clean_rows] = 1.0
        actions = action_mask * clean_actions + (1 - action_mask) * noise_a
        actions[:, embodiment.raw_action_dim:] = 0
        layout = ActionLayout(chunk, num_prefix, tuple(clean_rows), embodiment.domain_id)

        packed: dict[str, PackedSequence] = {
            branch: pack_request(config, ids, latent_shape, clean_frames, embodiment.fps, layout, device)
            for branch, ids in prompt.input_ids.items()
        }
        # Rows and rotary tables of the generated rows depend on the request's shape only: build them once.
        model_dtype = self.transformer.dtype
        layouts = {}
        for branch, seq in packed.items():
            shape_key = (seq.und_len, latent_shape, tuple(clean_frames), layout, embodiment.fps)
            if shape_key not in self._gen_layouts:
                built = self.transformer.gen_layout(
                    **seq.model_kwargs(vision.to(model_dtype), actions.to(model_dtype), timestep=0.0))
                self._gen_layouts.setdefault(shape_key, built)  # ticks on other threads keep the first one
            layouts[branch] = self._gen_layouts[shape_key]
        noisy_vision = len(clean_frames) < num_latent_frames
        noisy_actions = len(clean_rows) < rows

        sampler = make_sampler(self.config.sampler, steps, self.config.shift, solver_order=self.config.solver_order,
                               karras=self.config.karras)
        cfg_steps = steps if request.cfg_steps is None else request.cfg_steps
        lo, hi = self.config.guidance_interval or (-math.inf, math.inf)
        controller.begin(steps)
        records: list[StepRecord] = []
        for i in range(steps):
            if should_abort is not None and should_abort():
                raise Aborted(f"abandoned before step {i} of {steps}")
            sigma = sampler.sigmas[i]
            timestep = float(sampler.timesteps[i])
            use_cfg = guidance != 1.0 and i < cfg_steps and lo < timestep < hi
            last = False
            if pacer is not None:
                use_cfg, last = pacer.pace(i, use_cfg)
            branches = BRANCHES if use_cfg else BRANCHES[:1]
            record = StepRecord(i, sigma, timestep, branches)
            indicator = [vision] if noisy_vision else []
            velocities = {}
            for branch in branches:
                clock = time.perf_counter()
                kwargs = packed[branch].model_kwargs(vision.to(model_dtype), actions.to(model_dtype), timestep)
                gen = self.transformer.embed_gen(layout=layouts[branch], **kwargs)
                und_kv = prompt.und_kv[branch]
                stack_out = controller.run_stack(
                    step=i, branch=branch, sigma=sigma, noisy_vision=indicator, gen_in=gen.hidden,
                    full=lambda gen=gen, und_kv=und_kv: stack(gen, und_kv),
                )
                pred_vision, _, pred_action = self.transformer.heads(stack_out, gen)
                v_vision = pred_vision[0][0].float()
                v_action = pred_action[0].float()
                v_vision[:, clean_frames] = 0
                v_action[clean_rows] = 0
                v_action[:, embodiment.raw_action_dim:] = 0
                velocities[branch] = (v_vision, v_action)
                record.ms[branch] = _ms_since(clock)
            v_vision, v_action = velocities["cond"]
            if use_cfg:
                u_vision, u_action = velocities["uncond"]
                v_vision = u_vision + guidance * (v_vision - u_vision)
                v_action = u_action + guidance * (v_action - u_action)
            if not noisy_actions:
                v_action = torch.zeros_like(v_action)
            if last:
                # Out of time: jump to the clean estimate, x0 = x_t - sigma * v for flow matching.
                vision, actions = vision - sigma * v_vision, actions - sigma * v_action
            else:
                stepped = sampler.step({"vision": v_vision, "action": v_action},
                                       {"vision": vision, "action": actions})
                vision, actions = stepped["vision"], stepped["action"]
            # Conditioning rows stay exactly what was given.
            vision[:, clean_frames] = clean_vision
            actions[clean_rows] = clean_actions[clean_rows]
            actions[:, embodiment.raw_action_dim:] = 0
            records.append(record)
            if last:
                break
        return vision, actions, records


def policy_prompt_pair(config: PolicyConfig, instruction: str, view_point: str | None, fps: float,
                       chunk_size: int) -> PromptPair:
    """The CFG prompt pair of a policy tick: the JSON action caption and the empty negative (training uses
    it too, so that both see the same text)."""
    height, width = config.canvas_hw
    return action_prompt_pair(instruction, view_point=view_point, num_frames=chunk_size + 1, fps=fps,
                              height=height, width=width, use_system_prompt=config.use_system_prompt)


class CheckpointLoadError(ValueError):
    """A checkpoint folder that cannot be served; the message names the file and what was expected."""


# What bad files raise while a folder loads: each names the file and the field at fault.
_LOAD_ERRORS = (CheckpointError, ModelConfigError, PolicyConfigError, EmbodimentConfigError, NormalizationStatsError,
                TextTokenizerError, OSError)


def _pipeline_class(root: Path) -> str | None:
    """`_class_name` of the folder's `model_index.json`, if it has a readable one."""
    try:
        return json.loads((root / "model_index.json").read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None


def default_model_path() -> Path:
    """The embedded model shipped inside the package."""
    return Path(__file__).resolve().parent.parent / "assets" / "embedded"


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3
