"""Text tokenizer: built-in BPE, checkpoint folders, chat template and the Cosmos3 prompt specials."""

import json
import types

import jinja2
import pytest

from policy_server.model.text_tokenizer import (
    BUILTIN_SPECIAL_TOKENS,
    BUILTIN_TOKENIZER_DIR,
    BUILTIN_VOCAB_SIZE,
    START_OF_GENERATION_TOKEN,
    TextTokenizer,
    TextTokenizerError,
    train_builtin_tokenizer,
)
from policy_server.pipeline.prompts import (
    SYSTEM_PROMPT_VIDEO,
    action_prompt_pair,
    tokenizer_training_corpus,
)

# A Qwen-like template: default-free system block, trimmed blocks, raise_exception and tojson.
QWEN_LIKE_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role != 'system' %}
        {{- raise_exception('unsupported role ' + message.role|tojson) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""


@pytest.fixture(scope="module")
def builtin():
    return TextTokenizer.builtin()


def test_builtin_vocab_and_specials(builtin):
    assert BUILTIN_TOKENIZER_DIR.joinpath("tokenizer.json").is_file()
    assert 256 + len(BUILTIN_SPECIAL_TOKENS) < builtin.vocab_size <= BUILTIN_VOCAB_SIZE
    ids = builtin.special_token_ids
    assert ids["eos_token"] == builtin.eos_token_id
    assert ids["start_of_generation"] == builtin.start_of_generation_id
    sog = builtin.decode([builtin.start_of_generation_id], skip_special_tokens=False)
    assert sog == START_OF_GENERATION_TOKEN
    assert builtin.decode([builtin.eos_token_id], skip_special_tokens=False) == "<|im_end|>"


def test_encode_is_chat_template_plus_eos_and_start_of_generation(builtin):
    ids = builtin.encode("reach the red circle", system_prompt=SYSTEM_PROMPT_VIDEO)
    assert ids[-2:] == [builtin.eos_token_id, builtin.start_of_generation_id]
    text = builtin.decode(ids, skip_special_tokens=False)
    assert text == (
        f"<|im_start|>system\n{SYSTEM_PROMPT_VIDEO}<|im_end|>\n"
        "<|im_start|>user\nreach the red circle<|im_end|>\n<|im_start|>assistant\n"
        "<|im_end|><|vision_start|>"
    )
    no_system = builtin.decode(builtin.encode("reach the red circle"), skip_special_tokens=False)
    assert no_system.startswith("<|im_start|>user\n")


def test_round_trip_and_byte_fallback(builtin):
    for text in ["reach the yellow circle", '{"fps": 10.0, "resolution": {"H": 64}}', "Grüß dich ✓ 机器人"]:
        assert builtin.decode(builtin.tokenize(text)) == text
    # trained merges make the prompt vocabulary compact: far fewer tokens than bytes
    caption = action_prompt_pair(
        "reach the red circle", view_point="ego_view", num_frames=9, fps=10.0, height=64, width=64
    ).cond
    assert len(builtin.tokenize(caption)) < len(caption.encode()) / 3


def test_matches_diffusers_tokenize_prompt_layout(builtin):
    """Run diffusers' tokenize_prompt with a tokenizer object backed by ours (render, then tokenize
    without added specials, as transformers' apply_chat_template does) and compare ids."""
    diffusers_pipeline = pytest.importorskip("diffusers.pipelines.cosmos.pipeline_cosmos3_omni")
    pipeline_cls = diffusers_pipeline.Cosmos3OmniPipeline

    def apply_chat_template(conversations, tokenize, add_generation_prompt, add_vision_id, return_dict):
        assert tokenize and return_dict and add_generation_prompt and add_vision_id is False
        text = builtin.apply_chat_template(conversations, add_generation_prompt=add_generation_prompt)
        return types.SimpleNamespace(input_ids=builtin.tokenize(text))

    fake = types.SimpleNamespace(
        config=types.SimpleNamespace(default_use_system_prompt=True),
        text_tokenizer=types.SimpleNamespace(apply_chat_template=apply_chat_template),
        llm_special_tokens={
            "eos_token_id": builtin.eos_token_id,
            "start_of_generation": builtin.start_of_generation_id,
        },
        _build_action_json_prompt=pipeline_cls._build_action_json_prompt,
        image_resolution_template="", video_resolution_template="",
        inverse_image_resolution_template="", inverse_video_resolution_template="",
        duration_template="", inverse_duration_template="",
    )
    for use_system in (True, False):
        cond_ref, uncond_ref = pipeline_cls.tokenize_prompt(
            fake, "reach the blue circle", None, num_frames=9, height=64, width=64, fps=10.0,
            use_system_prompt=use_system, action_mode="policy", action_view_point="ego_view",
        )
        pair = action_prompt_pair(
            "reach the blue circle", view_point="ego_view", num_frames=9, fps=10.0, height=64, width=64,
            use_system_prompt=use_system,
        )
        assert builtin.encode(pair.cond, system_prompt=pair.system_prompt) == cond_ref
        assert builtin.encode(pair.uncond, system_prompt=pair.system_prompt) == uncond_ref


def test_training_is_reproducible_and_bounded():
    corpus = tokenizer_training_corpus(["reach the red circle", "reach the green circle"])
    a = train_builtin_tokenizer(corpus, vocab_size=300)
    b = train_builtin_tokenizer(corpus, vocab_size=300)
    assert a.vocab_size <= 300
    assert a.encode("reach the red circle") == b.encode("reach the red circle")


def test_shipped_tokenizer_is_the_default_rebuild(builtin):
    rebuilt = train_builtin_tokenizer(tokenizer_training_corpus())
    assert rebuilt.vocab_size == builtin.vocab_size
    sample = tokenizer_training_corpus(["reach the green circle"])
    assert [rebuilt.tokenize(t) for t in sample] == [builtin.tokenize(t) for t in sample]


def write_checkpoint_tokenizer(folder, *, template_in="config", eos="<|im_end|>"):
    trained = train_builtin_tokenizer(["reach the red circle"] * 4, vocab_size=280)
    trained.save(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": eos, "special": True}  # serialized AddedToken form
    del config["chat_template"]
    if template_in == "config":
        config["chat_template"] = QWEN_LIKE_TEMPLATE
    elif template_in == "jinja":
        (folder / "chat_template.jinja").write_text(QWEN_LIKE_TEMPLATE)
    elif template_in == "json":
        (folder / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_LIKE_TEMPLATE}))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("template_in", ["config", "jinja", "json", "none"])
@pytest.mark.parametrize("subfolder", ["text_tokenizer", "tokenizer"])
def test_checkpoint_folder(tmp_path, template_in, subfolder):
    write_checkpoint_tokenizer(tmp_path / subfolder, template_in=template_in)
    tok = TextTokenizer.from_checkpoint(tmp_path)
    expected = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nreach<|im_end|>\n<|im_start|>assistant\n"
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "reach"}]
    rendered = tok.apply_chat_template(messages)
    assert rendered == expected  # trimmed blocks: no stray whitespace from the template layout
    ids = tok.encode("reach", system_prompt="S")
    assert ids == tok.tokenize(expected) + [tok.eos_token_id, tok.start_of_generation_id]


