"""splitmoe/demo/check.py on the shipped demo model: every fact of the corpus, greedy, in one process.

The serving dtype (bfloat16: Q8_0 kernels, bfloat16 activations) rounds differently from float32, so
both are asked; the stack test (tests/test_up.py) asks a few of the same through `splitmoe up`.
"""
from __future__ import annotations

import pytest

from splitmoe.demo import corpus, trained_model_path
from splitmoe.demo.check import main
from splitmoe.modelfile.gguf_file import GGUFFile


def test_the_shipped_model_is_a_small_qwen3moe():
    path = trained_model_path()
    assert path.stat().st_size < 4_000_000  # it ships in the wheel
    g = GGUFFile(path)
    assert g.metadata["general.architecture"] == "qwen3moe"
    assert int(g.arch_require("expert_count")) == 8


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_shipped_model_answers_every_fact(dtype, capsys):
    code = main([str(trained_model_path()), "--dtype", dtype])
    out = capsys.readouterr().out
    assert code == 0, out
    n = len(corpus.facts())
    assert out.rstrip().endswith(f"{n} of {n} right ({dtype})")
