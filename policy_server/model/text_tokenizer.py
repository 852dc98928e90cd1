"""Text tokenizer: a HuggingFace ``tokenizers`` tokenizer plus the chat template and generation specials.

A prompt becomes ``chat_template([system?], user=text, add_generation_prompt=True)`` tokenized,
followed by ``eos`` and ``<|vision_start|>`` (Cosmos3's "start of generation"); no end-of-generation
token. This is what diffusers' ``Cosmos3OmniPipeline.tokenize_prompt`` produces.

Tokenizer folders follow the HuggingFace layout: ``tokenizer.json`` and, optionally,
``tokenizer_config.json`` (``eos_token``, ``chat_template``), ``chat_template.jinja`` or
``chat_template.json``. A checkpoint keeps its folder under ``text_tokenizer/`` (or ``tokenizer/``).
Without a chat template the ChatML form Qwen uses is applied.

The embedded model ships a small byte-level BPE (vocabulary <= 512) at
``policy_server/assets/embedded/text_tokenizer/``. Rebuild it with::

    from policy_server.pipeline.prompts import tokenizer_training_corpus
    train_builtin_tokenizer(tokenizer_training_corpus(instructions)).save(folder)
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.sandbox
from jinja2.ext import loopcontrols
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from policy_server.json_file import read_json

START_OF_GENERATION_TOKEN = "<|vision_start|>"
TOKENIZER_SUBFOLDERS = ("text_tokenizer", "tokenizer")
BUILTIN_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "embedded" / "text_tokenizer"
BUILTIN_VOCAB_SIZE = 512

# Qwen-style control tokens; the built-in tokenizer ends prompts with <|im_end|> like Qwen3-VL.
BUILTIN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
BUILTIN_EOS_TOKEN = "<|im_end|>"

# ChatML, as Qwen's template renders plain-text system and user messages.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class TextTokenizerError(ValueError):
    """A tokenizer folder that is missing files or lacks a required special token."""


def _token_content(value: object) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or a serialized AddedToken."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template the way transformers does (sandboxed, trimmed blocks)."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class TextTokenizer:
    """Prompt text ↔ token ids for the UND (text) rows of a Cosmos3 sequence.

    Attributes:
        vocab_size: number of ids the tokenizer can emit, added tokens included.
        eos_token_id: id of the end-of-prompt token.
        start_of_generation_id: id of ``<|vision_start|>``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        eos_token: str,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.eos_token = eos_token
        self.chat_template = chat_template or CHATML_TEMPLATE
        self._template = _compile_template(self.chat_template)
        self._special_tokens = dict(special_tokens or {})
        self._special_tokens["eos_token"] = eos_token
        self.eos_token_id = self._required_id(eos_token, "eos token")
        self.start_of_generation_id = self._required_id(
            START_OF_GENERATION_TOKEN, "start-of-generation token"
        )

    def _required_id(self, token: str, what: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise TextTokenizerError(f"the tokenizer has no {what} {token!r}; a Cosmos3 prompt needs it")
        return token_id

    # ---- loading and saving -------------------------------------------------------------------

    @classmethod
    def from_dir(cls, folder: str | Path) -> TextTokenizer:
        """Load a HuggingFace tokenizer folder (``tokenizer.json``, ``tokenizer_config.json`` with the eos_token, and
        an optional chat template file)."""
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TextTokenizerError(
                f"no tokenizer.json in {folder}; expected a HuggingFace tokenizer folder"
            )
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # noqa: BLE001 - tokenizers raises a bare Exception for a file it cannot parse
            raise TextTokenizerError(f"{tokenizer_file}: not a tokenizers file ({error})") from None
        config_file = folder / "tokenizer_config.json"
        if not config_file.is_file():
            raise TextTokenizerError(f"no tokenizer_config.json in {folder}; expected one naming the end-of-prompt "
                                     f"eos_token, e.g. {BUILTIN_EOS_TOKEN!r}")
        config = read_json(config_file, TextTokenizerError)
        if not isinstance(config, dict):
            raise TextTokenizerError(f"{config_file}: expected a JSON object")
        special_tokens = {
            key: content for key in _SPECIAL_TOKEN_KEYS if (content := _token_content(config.get(key)))
        }
        eos_token = special_tokens.get("eos_token")
        if eos_token is None:
            given = "" if config.get("eos_token") is None else f" (eos_token {config['eos_token']!r} names none)"
            raise TextTokenizerError(
                f"{config_file} has no eos_token{given}; expected the end-of-prompt token, a string or an AddedToken's "
                f"object with its content, e.g. {BUILTIN_EOS_TOKEN!r}"
            )
        chat_template = cls._find_chat_template(folder, config)
        try:
            return cls(tokenizer, eos_token=eos_token, chat_template=chat_template, special_tokens=special_tokens)
        except jinja2.TemplateError as error:
            raise TextTokenizerError(f"{folder}: the chat template does not compile ({error})") from None
        except TextTokenizerError as error:  # a token a prompt needs that tokenizer.json does not hold
            raise TextTokenizerError(f"{tokenizer_file}: {error}") from None

    @staticmethod
    def _find_chat_template(folder: Path, config: dict) -> str | None:
        """The folder's chat template: chat_template.jinja, then tokenizer_config, then chat_template.json."""
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text()
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if isinstance(template, str):
            return template
        json_file = folder / "chat_template.json"
        if json_file.is_file():
            stored = read_json(json_file, TextTokenizerError)
            if not isinstance(stored, dict):
                raise TextTokenizerError(f"{json_file}: expected a JSON object with chat_template")
            return stored.get("chat_template")
        return None

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> TextTokenizer:
        """Load ``<checkpoint>/text_tokenizer/`` or ``<checkpoint>/tokenizer/``."""
        checkpoint_dir = Path(checkpoint_dir)
        for name in TOKENIZER_SUBFOLDERS:
            if (checkpoint_dir / name / "tokenizer.json").is_file():
                return cls.from_dir(checkpoint_dir / name)
        looked = ", ".join(str(checkpoint_dir / name / "tokenizer.json") for name in TOKENIZER_SUBFOLDERS)
        raise TextTokenizerError(f"no text tokenizer in {checkpoint_dir}; looked for {looked}")

    @classmethod
    def builtin(cls) -> TextTokenizer:
        """The small tokenizer shipped with the embedded model."""
        return cls.from_dir(BUILTIN_TOKENIZER_DIR)

    def save(self, folder: str | Path) -> Path:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (eos token, chat template)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._tokenizer.save(str(folder / "tokenizer.json"))
        config = {**self._special_tokens, "chat_template": self.chat_template}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return folder

    # ---- encoding ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def id_bound(self) -> int:
        """One past the largest id the tokenizer can emit: the rows a model's embedding needs (ids may have gaps, so
        it can exceed `vocab_size`)."""
        return 1 + max(self._tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)

    @property
    def special_token_ids(self) -> dict[str, int]:
        """Ids of the special tokens: eos, start of generation, and any others the config names."""
        ids = {key: self._tokenizer.token_to_id(tok) for key, tok in self._special_tokens.items()}
        ids = {key: i for key, i in ids.items() if i is not None}
        ids["start_of_generation"] = self.start_of_generation_id
        return ids

    @functools.cached_property
    def control_ids(self) -> frozenset[int]:
        """Ids of the tokens marked special (the chat template's markers, eos, ...), which a user's text must not
        hold: each would restructure the prompt the model sees."""
        return frozenset(i for i, token in self._tokenizer.get_added_tokens_decoder().items() if token.special)

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render ``[{"role": ..., "content": ...}, ...]`` to text."""
        return self._template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            add_vision_id=False, **self._special_tokens,
        )

    def tokenize(self, text: str) -> list[int]:
        """Ids of ``text`` as is: no template, no added specials (special-token text is recognised)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode(self, text: str, system_prompt: str | None = None) -> list[int]:
        """Ids of one prompt: chat template (optional system message) + eos + ``<|vision_start|>``."""
        messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        messages.append({"role": "user", "content": text})
        ids = self.tokenize(self.apply_chat_template(messages, add_generation_prompt=True))
        return ids + [self.eos_token_id, self.start_of_generation_id]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def train_builtin_tokenizer(texts: Iterable[str], vocab_size: int = BUILTIN_VOCAB_SIZE) -> TextTokenizer:
    """Train a byte-level BPE on ``texts``: 256 byte symbols, the Qwen control tokens, then merges
    up to ``vocab_size`` ids in total. Any text encodes (bytes are the fallback)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BUILTIN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return TextTokenizer(
        bpe, eos_token=BUILTIN_EOS_TOKEN, chat_template=CHATML_TEMPLATE,
        special_tokens={"pad_token": "<|endoftext|>"},
    )
