"""The source passes ruff with the rules in pyproject.toml: imports sorted, no unused or undefined names."""
import subprocess
import sys

from tests.support.processes import REPO


def test_ruff_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
