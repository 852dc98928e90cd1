"""Regenerate the checked-in Python stubs from ``protos/policy_server/v1/policy_server.proto``.

    python -m policy_server.v1.gen_proto           # rewrite policy_server/v1/policy_server_pb2*
    python -m policy_server.v1.gen_proto --check   # exit 1 if the checked-in stubs are stale

protoc names the generated modules after the proto's path (``policy_server/v1/...``), which is where
they live: the modules are importable (and their messages picklable) under the names they record,
and the descriptor keeps its canonical file name ``policy_server/v1/policy_server.proto`` (what
reflection clients such as grpcurl see).
"""

from __future__ import annotations

import argparse
import importlib.resources
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_FILE = Path("policy_server/v1/policy_server.proto")
STUB_DIR = Path(__file__).resolve().parent
GENERATED = ("policy_server_pb2.py", "policy_server_pb2.pyi", "policy_server_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) and write the three stub files into ``out_dir``."""
    from grpc_tools import protoc  # dev-only dependency, imported only when generating

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(
            [
                "protoc",
                f"--proto_path={PROTO_ROOT}",
                f"--proto_path={well_known}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                str(PROTO_FILE),
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc} on {PROTO_ROOT / PROTO_FILE}")
        written = []
        for name in GENERATED:
            target = out_dir / name
            target.write_text((Path(tmp) / PROTO_FILE.parent / name).read_text())
            written.append(target)
    return written


def stale_files(stub_dir: Path = STUB_DIR) -> list[str]:
    """Names of checked-in stubs that differ from a fresh generation (empty when up to date)."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        return [
            name
            for name in GENERATED
            if not (stub_dir / name).exists()
            or (stub_dir / name).read_text() != (Path(tmp) / name).read_text()
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="only report stale stubs (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: {STUB_DIR / name}", file=sys.stderr)
        return 1 if stale else 0
    for path in generate(STUB_DIR):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
