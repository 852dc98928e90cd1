"""Prompt text: the JSON action caption and the CFG pairs, checked against diffusers' pipeline."""

import inspect
import json
import re
import types

import pytest

from policy_server.pipeline.errors import PolicyInputError
from policy_server.pipeline.prompts import (
    ACTION_VIEWPOINT_FRAMING,
    SYSTEM_PROMPT_IMAGE,
    SYSTEM_PROMPT_VIDEO,
    action_prompt_pair,
    build_action_prompt,
    closest_aspect_ratio,
    default_instructions,
    tokenizer_training_corpus,
    video_prompt_pair,
    with_metadata,
)

omni = pytest.importorskip("diffusers.pipelines.cosmos.pipeline_cosmos3_omni")
Pipeline = omni.Cosmos3OmniPipeline

CASES = [
    # instruction, view_point, num_frames, fps, height, width
    ("reach the red circle", "ego_view", 9, 10.0, 64, 64),
    ("Pick up the cup!", "third_person_view", 33, 15.0, 480, 640),
    ("  put the spoon in the bowl  ", "wrist_view", 17, 5.0, 544, 736),
    ("stack blocks?", "concat_view", 17, 20.0, 192, 320),
    ("move left.", None, 189, 24.0, 720, 1280),
    ("wave", "ego_view", 91, 1.5, 1280, 720),  # 60.67 s: minutes field
    ("", "ego_view", 5, 2.0, 100, 100),  # 2.5 s rounds to 2 (banker's rounding, as Python's round)
]


@pytest.mark.parametrize("instruction,view_point,num_frames,fps,height,width", CASES)
def test_action_caption_matches_diffusers(instruction, view_point, num_frames, fps, height, width):
    ours = build_action_prompt(
        instruction, view_point=view_point, num_frames=num_frames, fps=fps, height=height, width=width
    )
    ref = Pipeline._build_action_json_prompt(
        instruction, view_point=view_point, num_frames=num_frames, fps=fps, height=height, width=width
    )
    assert ours == ref


def test_caption_fields():
    caption = json.loads(
        build_action_prompt(
            "reach the red circle", view_point="ego_view", num_frames=9, fps=10, height=64, width=96
        )
    )
    assert list(caption) == ["cinematography", "actions", "duration", "fps", "resolution", "aspect_ratio"]
    assert caption["cinematography"]["framing"] == ACTION_VIEWPOINT_FRAMING["ego_view"]
    assert caption["actions"] == [{"time": "0:00-0:01", "description": "reach the red circle."}]
    assert caption["duration"] == "0s"
    assert caption["fps"] == 10.0
    assert caption["resolution"] == {"H": 64, "W": 96}
    assert caption["aspect_ratio"] == "4,3"  # 1.5 is nearer 4/3 than 16/9


def test_viewpoint_table_matches_diffusers():
    assert ACTION_VIEWPOINT_FRAMING == omni._ACTION_VIEWPOINT_TEMPLATES
    assert SYSTEM_PROMPT_IMAGE == omni._SYSTEM_PROMPT_IMAGE
    assert SYSTEM_PROMPT_VIDEO == omni._SYSTEM_PROMPT_VIDEO


@pytest.mark.parametrize(
    "height,width,expected",
    [(64, 64, "1,1"), (480, 640, "4,3"), (640, 480, "3,4"), (720, 1280, "16,9"), (1280, 720, "9,16"),
     (100, 1000, "16,9")],
)
def test_closest_aspect_ratio(height, width, expected):
    assert closest_aspect_ratio(height, width) == expected


