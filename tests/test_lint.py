"""The source passes ruff with the rules in pyproject.toml: imports sorted, no unused or undefined names;
and vulture with its [tool.vulture] there: no function, method, attribute or variable that nothing uses."""
import subprocess
import sys

import pytest

from tests.support.processes import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10, where vulture brings tomli
    import tomli as tomllib

pytestmark = pytest.mark.stack  # ruff and vulture run as processes over the whole tree


def test_ruff_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def vulture(*paths: str) -> subprocess.CompletedProcess:
    """vulture as pyproject.toml configures it; over `paths` instead of the configured ones when given."""
    return subprocess.run([sys.executable, "-m", "vulture", *paths], cwd=REPO, capture_output=True, text=True)


def test_vulture_finds_no_unused_code():
    """A finding is either dead code, to delete, or a name used where vulture cannot see (a framework,
    another library, only the tests): then it goes in tests/vulture_whitelist.py with its reason."""
    out = vulture()
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_vulture_reports_an_unused_function(tmp_path):
    """The configuration hides nothing by accident: beside all the code it checks, a function nobody calls
    is reported, alone."""
    paths = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["vulture"]["paths"]
    extra = tmp_path / "extra.py"
    extra.write_text("def nobody_calls_this():\n    return 1\n")
    out = vulture(*paths, str(extra))
    assert out.returncode == 3, out.stdout[-4000:] + out.stderr[-2000:]  # 3: vulture found dead code
    assert out.stdout.splitlines() == [f"{extra}:1: unused function 'nobody_calls_this' (60% confidence)"]
