"""`output_file`, the argparse type of every command's ``--out``: a path checked before the command runs, since a
bench, a calibration or a rollout takes minutes to hours and should not find out at its end that it cannot write;
`report_file` for a JSON report whose PNG summary goes beside it."""

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


def report_file(value: str) -> Path:
    """`output_file` for a JSON report whose PNG summary goes beside it (the same path with .png): not a .png path,
    which the summary would overwrite."""
    path = output_file(value)
    if path.suffix == ".png":
        raise argparse.ArgumentTypeError(f"{path}: the JSON report's path, whose PNG summary goes beside it as "
                                         f"{path.name}; expected another suffix, such as .json")
    return path
