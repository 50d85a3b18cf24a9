"""The gateway stays thin: importing it (and its CLI command) loads no torch and no engine code,
and protobuf stays at its edge (habit 5): only the gRPC client imports generated `_pb2` modules."""
import subprocess
import sys

from tests.support.processes import REPO

FORBIDDEN = ("torch", "kernels", "modelfile", "attention_service", "expert_service")


def test_gateway_imports_no_torch_and_no_engine_packages():
    code = ("import sys, gateway.app, splitmoe.commands.serve_gateway, splitmoe.cli; splitmoe.cli.build_parser();"
            f"print([m for m in {FORBIDDEN!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_only_the_attention_client_imports_protobuf():
    importers = sorted(p.name for p in (REPO / "gateway").rglob("*.py") if "_pb2" in p.read_text())
    assert importers == ["attention_client.py"]
