"""bench/spec_bench.py, briefly: with drafts always right, every drafted token is accepted and the
outputs are the ones without speculation; with drafts never right, none is."""
import json

from splitmoe.bench.spec_bench import main


def test_the_oracle_drafter_sets_the_acceptance(tmp_path, demo_gguf):
    report_path = tmp_path / "spec.json"
    assert main(["--model", str(demo_gguf), "--streams", "1", "--acceptance", "0", "1", "--max-tokens", "12",
                 "--threads", "1", "--json", str(report_path)]) == 0
    rows = {(r["acceptance"], r["mode"]): r for r in json.loads(report_path.read_text())["rows"]}
    assert rows[(1.0, "fixed K")]["accepted_share"] == 1.0 and rows[(0.0, "fixed K")]["accepted_share"] == 0.0
    assert all(r["outputs_differing"] == 0 for r in rows.values())
    assert rows[(0.0, "off")]["vs_off"] == 1.0 and rows[(1.0, "adaptive")]["tok_s"] > 0
