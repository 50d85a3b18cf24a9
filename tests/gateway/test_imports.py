"""Protobuf stays at the gateway's edge (habit 5): only the gRPC client imports generated `_pb2`
modules. That the gateway loads no torch and no engine package is tests/test_import_rules.py's."""
from tests.support.processes import REPO


def test_only_the_attention_client_imports_protobuf():
    importers = sorted(str(p.relative_to(REPO / "gateway")) for p in (REPO / "gateway").rglob("*.py")
                       if "_pb2" in p.read_text())
    assert importers == ["attention_client.py"]
