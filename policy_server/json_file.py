"""The size cap on a checkpoint's JSON files (config.json, model_index.json, shard indexes, scheduler and tokenizer
configs, policy.json, embodiments.json, normalisation stats, the quality profile): each is read whole, so a huge
one would hold the loader and its memory for nothing.

    check_json_size(path, CheckpointError)  # before reading `path`
"""

from __future__ import annotations

from pathlib import Path

# Diffusers' configs are a few kB and a 14B-parameter model's shard index about 100 kB: 16 MiB is far more than any
# checkpoint's JSON holds, and reads in well under a second.
MAX_JSON_FILE_BYTES = 16 << 20


def check_json_size(path: Path, error: type[Exception]) -> None:
    """Raise ``error`` (the reader's own) naming ``path``, its size and the cap if it is over
    ``MAX_JSON_FILE_BYTES``. A file that cannot be looked at is left to its reader, which says why."""
    try:
        size = path.stat().st_size
    except OSError:
        return
    if size > MAX_JSON_FILE_BYTES:
        raise error(f"{path}: {size} bytes; expected a JSON file of at most {MAX_JSON_FILE_BYTES >> 20} MiB "
                    f"({MAX_JSON_FILE_BYTES} bytes)")
