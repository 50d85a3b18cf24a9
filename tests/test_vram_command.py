"""`splitmoe vram`: the GPU memory figures of the known shapes and of a GGUF file, and its bad input."""
import subprocess
import sys

import pytest

from splitmoe.cli import main
from tests.support.processes import REPO


def _rows(out: str) -> dict[str, list[str]]:
    """The table's lines by model name: the other columns as printed ("3.99 GiB" is one column)."""
    rows = {}
    for line in out.splitlines()[1:]:
        name, *cells = line.split()
        if cells and cells[-1] in ("B", "KiB", "MiB", "GiB"):
            rows[name] = [" ".join(cells[i:i + 2]) for i in range(0, len(cells), 2)]
    return rows


def test_the_known_shapes_at_32k_tokens(capsys):
    assert main(["vram", "--kv-cache-tokens", "32768"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["model", "weights", "KV/token", "KV", "x", "32768", "workspace", "graphs",
                                           "total"]
    rows = _rows(out)
    # weights, KV per token and KV cache as test_vram works them out by hand
    assert rows["gpt-oss-120b"][:3] == ["3.99 GiB", "72.0 KiB", "2.25 GiB"]
    assert rows["qwen3-235b-a22b"][:3] == ["14.99 GiB", "188.0 KiB", "5.88 GiB"]
    assert rows["deepseek-v3"][:3] == ["32.08 GiB", "68.6 KiB", "2.15 GiB"]
    assert "a decode step of 64 sequences" in out


def test_a_file_and_a_shape(capsys, demo_gguf):
    assert main(["vram", str(demo_gguf), "--shape", "qwen3-235b-a22b", "--dtype", "float32"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert list(rows) == ["qwen3-235b-a22b", demo_gguf.name]
    # float32: the bfloat16 tensors twice (15,894,315,008 x 2), the float32 ones (200,325,120) as they were
    assert rows["qwen3-235b-a22b"][:2] == ["29.79 GiB", "376.0 KiB"]


@pytest.mark.stack
def test_bad_input_is_one_line_and_exit_2():
    for args, says in ((["--shape", "llama-70b"], "want one of gpt-oss-120b"),
                       (["--kv-cache-tokens", "0"], "kv_cache_tokens must be >= 1")):
        out = subprocess.run([sys.executable, "-m", "splitmoe", "vram", *args], cwd=REPO, capture_output=True,
                             text=True)
        assert out.returncode == 2 and says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
