"""What `pip install` puts into site-packages: the `splitmoe` package alone, with every product
folder inside it (the design card's top-level folders, mapped by setup.py)."""
import ast
import os
import shutil
import subprocess
import sys
import zipfile

from tests.support.processes import REPO


def product_folders() -> tuple[str, ...]:
    tree = ast.parse((REPO / "setup.py").read_text())
    return next(ast.literal_eval(node.value) for node in tree.body
                if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "PRODUCT")


def test_a_wheel_installs_only_the_splitmoe_package(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "*.so",
                                                             ".pytest_cache", "tests"))
    env = {**os.environ, "SPLITMOE_BUILD_NATIVE": "0"}  # the layout is the question, not the C++ build
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, env=env, timeout=300,
                   capture_output=True)
    [wheel] = (tmp_path / "dist").glob("splitmoe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"splitmoe", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    for folder in product_folders():
        assert f"splitmoe/{folder}/__init__.py" in names, folder
    assert "splitmoe/attention_service/models/__init__.py" in names  # subpackages come along
