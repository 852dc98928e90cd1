"""The bearer token an ``authorization`` header carries, read from a file the same way by the server (which
wants it) and the client (which sends it)."""

from __future__ import annotations

from pathlib import Path

MAX_TOKEN_FILE_BYTES = 4096  # a token is tens of bytes; a path to a wrong, large file is not read whole


def read_token_file(path: Path) -> str:
    """The token is the file's content without surrounding whitespace: one run of printable ASCII, as an
    ``authorization`` header carries it. Raises `ValueError` naming what is wrong with the file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read auth token file {path}: {exc.strerror}") from None
    if len(raw) > MAX_TOKEN_FILE_BYTES:
        raise ValueError(f"auth token file {path} is over {MAX_TOKEN_FILE_BYTES} bytes; expected a single token")
    token = raw.strip().decode("latin-1")  # any byte decodes; the check below admits ASCII only
    if not token:
        raise ValueError(f"auth token file {path} is empty; expected a single token")
    return check_token(token, f"auth token in {path}")


def check_token(token: str, what: str = "auth token") -> str:
    """``token`` if an ``authorization`` header can carry it: one run of printable ASCII. Raises `ValueError` naming
    ``what`` was wrong, never the token itself."""
    if not token:
        raise ValueError(f"{what} is empty; expected a single token")
    if not all("!" <= ch <= "~" for ch in token):
        raise ValueError(f"{what} contains whitespace or a character that is not printable ASCII; expected a single "
                         "token")
    return token