def test_template_errors_surface(tmp_path):
    write_checkpoint_tokenizer(tmp_path / "text_tokenizer")
    tok = TextTokenizer.from_checkpoint(tmp_path)
    with pytest.raises(jinja2.TemplateError, match='unsupported role "tool"'):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_missing_files_and_tokens(tmp_path):
    with pytest.raises(TextTokenizerError, match="looked for .*text_tokenizer/tokenizer.json"):
        TextTokenizer.from_checkpoint(tmp_path)
    with pytest.raises(TextTokenizerError, match="no tokenizer.json"):
        TextTokenizer.from_dir(tmp_path)
    write_checkpoint_tokenizer(tmp_path / "a", eos="<|not_there|>")
    with pytest.raises(TextTokenizerError, match=r"no eos token '<\|not_there\|>'"):
        TextTokenizer.from_dir(tmp_path / "a")
    write_checkpoint_tokenizer(tmp_path / "b")
    (tmp_path / "b" / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TextTokenizerError, match="has no eos_token"):
        TextTokenizer.from_dir(tmp_path / "b")


def test_a_bad_chat_template_file_is_named_alone(tmp_path):
    """Its error came out as tokenizer.json's, 'F/tokenizer.json: F/chat_template.json: expected ...'."""
    folder = tmp_path / "text_tokenizer"
    write_checkpoint_tokenizer(folder, template_in="none")
    for text in ("[]", "{"):
        (folder / "chat_template.json").write_text(text)
        with pytest.raises(TextTokenizerError) as err:
            TextTokenizer.from_dir(folder)
        assert str(err.value).startswith(f"{folder / 'chat_template.json'}: "), err.value
