"""bench.plot and the workload's stream-count sweep, on figures made up for the test."""
import pytest

from splitmoe.bench.plot import engines_drawn, plot_decode_curve
from splitmoe.bench.workload import Workload


def test_the_curve_of_every_engine_is_drawn(tmp_path):
    figures = {"model": "/m/q3_6l.gguf", "threads": 2, "cpu": "Some CPU",
               "decode_curve_tok_s": {"services": {1: 110.0, 2: 150.0, 16: 250.0},
                                      "inprocess": {1: 120.0, 2: 170.0, 16: 280.0},
                                      "llamacpp": {1: 100.0, 2: 140.0, 16: 210.0}}}
    out = plot_decode_curve(figures, tmp_path / "sub" / "curve.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_both_peers_get_a_curve(tmp_path):
    curves = {"services": {1: 110.0, 2: 150.0, 16: 250.0}, "llamacpp": {1: 100.0, 2: 140.0, 16: 210.0},
              "ik_llamacpp": {1: 105.0, 2: 160.0, 16: 230.0}}
    figures = {"model": "/m/q3_6l.gguf", "threads": 2, "decode_curve_tok_s": curves}
    labels = [label for _, label, _, _ in engines_drawn(figures)]
    assert labels[:2] == ["SplitMoE services", "llama.cpp"] and labels[2].startswith("ik_llama.cpp (")
    assert len({color for _, _, color, _ in engines_drawn(figures)}) == 3
    assert plot_decode_curve(figures, tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_counts_lie_between_one_and_the_streams():
    assert Workload(streams=16, sweep=(8, 2, 4, 2, 1, 16)).sweep == (2, 4, 8)
    with pytest.raises(ValueError, match="between 1 and --streams"):
        Workload(streams=4, sweep=(8,))
