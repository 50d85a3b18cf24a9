"""Regenerate the gRPC modules: `python -m splitmoe.proto.generate` (a test fails when they are stale).

protoc names a generated module's imports after where it found the .proto files, so they are
staged at splitmoe/proto/ in a temporary directory: the modules then import `splitmoe.proto.*`,
the package they are installed as.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTOS = ("proto/tensor.proto", "proto/expert.proto", "proto/attention.proto")


def generate(out_dir: Path = REPO) -> None:
    """Write proto/<name>_pb2.py, .pyi and _pb2_grpc.py under `out_dir`."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        staged, built = Path(tmp) / "src", Path(tmp) / "out"
        (staged / "splitmoe" / "proto").mkdir(parents=True)
        built.mkdir()
        for proto in PROTOS:
            shutil.copy(REPO / proto, staged / "splitmoe" / proto)
        args = ["protoc", f"-I{staged}", f"--python_out={built}", f"--pyi_out={built}", f"--grpc_python_out={built}",
                *(f"splitmoe/{proto}" for proto in PROTOS)]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        (out_dir / "proto").mkdir(parents=True, exist_ok=True)
        for made in (built / "splitmoe" / "proto").iterdir():
            shutil.copy(made, out_dir / "proto" / made.name)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)
