"""`python -m splitmoe.bench.decode_profile`: the per-op table of a decode step, on the demo model.

It wraps the engine's functions by name, so a renamed one breaks it: run it here.
"""
from splitmoe.bench import decode_profile


def test_profile_accounts_for_the_step(demo_gguf, capsys):
    assert decode_profile.main(["--model", str(demo_gguf), "--tokens", "3", "--context", "8", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line[:32].strip(): line for line in out.splitlines()[3:]}
    for label in ("norm", "embedding"):
        assert label in rows, out
    # the experts alone, or (native kernels) fused with their layer's attention front in one call
    assert "experts" in rows or "layer (fused: front+experts)" in rows, out
    assert "unaccounted" in out
