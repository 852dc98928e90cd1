"""Prompt text for Cosmos3 generation: the structured action caption, metadata templates, CFG pairs.

Action runs (policy, forward and inverse dynamics) condition on a JSON caption of the form the
action models were trained on (field names as in diffusers' ``_build_action_json_prompt``)::

    {"cinematography": {"framing": "<viewpoint sentence>"},
     "actions": [{"time": "0:00-0:01", "description": "Push the red block to the goal."}],
     "duration": "1s", "fps": 15.0, "resolution": {"H": 480, "W": 640}, "aspect_ratio": "4,3"}

Their CFG negative is the caller's negative prompt verbatim, by default the empty string (no JSON,
no inverse templates). Plain video prompts instead get "The video is ... seconds long ..." and
"This video is of HxW resolution." appended, and their negatives the "is not ..." forms.
The chat template and the eos / start-of-generation tokens are added by the text tokenizer.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass

from policy_server.pipeline.errors import PolicyInputError

SYSTEM_PROMPT_IMAGE = "You are a helpful assistant who will generate images from a give prompt."
SYSTEM_PROMPT_VIDEO = "You are a helpful assistant who will generate videos from a give prompt."

# Viewpoint -> the exact framing sentence the action models were trained with.
ACTION_VIEWPOINT_FRAMING = {
    "ego_view": "This video is captured from a first-person perspective looking at the scene.",
    "third_person_view": (
        "This video is captured from a third-person perspective looking towards the agent from the front."
    ),
    "wrist_view": "This video is captured from a wrist-mounted camera.",
    "concat_view": "This video contains concatenated views from multiple camera perspectives.",
}
VIEWPOINTS = tuple(ACTION_VIEWPOINT_FRAMING)
DEFAULT_VIEWPOINT = "ego_view"

# Candidate aspect ratios "W,H"; the caption names the one closest to width / height (first wins ties).
ASPECT_RATIOS = ("1,1", "4,3", "3,4", "16,9", "9,16")

DURATION_TEMPLATE = "The video is {duration:.1f} seconds long and is of {fps:.0f} FPS."
INVERSE_DURATION_TEMPLATE = "The video is not {duration:.1f} seconds long and is not of {fps:.0f} FPS."
IMAGE_RESOLUTION_TEMPLATE = "This image is of {height}x{width} resolution."
VIDEO_RESOLUTION_TEMPLATE = "This video is of {height}x{width} resolution."
INVERSE_IMAGE_RESOLUTION_TEMPLATE = "This image is not of {height}x{width} resolution."
INVERSE_VIDEO_RESOLUTION_TEMPLATE = "This video is not of {height}x{width} resolution."


@dataclass(frozen=True)
class PromptPair:
    """The two CFG branches' texts before the chat template.

    Attributes:
        cond: the conditional prompt.
        uncond: the unconditional (negative) prompt.
        system_prompt: the system message for both branches, or None for none.
    """

    cond: str
    uncond: str
    system_prompt: str | None


def system_prompt_for(num_frames: int) -> str:
    """The image system prompt for single frames, the video one otherwise (action clips are K + 1 frames)."""
    return SYSTEM_PROMPT_IMAGE if num_frames == 1 else SYSTEM_PROMPT_VIDEO


def _check_geometry(num_frames: int, fps: float, height: int, width: int) -> None:
    if num_frames < 1 or not math.isfinite(fps) or fps <= 0 or height < 1 or width < 1:
        raise ValueError(
            f"got num_frames={num_frames}, fps={fps}, height={height}, width={width}; "
            "expected num_frames >= 1, a finite fps > 0 and a positive height and width"
        )


def closest_aspect_ratio(height: int, width: int) -> str:
    """The entry of ASPECT_RATIOS ("W,H") closest to ``width / height``."""
    ratio = width / height

    def distance(entry: str) -> float:
        w, h = entry.split(",")
        return abs(int(w) / int(h) - ratio)

    return min(ASPECT_RATIOS, key=distance)


def build_action_prompt(
    instruction: str,
    *,
    view_point: str | None,
    num_frames: int,
    fps: float,
    height: int,
    width: int,
) -> str:
    """The JSON action caption for one request.

    Args:
        instruction: what the robot should do; becomes the action description (a final period is added).
        view_point: a key of ACTION_VIEWPOINT_FRAMING, or None to leave out ``cinematography``.
        num_frames: pixel frames of the clip (chunk size + 1).
        fps: frames per second of the clip.
        height, width: the conditioning canvas in pixels.
    """
    _check_geometry(num_frames, fps, height, width)
    if view_point is not None and view_point not in ACTION_VIEWPOINT_FRAMING:
        raise PolicyInputError(
            "view_point", f"unknown viewpoint {view_point!r}; expected one of {', '.join(VIEWPOINTS)}"
        )
    duration_s = num_frames / fps
    # The caption's time span rounds the clip length, its "duration" truncates it, as in training.
    minutes, seconds = divmod(round(duration_s), 60)
    description = instruction.strip()
    if description and not description.endswith((".", "!", "?")):
        description += "."

    caption: dict[str, object] = {}
    if view_point is not None:
        caption["cinematography"] = {"framing": ACTION_VIEWPOINT_FRAMING[view_point]}
    caption["actions"] = [{"time": f"0:00-{minutes}:{seconds:02d}", "description": description}]
    caption["duration"] = f"{int(duration_s)}s"
    caption["fps"] = float(fps)
    caption["resolution"] = {"H": int(height), "W": int(width)}
    caption["aspect_ratio"] = closest_aspect_ratio(height, width)
    return json.dumps(caption)


def with_metadata(
    text: str,
    *,
    num_frames: int,
    fps: float,
    height: int,
    width: int,
    negative: bool = False,
    add_duration: bool = True,
    add_resolution: bool = True,
) -> str:
    """Append the duration (videos only) and resolution sentences; the "is not" forms for negatives."""
    _check_geometry(num_frames, fps, height, width)
    is_image = num_frames == 1
    if not is_image and add_duration:
        template = INVERSE_DURATION_TEMPLATE if negative else DURATION_TEMPLATE
        text = _append_sentence(text, template.format(duration=num_frames / fps, fps=fps))
    if add_resolution:
        if is_image:
            template = INVERSE_IMAGE_RESOLUTION_TEMPLATE if negative else IMAGE_RESOLUTION_TEMPLATE
        else:
            template = INVERSE_VIDEO_RESOLUTION_TEMPLATE if negative else VIDEO_RESOLUTION_TEMPLATE
        text = _append_sentence(text, template.format(height=height, width=width))
    return text


def _append_sentence(base: str, sentence: str) -> str:
    base = base.rstrip(".")
    return f"{base}. {sentence}" if base else sentence


def action_prompt_pair(
    instruction: str,
    *,
    view_point: str | None,
    num_frames: int,
    fps: float,
    height: int,
    width: int,
    negative_prompt: str | None = None,
    use_system_prompt: bool = True,
) -> PromptPair:
    """Cond = the JSON action caption; uncond = ``negative_prompt`` as given (default "")."""
    cond = build_action_prompt(
        instruction, view_point=view_point, num_frames=num_frames, fps=fps, height=height, width=width
    )
    system = system_prompt_for(num_frames) if use_system_prompt else None
    return PromptPair(cond=cond, uncond=negative_prompt or "", system_prompt=system)


def video_prompt_pair(
    prompt: str,
    *,
    num_frames: int,
    fps: float,
    height: int,
    width: int,
    negative_prompt: str | None = None,
    use_system_prompt: bool = True,
    add_duration: bool = True,
    add_resolution: bool = True,
) -> PromptPair:
    """Plain text/image/video prompts with metadata sentences; the negative gets the inverse ones."""
    geometry = dict(
        num_frames=num_frames, fps=fps, height=height, width=width,
        add_duration=add_duration, add_resolution=add_resolution,
    )
    cond = with_metadata(prompt, **geometry)
    uncond = with_metadata(negative_prompt or "", negative=True, **geometry)
    system = system_prompt_for(num_frames) if use_system_prompt else None
    return PromptPair(cond=cond, uncond=uncond, system_prompt=system)


# Words of short manipulation instructions, for training the small built-in text tokenizer.
_VERBS = ("push", "move", "slide", "reach", "touch", "go to", "bring", "pick up", "place", "put")
_COLOURS = ("red", "green", "blue", "yellow", "orange", "purple", "white", "black")
_OBJECTS = ("block", "cube", "ball", "circle", "square", "triangle", "object", "target", "goal", "T")
_PLACES = ("the goal", "the target", "the left", "the right", "the top", "the bottom", "the center",
           "the corner", "the green zone", "the red zone")


def default_instructions() -> list[str]:
    """A generic vocabulary of planar manipulation instructions ("push the red block to the goal")."""
    out = []
    for verb, colour, obj in itertools.product(_VERBS, _COLOURS, _OBJECTS):
        out.append(f"{verb} the {colour} {obj}")
    for verb, (colour, obj), place in itertools.product(
        ("push", "move", "slide", "bring", "place", "put"), [("red", "block"), ("blue", "ball")], _PLACES
    ):
        out.append(f"{verb} the {colour} {obj} to {place}")
    return out


def tokenizer_training_corpus(instructions: list[str] | None = None) -> list[str]:
    """Every kind of text the embedded model's prompts contain, for training its tokenizer.

    Covers the system prompts, the action captions for each instruction across viewpoints and a few
    clip geometries, the metadata sentences, and the instructions themselves.
    """
    instructions = default_instructions() if instructions is None else list(instructions)
    corpus = [SYSTEM_PROMPT_IMAGE, SYSTEM_PROMPT_VIDEO, *instructions]
    geometries = itertools.cycle(
        [(9, 10.0, 64, 64), (17, 20.0, 96, 96), (33, 15.0, 480, 640), (17, 5.0, 256, 320), (9, 24.0, 64, 96)]
    )
    for instruction, view_point in itertools.product(instructions, (*VIEWPOINTS, None)):
        num_frames, fps, height, width = next(geometries)
        corpus.append(
            build_action_prompt(
                instruction, view_point=view_point, num_frames=num_frames, fps=fps, height=height, width=width
            )
        )
        corpus.append(with_metadata(instruction, num_frames=num_frames, fps=fps, height=height, width=width))
        corpus.append(
            with_metadata("", num_frames=num_frames, fps=fps, height=height, width=width, negative=True)
        )
    return corpus
