"""Checkpoint references: a local folder, or a Hugging Face Hub repository id (`org/name`, `org/name@revision`).

A Hub id resolves through `huggingface_hub.snapshot_download`, so the user's usual cache (`HF_HOME`,
`HF_HUB_CACHE`), token and offline mode (`HF_HUB_OFFLINE=1`: the cache only) apply. Nothing is downloaded
unless the reference names a Hub repository that is not a local path.
"""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$", re.ASCII)


class CheckpointNotFound(ValueError):
    """A checkpoint reference that names neither a local folder nor a Hub repository that could be fetched."""


def _hub_reference(reference: str | Path) -> re.Match | None:
    """`reference` parsed as a Hub id, None when it is not one: its repository id breaks the Hub's naming rule, or
    its revision climbs out with '..'."""
    from huggingface_hub.errors import HFValidationError  # imported here: local checkpoints do not need it
    from huggingface_hub.utils import validate_repo_id

    match = HUB_ID.match(str(reference))
    if match is None or ".." in (match["revision"] or "").split("/"):
        return None
    try:
        validate_repo_id(match["repo"])
    except HFValidationError:
        return None
    return match


def is_hub_id(reference: str | Path) -> bool:
    """True when `reference` is not a local path and has the form of a Hub id."""
    return not Path(reference).exists() and _hub_reference(reference) is not None


def checkpoint_folder(reference: str | Path) -> Path:
    """The local folder `reference` names: itself when it exists, else the Hub repository's snapshot (fetched
    into the Hugging Face cache unless it is there already)."""
    if not is_hub_id(reference):
        return Path(reference)
    from huggingface_hub import snapshot_download  # imported here: local checkpoints do not need it
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    match = _hub_reference(reference)
    try:
        return Path(snapshot_download(match["repo"], revision=match["revision"]))
    except LocalEntryNotFoundError as exc:
        raise CheckpointNotFound(
            f"checkpoint {str(reference)!r} is not a local path, and the Hugging Face Hub repository is not in the "
            f"cache while the Hub cannot be reached (HF_HUB_OFFLINE=1, or no network): {_one_line(exc)}") from exc
    except (HfHubHTTPError, OSError) as exc:
        raise CheckpointNotFound(
            f"checkpoint {str(reference)!r} is not a local path, and fetching it from the Hugging Face Hub "
            f"failed: {_one_line(exc)}") from exc


def _one_line(error: Exception) -> str:
    """huggingface_hub's message on one line: the server's error is one line of its log and stderr."""
    return " ".join(str(error).split())