def diffusers_texts(**kwargs):
    """Run diffusers' tokenize_prompt with a recording tokenizer; return (cond, uncond) conversations."""
    seen = []

    def apply_chat_template(conversations, **_):
        seen.append(conversations)
        return types.SimpleNamespace(input_ids=[])

    # The metadata templates are set in the pipeline's __init__; read them from its source.
    init_source = inspect.getsource(Pipeline.__init__)
    templates = dict(re.findall(r'self\.(\w+_template) = "([^"]*)"', init_source))
    assert len(templates) == 6
    fake = types.SimpleNamespace(
        config=types.SimpleNamespace(default_use_system_prompt=True),
        text_tokenizer=types.SimpleNamespace(apply_chat_template=apply_chat_template),
        llm_special_tokens={"eos_token_id": 0, "start_of_generation": 1},
        _build_action_json_prompt=Pipeline._build_action_json_prompt,
        **templates,
    )
    Pipeline.tokenize_prompt(fake, **kwargs)
    return seen


def as_conversation(text, system):
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


@pytest.mark.parametrize("negative", [None, "blurry, static robot"])
@pytest.mark.parametrize("use_system", [True, False])
def test_action_pair_matches_diffusers(negative, use_system):
    cond, uncond = diffusers_texts(
        prompt="pick up the cup", negative_prompt=negative, num_frames=17, height=480, width=640, fps=15.0,
        use_system_prompt=use_system, action_mode="policy", action_view_point="wrist_view",
    )
    pair = action_prompt_pair(
        "pick up the cup", view_point="wrist_view", num_frames=17, fps=15.0, height=480, width=640,
        negative_prompt=negative, use_system_prompt=use_system,
    )
    assert as_conversation(pair.cond, pair.system_prompt) == cond
    assert as_conversation(pair.uncond, pair.system_prompt) == uncond
    assert pair.uncond == (negative or "")


@pytest.mark.parametrize("num_frames", [1, 93])
@pytest.mark.parametrize("negative", [None, "ugly."])
@pytest.mark.parametrize("add_duration,add_resolution", [(True, True), (False, True), (True, False)])
def test_video_pair_matches_diffusers(num_frames, negative, add_duration, add_resolution):
    cond, uncond = diffusers_texts(
        prompt="A robot arm sorts fruit.", negative_prompt=negative, num_frames=num_frames, height=480,
        width=832, fps=24.0, add_duration_template=add_duration, add_resolution_template=add_resolution,
    )
    pair = video_prompt_pair(
        "A robot arm sorts fruit.", num_frames=num_frames, fps=24.0, height=480, width=832,
        negative_prompt=negative, add_duration=add_duration, add_resolution=add_resolution,
    )
    assert as_conversation(pair.cond, pair.system_prompt) == cond
    assert as_conversation(pair.uncond, pair.system_prompt) == uncond


def test_metadata_sentences():
    text = with_metadata("A cat.", num_frames=93, fps=24.0, height=480, width=832)
    assert text == (
        "A cat. The video is 3.9 seconds long and is of 24 FPS. This video is of 480x832 resolution."
    )
    negative = with_metadata("", num_frames=1, fps=24.0, height=64, width=64, negative=True)
    assert negative == "This image is not of 64x64 resolution."


def test_bad_inputs():
    with pytest.raises(PolicyInputError) as info:
        build_action_prompt("x", view_point="top_view", num_frames=9, fps=10, height=64, width=64)
    assert info.value.field == "view_point" and "ego_view" in str(info.value)
    with pytest.raises(ValueError, match="finite fps > 0"):
        build_action_prompt("x", view_point=None, num_frames=9, fps=0, height=64, width=64)
    with pytest.raises(ValueError, match="num_frames >= 1"):
        with_metadata("x", num_frames=0, fps=10, height=64, width=64)


def test_training_corpus_covers_prompts():
    corpus = tokenizer_training_corpus(["reach the red circle"])
    assert SYSTEM_PROMPT_VIDEO in corpus
    assert any('"description": "reach the red circle."' in text for text in corpus)
    assert all(any(sentence in text for text in corpus) for sentence in ACTION_VIEWPOINT_FRAMING.values())
    assert "reach the red circle" in default_instructions()
