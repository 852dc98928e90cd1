"""`output_file`, the argparse type of every command's ``--out``: a path checked before the command runs, since a
bench, a calibration or a rollout takes minutes to hours and should not find out at its end that it cannot write."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def output_file(value: str) -> Path:
    """A file path whose folder exists (made here if missing) and takes a new file. A command's default must be a
    string: argparse converts only those, and a Path default would go unchecked until the command's end."""
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder; expected a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot write {path}: {error.strerror or error}") from None
    return path
