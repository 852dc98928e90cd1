"""Reading a checkpoint's JSON files (config.json, model_index.json, shard indexes, scheduler and tokenizer
configs, policy.json, embodiments.json, normalisation stats, the quality profile): each is read whole, so at most
`MAX_JSON_FILE_BYTES` of it are, and a huge one holds neither the loader nor its memory.

    config = read_json(path, CheckpointError)  # the parsed content; CheckpointError names the file and the fault
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Diffusers' configs are a few kB and a 14B-parameter model's shard index about 100 kB: 16 MiB is far more than any
# checkpoint's JSON holds, and reads in well under a second.
MAX_JSON_FILE_BYTES = 16 << 20


def read_json(path: Path, error: type[Exception]) -> Any:
    """The parsed content of the JSON file ``path``. Raises ``error`` (the reader's own) naming ``path`` and what
    is wrong: it cannot be read (the OS's reason), is over ``MAX_JSON_FILE_BYTES``, is not UTF-8, is not JSON, or
    is nested more deeply than the parser can follow."""
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_JSON_FILE_BYTES + 1)  # bounded: a file that grows after a size check is not read whole
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror})") from None
    if len(raw) > MAX_JSON_FILE_BYTES:
        raise error(f"{path}: more than {MAX_JSON_FILE_BYTES} bytes; expected a JSON file of at most "
                    f"{MAX_JSON_FILE_BYTES >> 20} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: byte {exc.start} is not UTF-8; expected a JSON file in UTF-8") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    except RecursionError as exc:  # the parser recurses once per level of nesting: "[" * 100_000 takes it too deep
        raise error(f"{path}: JSON nested too deeply to parse ({exc})") from None
