"""Regenerate the gRPC modules: `python -m proto.generate` (a test fails when they are stale)."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTOS = ("proto/tensor.proto", "proto/expert.proto", "proto/attention.proto")


def generate(out_dir: Path = REPO) -> None:
    from grpc_tools import protoc

    args = ["protoc", f"-I{REPO}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *PROTOS]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)
