"""Train the embedded Cosmos3 policy by flow matching on expert demonstrations.

    python -m robots.train_policy --data runs/data/reach-400 --from-scratch --out runs/policy --steps 6000
    python -m robots.train_policy --data runs/data/reach-1500 runs/data/either-4000 --init runs/policy --out ...
    python -m robots.train_policy --data my_arm_lerobot --embodiment my_arm --out runs/my-arm --steps 2000

It fine-tunes the shipped embedded weights unless `--init` names other ones or `--from-scratch` is given. It
trains one embodiment, which the folder written serves: the embedded `pusht` (the Reach task's demonstrations,
`robots.datagen`'s), or a robot of another layout (a LeRobot dataset, v3.0 or v2.x: any cameras, stored as
videos or images, their frames put side by side onto the model's canvas as the server's conditioning does; state
and action widths up to the transformer's action_dim; its own fps; `--chunk-size` actions a tick) on a domain row
of its own.

Each training sample is one control tick of a demonstration: the frame at step t (clean latent
frame 0), the next K frames (noisy future latents), the K expert actions from t (noisy action rows)
and the effector state at t (a clean state row). Like Cosmos3 policy training, one loss covers the
video and action velocities (`v = noise - x0`, actions weighted 10x); the prompt is dropped to the
negative prompt 10% of the time so classifier-free guidance works at inference.

Samples of one instruction share a single text prefill per optimiser step (the cacheable boundary:
`prefill_und` once per prompt, then `embed_gen` per sample and one batched `gen_stack` for all samples
whose prompts have the same length, with gradients through both pathways).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np
import torch
from pydantic import ValidationError
from tqdm import tqdm

from policy_server.json_file import read_json
from policy_server.model import Cosmos3OmniTransformer, load_transformer
from policy_server.model.boundary import GenInput, UndKV
from policy_server.model.checkpoint import CheckpointError
from policy_server.model.config import ConfigError, Cosmos3TransformerConfig
from policy_server.model.text_tokenizer import TextTokenizer
from policy_server.model.vae import SmallVideoVAE
from policy_server.pipeline.conditioning import CanvasPlacement, crop_latent_padding, prepare_clip
from policy_server.pipeline.embodiments import (
    NO_ACTION_DOMAIN_ID,
    NUM_EMBODIMENT_DOMAINS,
    Embodiment,
    EmbodimentConfigError,
    EmbodimentRegistry,
    cosmos3_embodiments,
    format_validation_error,
)
from policy_server.pipeline.normalization import make_normalizer, parse_stats
from policy_server.pipeline.packing import ActionLayout, pack_request
from policy_server.pipeline.policy import default_model_path, policy_prompt_pair
from policy_server.pipeline.policy_config import PolicyConfig, PolicyConfigError
from policy_server.specs import frame_sizes_outside, width_beside
from robots import embedded
from robots.dataset import DatasetError, DemoDataset, Episode, array_stats, open_dataset
from robots.lerobot_dataset import LeRobotDemoDataset

ACTION_LOSS_WEIGHT = 10.0  # Cosmos3 action_loss_weight
SUMMARY_FILE = "training.json"  # the run's summary, in the folder written
PROMPT_DROPOUT = 0.1
# What --limits may declare: physical limits and units (LeRobot's info.json has neither).
LIMIT_FIELDS = ("action_low", "action_high", "state_low", "state_high", "action_units", "state_units")


@dataclass(frozen=True)
class InitDomains:
    """The domain rows of the weights training starts from (none known for a folder without a policy.json, or from
    scratch): those they were trained on (policy.json's trained_domain_ids) and each embodiment's that the folder
    serves (its embodiments.json), by name."""

    trained: frozenset[int] = frozenset()
    served: dict[str, int] = field(default_factory=dict)


@dataclass
class TrainingWindows:
    """All training samples, pre-encoded. N windows."""

    latents: torch.Tensor  # [N, C, T_lat, h, w] normalised VAE latents
    actions: torch.Tensor  # [N, K, A] normalised actions, zero-padded to the model's action_dim
    states: torch.Tensor  # [N, A] normalised state row, zero-padded
    prompt_index: torch.Tensor  # [N] index into the instruction list
    instructions: list[str]
    canvas_hw: tuple[int, int]  # the canvas the frames went on (the prompt names it)


def demonstration_stats(episodes: Iterable[Episode]) -> dict:
    """The min-max (and other) statistics of the episodes' actions and states, which normalise them: of every action
    trained on, the hold actions that pad the episodes' last ticks too, so that every one maps into [-1, 1]. Only
    the actions and states are kept, not the frames."""
    actions, states = [], []
    for episode in episodes:
        actions.append(np.concatenate([episode.actions, episode.hold_action[None]]))
        states.append(episode.states)
    return {"action": array_stats(np.concatenate(actions)), "state": array_stats(np.concatenate(states))}


def collect_windows(episodes: Iterable[Episode], vae: SmallVideoVAE, chunk: int, action_dim: int, stats: dict,
                    stride: int, policy: PolicyConfig, batch: int = 64) -> TrainingWindows:
    """Cut every episode into ticks (every `stride` steps) and VAE-encode their K+1-frame clips, put on the canvas
    and cropped to their content as the server's conditioning does (`prepare_clip`, `crop_latent_padding`). Each
    episode is encoded as it comes, its frames put on the canvas once: only one episode's frames and `batch` clips
    are held at a time, whatever the dataset's size."""
    parsed = parse_stats(stats)
    action_norm = make_normalizer("minmax", parsed["action"], parsed["action"].dim)
    state_norm = make_normalizer("minmax", parsed["state"], parsed["state"].dim)
    m = vae.spatial_compression
    latents, clips, actions, states, prompts, instructions = [], [], [], [], [], []

    def encode(placement: CanvasPlacement) -> None:
        with torch.inference_mode():
            latents.append(crop_latent_padding(vae.encode(torch.cat(clips)), placement, m))
        clips.clear()

    for episode in episodes:
        if episode.instruction not in instructions:
            instructions.append(episode.instruction)
        steps = episode.num_steps
        # Every frame has one size (checked_episodes), so every clip one placement.
        canvas, placement = prepare_clip(episode.frames, steps + 1, policy.canvases, m, policy.pad_mode)
        for t in range(0, steps, stride):
            # channels last, as prepare_clip gives a clip (and the server encodes it): the VAE's convolutions take
            # another path on a contiguous one, 1e-6 off
            clips.append(canvas[:, :, np.minimum(np.arange(t, t + chunk + 1), steps)].contiguous(
                memory_format=torch.channels_last_3d))
            # After the episode ends the robot holds still, on its hold action.
            acts = np.tile(episode.hold_action.astype(np.float64), (chunk, 1))
            valid = episode.actions[t: t + chunk]
            acts[: len(valid)] = valid
            acts = action_norm.normalize(acts)
            padded = np.zeros((chunk, action_dim), np.float32)
            padded[:, : acts.shape[1]] = acts
            actions.append(padded)
            state = np.zeros(action_dim, np.float32)
            state[: episode.states.shape[1]] = state_norm.normalize(episode.states[t].astype(np.float64))
            states.append(state)
            prompts.append(instructions.index(episode.instruction))
            if len(clips) == batch:
                encode(placement)
    if not actions:
        raise DatasetError("no episode has an action to train on (each has one frame); expected episodes of 2 frames "
                           "or more")
    if clips:
        encode(placement)
    return TrainingWindows(
        latents=torch.cat(latents).float(),
        actions=torch.from_numpy(np.stack(actions)),
        states=torch.from_numpy(np.stack(states)),
        prompt_index=torch.tensor(prompts),
        instructions=instructions,
        canvas_hw=placement.canvas_hw,
    )


def check_parts_fit(config: Cosmos3TransformerConfig, vae: SmallVideoVAE, tokenizer: TextTokenizer,
                    init_from: Path | None, vae_dir: Path) -> None:
    """CheckpointError unless the transformer (`config`: --init's, else the embedded one's) takes the latents of the
    VAE (`vae_dir`) and the ids of the embedded text tokenizer, before any frame is encoded: a Cosmos3 diffusers
    folder's transformer (its own vocabulary) failed with an IndexError traceback at the first step."""
    transformer = (f"the transformer of {init_from} (--init)" if init_from is not None
                   else "the fresh transformer (--from-scratch)")
    if tokenizer.id_bound > config.vocab_size:
        raise CheckpointError(f"{transformer} has vocab_size={config.vocab_size}; expected at least "
                              f"{tokenizer.id_bound}, the ids of the embedded text tokenizer that training prompts "
                              "with (as a folder robots.train_policy wrote has, or the shipped one)")
    if config.latent_channel != vae.latent_channels:
        raise CheckpointError(f"{transformer} takes latents of {config.latent_channel} channels; the VAE {vae_dir} "
                              f"makes {vae.latent_channels}")


def trained_embodiment(datasets: list[DemoDataset | LeRobotDemoDataset], first: Episode, name: str | None,
                       domain_id: int | None, chunk: int, action_dim: int, init: InitDomains,
                       limits: dict | None) -> dict:
    """The embodiments.json entry of the embodiment trained here, which the folder written serves.

    `name` None: the first dataset's LeRobot robot_type, else the embedded `pusht`. `pusht` keeps the embedded
    entry (its layout is then required, `check_fits_embodiment`); another name gets the first dataset's layout
    (`first`: its first episode), its fps and cameras, and a domain row: `domain_id`, else the one the --init
    folder serves it on (retraining it), else its Cosmos3 one, else the first free one (no Cosmos3 embodiment's,
    none the --init weights were trained on). `limits`: `LIMIT_FIELDS`."""
    name = name or datasets[0].robot_type or embedded.EMBODIMENT
    if name == embedded.EMBODIMENT:
        entry = embedded.embodiment_entry()
        if domain_id is not None and domain_id != entry["domain_id"]:
            raise EmbodimentConfigError(f"--domain-id {domain_id}: the embedded {name} is domain "
                                        f"{entry['domain_id']}; name another embodiment (--embodiment) to train "
                                        "on another row")
    else:
        widths = {"action": first.actions.shape[1], "state": first.states.shape[1]}
        if too_wide := {kind: width for kind, width in widths.items() if width > action_dim}:
            raise DatasetError(f"{datasets[0].directory}: {too_wide} channels; the model's action rows hold "
                               f"action_dim={action_dim} (one row carries the action or the state): a wider "
                               "robot needs a model of a wider action_dim")
        cosmos3 = {e.name: e.domain_id for e in cosmos3_embodiments()}
        if domain_id is None:
            taken = {NO_ACTION_DOMAIN_ID, *cosmos3.values(), *init.trained}
            domain_id = init.served.get(name, cosmos3.get(name, min(set(range(NUM_EMBODIMENT_DOMAINS)) - taken)))
        first_set = datasets[0]
        entry = {
            "name": name, "domain_id": domain_id, "raw_action_dim": widths["action"],
            "action_names": first_set.action_names or [], "state_dim": widths["state"],
            "state_names": first_set.state_names or [], "cameras": list(first_set.cameras),
            # as recorded and trained: ServerInfo advertises these, not the cameras' shares of the canvas
            "camera_sizes": {name: list(first_set.camera_sizes[name]) for name in first_set.cameras},
            # The caption's framing sentence: Cosmos3's for several cameras side by side.
            "viewpoint": "concat_view" if len(first_set.cameras) > 1 else "third_person_view",
            "fps": float(first_set.fps),
            "normalization": {"method": "minmax", "stats_path": embedded.STATS_FILE},
            "description": f"trained by robots.train_policy on {', '.join(str(d.directory) for d in datasets)}",
        }
    entry.update(default_chunk_size=chunk, max_chunk_size=2 * chunk)
    if limits is not None:
        if unknown := sorted(set(limits) - set(LIMIT_FIELDS)):
            raise EmbodimentConfigError(f"--limits: {unknown} are not limits; expected some of {list(LIMIT_FIELDS)}")
        entry.update(limits)
    try:
        Embodiment.model_validate(entry)
    except ValidationError as error:
        raise EmbodimentConfigError(format_validation_error(error, f"embodiment {name!r}")) from None
    return entry


def side_by_side_hw(sizes: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """The size ``(height, width)`` px of cameras' frames of ``sizes`` side by side, as ``side_by_side`` puts them:
    the tallest camera's height, each camera scaled to it (``width_beside``)."""
    tallest = max(height for height, _ in sizes.values())
    return tallest, sum(width_beside(height, width, tallest) for height, width in sizes.values())


def check_fits_embodiment(dataset: DemoDataset | LeRobotDemoDataset, embodiment: Embodiment,
                          canvas_hw: tuple[int, int]) -> None:
    """DatasetError unless the dataset's metadata has the layout of the embodiment trained here: its rate, cameras
    and their frame sizes (``Embodiment.frame_sizes`` on the model's canvas ``canvas_hw``), checked before any frame
    is decoded. Another rate would be captioned and served as the embodiment's; other frames would be placed on the
    canvas unlike the served ones."""
    trains = f"the embodiment it trains ({embodiment.name}); name another embodiment (--embodiment) to train one of " \
             "this layout"
    where = dataset.directory
    if dataset.fps != embodiment.fps:
        raise DatasetError(f"{where}: recorded at {dataset.fps} fps; expected {embodiment.fps}, the fps of {trains}")
    if list(dataset.cameras) != list(embodiment.cameras):
        raise DatasetError(f"{where}: cameras {list(dataset.cameras)}; expected {list(embodiment.cameras)}, the "
                           f"cameras of {trains}")
    sizes, expected = dict(dataset.camera_sizes), embodiment.frame_sizes(canvas_hw)
    if sizes != expected:
        raise DatasetError(f"{where}: cameras of {sizes} px (height, width); expected {expected}, the frame sizes "
                           f"of {trains}")


def checked_episodes(dataset: DemoDataset | LeRobotDemoDataset, embodiment: Embodiment,
                     canvas_hw: tuple[int, int]) -> Iterator[Episode]:
    """The dataset's episodes, each raising DatasetError unless it has the embodiment's action and state widths, finite
    actions and states, and its frames, its cameras' (``Embodiment.frame_sizes``) side by side. Another layout would
    train only the first channels and write a folder whose stats no server loads; a NaN would train on NaN."""
    trains = f"the embodiment it trains ({embodiment.name}); name another embodiment (--embodiment) to train one of " \
             "this layout"
    sizes = embodiment.frame_sizes(canvas_hw)
    frame_hw = side_by_side_hw(sizes)
    for index, episode in enumerate(dataset):
        has = f"{dataset.directory}: episode {index} has"
        for name, field_name in (("actions", "raw_action_dim"), ("states", "state_dim")):
            if (width := getattr(episode, name).shape[1]) != (expected := getattr(embodiment, field_name)):
                raise DatasetError(f"{has} {name} of width {width}; expected {expected}, the {field_name} of {trains}")
        for name, values in (("actions", np.concatenate([episode.actions, episode.hold_action[None]])),
                             ("states", episode.states)):
            if not np.isfinite(values).all():
                row, channel = np.argwhere(~np.isfinite(values))[0]
                raise DatasetError(f"{has} {name} that are not finite ({values[row, channel]} at frame {row}, channel "
                                   f"{channel}); expected finite numbers")
        if (size := tuple(episode.frames.shape[1:3])) != frame_hw:
            raise DatasetError(f"{has} frames of {size[0]}x{size[1]} px (its cameras side by side); expected "
                               f"{frame_hw[0]}x{frame_hw[1]}, the frames of {sizes} px (height, width) side by side "
                               f"of {trains}")
        yield episode


def check_frames_servable(dataset: DemoDataset | LeRobotDemoDataset, min_side: int) -> None:
    """DatasetError unless the server takes frames of the dataset's cameras (`frame_sizes_outside`: `min_side` is the
    VAE's spatial compression). A folder trained on other frames would serve an embodiment whose every tick the server
    refuses."""
    if problem := frame_sizes_outside(dataset.camera_sizes, min_side):
        raise DatasetError(f"{dataset.directory}: {problem}")


def init_domains(init_from: Path | None) -> InitDomains:
    """The domain rows of the weights in `init_from`, as its policy.json and embodiments.json record them."""
    if init_from is None or not (Path(init_from) / "policy.json").is_file():
        return InitDomains()
    config = PolicyConfig.load(Path(init_from) / "policy.json")
    registry = EmbodimentRegistry.cosmos3()  # the served embodiments, as the server reads them
    served = registry.load_config(Path(init_from) / config.embodiments_file)
    return InitDomains(frozenset(config.trained_domain_ids or ()),
                       {name: registry.get(name).domain_id for name in served})


def init_for_training(model: Cosmos3OmniTransformer) -> None:
    """Scale the per-domain action projections like linear layers (std 1/sqrt(fan_in), zero bias).

    They are stored as embeddings, whose default N(0, 1) init would make the first action outputs
    about sqrt(hidden_size) times too large and waste the start of training shrinking them.
    """
    with torch.no_grad():
        for projection in (model.action_proj_in, model.action_proj_out):
            projection.fc.weight.normal_(0.0, projection.input_size**-0.5)
            projection.bias.weight.zero_()


def sample_sigmas(n: int, shift: float, generator: torch.Generator) -> torch.Tensor:
    """Logit-normal sigmas shifted like the inference schedule: `s*u / (1 + (s-1)*u)`."""
    u = torch.sigmoid(torch.randn(n, generator=generator))
    return shift * u / (1 + (shift - 1) * u)


def check_out_folder(out_dir: Path) -> None:
    """`--out` must be a new or empty folder this process can write: checked before the encoding and the training,
    which take minutes to hours, without making the folder (a run refused later leaves nothing behind)."""
    nearest = next(folder for folder in (out_dir, *out_dir.absolute().parents) if folder.exists())
    if not nearest.is_dir():
        where = "" if nearest == out_dir else f": {nearest}"
        raise NotADirectoryError(f"--out {out_dir}{where} is a file; expected a new or empty folder for the pipeline "
                                 "folder written")
    if nearest == out_dir and any(out_dir.iterdir()):
        # Another run's files would be served with these weights (a quality profile of others) or describe them.
        raise FileExistsError(f"--out {out_dir} is not empty; expected a new or empty folder for the pipeline folder "
                              "written (name another, or remove it)")
    try:
        with tempfile.TemporaryDirectory(dir=nearest):  # what making the folder and its files takes
            pass
    except OSError as error:
        raise OSError(f"cannot write --out {out_dir}: {error.strerror or error}") from None


def train(
    data_dirs: list[Path],
    vae_dir: Path,
    out_dir: Path,
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-4,
    seed: int = 0,
    stride: int = 1,
    ema_decay: float = 0.999,
    log_every: int = 100,
    save_every: int | None = None,
    init_from: Path | None = None,
    embodiment: str | None = None,
    domain_id: int | None = None,
    chunk: int = embedded.CHUNK_SIZE,
    name: str | None = None,
    limits: dict | None = None,
) -> dict:
    """Train (from scratch, or from the transformer in `init_from`) and write a complete pipeline folder to
    `out_dir`, a new or empty folder (also every `save_every` steps, with the EMA weights so far), served as the model
    `name` (default the folder's name). `embodiment`, `domain_id`, `limits`: `trained_embodiment`; `chunk`: actions a
    tick. Returns a summary, the folder's training.json."""
    out_dir = Path(out_dir)
    check_out_folder(out_dir)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    if init_from is None:
        model = Cosmos3OmniTransformer(embedded.transformer_config()).train()
        init_for_training(model)
    else:  # before the minutes of VAE encoding, so that a bad --init fails at once
        model = load_transformer(init_from).float().train()
    vae = SmallVideoVAE.from_pretrained(vae_dir).eval()
    tokenizer = TextTokenizer.from_dir(default_model_path() / "text_tokenizer")
    config = model.config
    check_parts_fit(config, vae, tokenizer, init_from, vae_dir)
    init = init_domains(init_from)
    datasets = [open_dataset(data_dir) for data_dir in data_dirs]
    for dataset in datasets:  # from info.json's shapes, before any frame is decoded
        check_frames_servable(dataset, vae.spatial_compression)
    # From the metadata and the first episode only: a wrong layout is refused before every episode is decoded.
    entry = trained_embodiment(datasets, datasets[0][0], embodiment, domain_id, chunk, config.action_dim, init,
                               limits)
    trained = Embodiment.model_validate(entry)
    policy = embedded.policy_config().model_copy(update={
        "name": name or Path(out_dir).resolve().name,
        "trained_domain_ids": tuple(sorted(init.trained | {entry["domain_id"]}))})
    for dataset in datasets:
        check_fits_embodiment(dataset, trained, policy.canvas_hw)
    # Every episode is read and checked before any is encoded, so that a bad one is refused before minutes of
    # encoding, then read again as it is encoded: a dataset need not fit in memory.
    episodes = sum(len(dataset) for dataset in datasets)
    checked = chain.from_iterable(checked_episodes(dataset, trained, policy.canvas_hw) for dataset in datasets)
    stats = demonstration_stats(tqdm(checked, desc="check", total=episodes, unit="episode"))
    windows = collect_windows(tqdm(chain.from_iterable(datasets), desc="vae encode", total=episodes, unit="episode"),
                              vae, chunk, config.action_dim, stats, stride, policy)
    n = windows.latents.shape[0]

    prompt_ids = []
    for instruction in windows.instructions:
        pair = policy_prompt_pair(policy, instruction, entry["viewpoint"], entry["fps"], chunk, windows.canvas_hw)
        prompt_ids.append(tokenizer.encode(pair.cond, system_prompt=pair.system_prompt))
    negative_ids = tokenizer.encode(pair.uncond, system_prompt=pair.system_prompt)

    ema = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.99))
    warmup = min(200, steps // 10 + 1)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    raw_dim = entry["raw_action_dim"]
    latent_shape = tuple(windows.latents.shape[1:])
    layout = ActionLayout(chunk_size=chunk, num_prefix=1, clean_rows=(0,), domain_id=entry["domain_id"])
    packs, layouts = {}, {}

    def packed(ids: tuple[int, ...]):
        if ids not in packs:
            packs[ids] = pack_request(config, list(ids), latent_shape, [0], entry["fps"], layout)
        return packs[ids]

    def gen_layout(seq, kwargs):
        # The GEN layout depends on the text length only, not on which words fill it.
        if seq.und_len not in layouts:
            layouts[seq.und_len] = model.gen_layout(**kwargs)
        return layouts[seq.und_len]

    losses, action_losses, started = [], [], time.perf_counter()

    def save(trained_steps: int) -> dict:
        """Write the folder with the EMA weights after `trained_steps` steps, and last its training.json, the run's
        summary: a folder without one was cut short while written."""
        (out_dir / SUMMARY_FILE).unlink(missing_ok=True)
        embedded.write_pipeline_folder(out_dir, ema, vae, tokenizer, stats, policy, entry)
        summary = {
            "name": policy.name,
            "embodiment": entry["name"],
            "domain_id": entry["domain_id"],
            "steps": trained_steps,
            "batch_size": batch_size,
            "windows": n,
            "episodes": episodes,
            "instructions": windows.instructions,
            "final_loss": float(np.mean(losses[-100:])),
            "final_action_mse": float(np.mean(action_losses[-100:])),
            "seconds": time.perf_counter() - started,
            "params": sum(p.numel() for p in model.parameters()),
            "init": str(init_from) if init_from is not None else "scratch",
        }
        written = out_dir / f"{SUMMARY_FILE}.part"  # then renamed: a Ctrl-C leaves the whole file or none
        written.write_text(json.dumps(summary, indent=2) + "\n")
        written.replace(out_dir / SUMMARY_FILE)
        return summary

    progress = tqdm(range(steps), desc="train policy", unit="step")
    for step in progress:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        index = torch.randint(0, n, (batch_size,), generator=generator)
        drop = torch.rand(batch_size, generator=generator) < PROMPT_DROPOUT
        sigmas = sample_sigmas(batch_size, policy.shift, generator)
        prompts = [tuple(negative_ids if drop[b] else prompt_ids[windows.prompt_index[index[b]]])
                   for b in range(batch_size)]
        # Each distinct prompt is prefilled once per step; samples whose prompts have the same length
        # share a GEN layout and run through the GEN stack as one batch.
        und_kv = {}
        for ids in set(prompts):
            seq = packed(ids)
            und_kv[ids] = model.prefill_und(seq.input_ids, seq.position_ids[:, : seq.und_len])
        by_length: dict[int, list[int]] = {}
        for b, ids in enumerate(prompts):
            by_length.setdefault(len(ids), []).append(b)
        optimizer.zero_grad(set_to_none=True)
        loss, action_loss = 0.0, 0.0
        for members in by_length.values():
            gens, targets_v, targets_a = [], [], []
            for b in members:
                i, sigma = int(index[b]), float(sigmas[b])
                x0_v = windows.latents[i]
                eps_v = torch.randn(x0_v.shape, generator=generator)
                x_v = (1 - sigma) * x0_v + sigma * eps_v
                x_v[:, 0] = x0_v[:, 0]
                x0_a = windows.actions[i]
                eps_a = torch.randn(x0_a.shape, generator=generator)
                eps_a[:, raw_dim:] = 0
                x_a = torch.cat([windows.states[i][None], (1 - sigma) * x0_a + sigma * eps_a])
                seq = packed(prompts[b])
                kwargs = seq.model_kwargs(x_v, x_a, sigma * 1000.0)
                gens.append(model.embed_gen(**kwargs, layout=gen_layout(seq, kwargs)))
                targets_v.append((eps_v - x0_v)[:, 1:])
                targets_a.append((eps_a - x0_a)[:, :raw_dim])
            gen = GenInput.stack(gens)
            out = model.gen_stack(gen, UndKV.stack([und_kv[prompts[b]] for b in members]))
            for row in range(len(members)):
                pred_v, _, pred_a = model.heads(out[row], gen)
                loss_v = (pred_v[0][0][:, 1:] - targets_v[row]).pow(2).mean()
                loss_a = (pred_a[0][1:, :raw_dim] - targets_a[row]).pow(2).mean()
                loss = loss + (loss_v + ACTION_LOSS_WEIGHT * loss_a) / batch_size
                action_loss += loss_a.item() / batch_size
        loss.backward()
        total = loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        with torch.no_grad():
            decay = min(ema_decay, (1 + step) / (10 + step))
            for p_ema, p in zip(ema.parameters(), model.parameters(), strict=True):
                p_ema.lerp_(p, 1 - decay)
        losses.append(total)
        action_losses.append(action_loss)
        if (step + 1) % log_every == 0 or step + 1 == steps:
            progress.set_postfix(loss=f"{np.mean(losses[-log_every:]):.4f}",
                                 action_mse=f"{np.mean(action_losses[-log_every:]):.4f}")
        if save_every and (step + 1) % save_every == 0 and step + 1 < steps:
            # A servable folder part-way through: evaluate it while training goes on, or keep it if stopped.
            save(step + 1)
    return save(steps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, nargs="+", required=True,
                        help="dataset folders, robots.datagen's or LeRobot v3.0/v2.x ones (their episodes are pooled)")
    parser.add_argument("--vae", type=Path, default=None,
                        help="the VAE folder that encodes the frames, which the folder written ships (default: "
                             "--init's vae, the shipped one's without --init or with --from-scratch)")
    parser.add_argument("--out", type=Path, required=True, help="pipeline folder to write")
    parser.add_argument("--name", default=None, help="the model name the server reports (default: --out's name)")
    parser.add_argument("--embodiment", default=None,
                        help="the embodiment to train and serve (default: the LeRobot dataset's robot_type, else "
                             f"the embedded {embedded.EMBODIMENT}); another name takes the dataset's layout")
    parser.add_argument("--domain-id", type=int, default=None,
                        help="its row of the action projections (default: the row the --init folder serves it on, "
                             "else its Cosmos3 one, else the first that no Cosmos3 embodiment uses and the --init "
                             "weights were not trained on)")
    parser.add_argument("--chunk-size", type=int, default=embedded.CHUNK_SIZE,
                        help=f"actions a tick ({embedded.CHUNK_SIZE})")
    parser.add_argument("--limits", type=Path, default=None,
                        help=f"JSON object of the embodiment's {', '.join(LIMIT_FIELDS)}")
    parser.add_argument("--steps", type=int, default=6000, help="training steps (6000)")
    parser.add_argument("--batch-size", type=int, default=32, help="training ticks per step (32)")
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (3e-4; warmup, then cosine)")
    parser.add_argument("--stride", type=int, default=1, help="take a training tick every N steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, batches and noise (0)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--save-every", type=int, default=None,
                        help="also write the folder every N steps (EMA weights so far)")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--init", type=Path, default=default_model_path(),
                       help="start from this pipeline folder's transformer (default: the shipped embedded one)")
    start.add_argument("--from-scratch", action="store_true", help="start from freshly initialised weights")
    args = parser.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--stride", args.stride),
                        ("--threads", args.threads), ("--save-every", args.save_every),
                        ("--chunk-size", args.chunk_size)):
        if value is not None and value < 1:
            parser.error(f"{flag} {value}: expected a positive integer")
    if not args.lr > 0:
        parser.error(f"--lr {args.lr}: expected a positive learning rate")
    if args.domain_id is not None and not NO_ACTION_DOMAIN_ID < args.domain_id < NUM_EMBODIMENT_DOMAINS:
        parser.error(f"--domain-id {args.domain_id}: expected 1 to {NUM_EMBODIMENT_DOMAINS - 1} (0 is Cosmos3's "
                     "no-action domain)")
    if args.name is not None and not args.name.strip():
        parser.error("--name is empty; expected the model name the server reports")
    torch.set_num_threads(args.threads)
    try:
        limits = None if args.limits is None else read_json(args.limits, EmbodimentConfigError)
        if limits is not None and not isinstance(limits, dict):
            raise EmbodimentConfigError(f"--limits {args.limits}: expected a JSON object")
        init_from = None if args.from_scratch else args.init
        vae = args.vae or (init_from or default_model_path()) / "vae"
        if args.vae is None and init_from is not None and init_from.is_dir() and not vae.is_dir():
            # most often its transformer/ folder, which loads: the VAE's "transformer/vae/config.json not found"
            # would not say that --init names the wrong level
            raise CheckpointError(f"--init {init_from}: no vae/ folder; expected a pipeline folder (transformer/, "
                                  "vae/, ...) as this script writes it, or the VAE's folder named with --vae")
        summary = train(args.data, vae, args.out, args.steps, args.batch_size, args.lr, args.seed,
                        args.stride, save_every=args.save_every,
                        init_from=init_from, embodiment=args.embodiment,
                        domain_id=args.domain_id, chunk=args.chunk_size, name=args.name, limits=limits)
    # --data, --vae, --init, --limits or --out
    except (OSError, DatasetError, CheckpointError, ConfigError, EmbodimentConfigError, PolicyConfigError) as error:
        parser.error(str(error))
    except KeyboardInterrupt:  # Ctrl-C: say what the folder holds, not where Python was
        saved = args.out / SUMMARY_FILE
        kept = (f"{args.out} holds the weights after step {json.loads(saved.read_text())['steps']} (--save-every)"
                if saved.is_file() else f"{args.out} holds no complete folder")
        parser.exit(130, f"{parser.prog}: interrupted; {kept}\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
