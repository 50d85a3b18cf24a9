"""What `pip install` puts into site-packages: the `splitmoe` package alone, with every product
folder inside it (the design card's top-level folders, mapped by setup.py)."""
import ast
import os
import shutil
import subprocess
import sys

import pytest

from tests.support.processes import REPO

pytestmark = pytest.mark.stack  # pip builds a wheel and installs it into a new venv


def product_folders() -> tuple[str, ...]:
    tree = ast.parse((REPO / "setup.py").read_text())
    return next(ast.literal_eval(node.value) for node in tree.body
                if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "PRODUCT")


def test_a_fresh_venv_gains_only_the_splitmoe_package(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "*.so",
                                                             ".pytest_cache", "tests", ".gpu"))
    env = {**os.environ, "SPLITMOE_BUILD_NATIVE": "0"}  # the layout is the question, not the C++ build
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, env=env, timeout=300,
                   capture_output=True)
    [wheel] = (tmp_path / "dist").glob("splitmoe-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    [site] = venv.glob("lib/python*/site-packages")
    before = set(os.listdir(site))
    # this interpreter's pip installs into the venv; --no-deps: what splitmoe itself adds
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
                    "-q", str(wheel)], check=True, timeout=300, capture_output=True)
    added = set(os.listdir(site)) - before
    dist_info = "-".join(wheel.name.split("-")[:2]) + ".dist-info"
    assert added == {"splitmoe", dist_info}
    package = site / "splitmoe"
    for folder in product_folders():
        assert (package / folder / "__init__.py").is_file(), folder
    assert (package / "attention_service" / "model" / "__init__.py").is_file()  # subpackages come along
    assert (package / "modelfile" / "architectures" / "__init__.py").is_file()
    assert (package / "runtime" / "__init__.py").is_file()
    assert {f.name for f in (package / "gateway" / "static").iterdir()} == {"chat.html", "chat.js", "chat.css"}
    assert (package / "demo" / "demo-chat-qwen3moe.gguf").is_file()  # what `splitmoe up` serves by default
    assert not list(package.rglob("tests")), "tests stay out of the install"
    # Run from elsewhere, the installed copy answers for every name, and nothing of the checkout
    code = "import splitmoe, splitmoe.runtime.topology as t; print(splitmoe.__path__, t.__file__)"
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, check=True, timeout=60,
                         capture_output=True, text=True).stdout
    assert out.strip() == f"[{str(package)!r}] {package / 'runtime' / 'topology.py'}"
