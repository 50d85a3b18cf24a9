"""The dependency rules the README states ("Layout"), checked on every import in the source,
function-local ones included: which of our packages each package may import, and which outside
libraries it must not."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import REPO
from tests.test_packaging import product_folders

SERVICE_FLOOR = {"kernels", "proto", "modelfile", "runtime"}
TOP = {"cli", "commands", "supervisor", "local_stack", "demo_model", "demo"}  # the CLI and what only it runs
# package -> ours it may import (besides itself); `splitmoe` alone is the package's __init__
MAY_IMPORT = {
    "kernels": set(),
    "proto": set(),
    "runtime": set(),
    "modelfile": {"kernels"},
    "attention_service": SERVICE_FLOOR,
    "expert_service": SERVICE_FLOOR,
    "gateway": {"proto", "runtime"},
    "bench": {"kernels", "proto", "modelfile", "runtime", "attention_service", "expert_service", "gateway",
              "splitmoe", "supervisor", "local_stack", "demo_model", "demo"},  # not the CLI: it calls bench
}
MUST_NOT_IMPORT = {"gateway": {"torch", "numpy"}, "proto": {"numpy"}, "runtime": {"torch", "numpy"}}


def source_folder(package: str) -> Path:
    return REPO / ("splitmoe" if package == "runtime" else "") / package


def imports(package: str) -> dict[str, set[str]]:
    """module path -> the top-level names it imports, ours spelt as the package under splitmoe."""
    found = {}
    for path in sorted(source_folder(package).rglob("*.py")):
        if "generated" in path.parts:
            continue
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for module in modules:
                parts = module.split(".")
                names.add(parts[1] if parts[0] == "splitmoe" and len(parts) > 1 else parts[0])
        found[str(path.relative_to(REPO))] = names
    return found


def ours() -> set[str]:
    return set(product_folders()) | {"runtime", "splitmoe"} | TOP


def test_every_package_has_a_rule():
    assert set(product_folders()) | {"runtime"} == set(MAY_IMPORT)


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_a_package_imports_only_what_its_rule_allows(package):
    allowed = MAY_IMPORT[package] | {package}
    broken = {path: sorted((names & ours()) - allowed) for path, names in imports(package).items()}
    assert not {path: names for path, names in broken.items() if names}
    forbidden = {path: sorted(names & MUST_NOT_IMPORT.get(package, set())) for path, names in imports(package).items()}
    assert not {path: names for path, names in forbidden.items() if names}


def test_no_bare_import_of_a_product_folder():
    """`kernels`, `proto`, `bench` are names of other distributions on PyPI: ours are splitmoe.*."""
    bare = set(product_folders())
    offenders = {}
    for folder in (*product_folders(), "splitmoe", "tests"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
                hits = [m for m in modules if m.split(".")[0] in bare]
                if hits:
                    offenders[str(path.relative_to(REPO))] = hits
    assert not offenders


def test_the_rules_can_fail(tmp_path, monkeypatch):
    """The checker sees a forbidden import hidden in a function."""
    package = tmp_path / "kernels"
    package.mkdir()
    (package / "bad.py").write_text("def f():\n    from splitmoe.modelfile.gguf_file import GGUFFile\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert imports("kernels") == {"kernels/bad.py": {"modelfile"}}


@pytest.mark.stack
def test_the_gateway_loads_no_torch_and_no_engine_package():
    """Imported for real, with its CLI command: what the static rule cannot see (a dependency's own
    imports) stays out too."""
    forbidden = ("torch", "numpy", "splitmoe.kernels", "splitmoe.modelfile", "splitmoe.attention_service",
                 "splitmoe.expert_service")
    code = ("import sys, splitmoe.gateway.app, splitmoe.commands.serve_gateway, splitmoe.cli;"
            "splitmoe.cli.build_parser();"
            f"print([m for m in {forbidden!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
