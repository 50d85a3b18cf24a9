"""proto/generate.py: the committed gRPC modules are exactly what the .proto files generate."""
import pytest

from splitmoe.proto.generate import PROTOS, REPO, generate


def test_generated_modules_are_up_to_date(tmp_path):
    pytest.importorskip("grpc_tools")
    generate(tmp_path)
    stale = []
    for proto in PROTOS:
        stem = proto.removesuffix(".proto")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            if (tmp_path / f"{stem}{suffix}").read_bytes() != (REPO / f"{stem}{suffix}").read_bytes():
                stale.append(f"{stem}{suffix}")
    assert not stale, f"run `python -m splitmoe.proto.generate`: stale {stale}"
