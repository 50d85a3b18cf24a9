"""bench/membership_soak.py, briefly: 4 streams while the expert services go 1 -> 2 -> 1; the soak
itself fails (exit 1) on any failed or corrupted response, or a newcomer that took no work."""
import json

import pytest

from splitmoe.bench.membership_soak import main


@pytest.mark.stack
def test_a_short_soak_loses_nothing_and_every_newcomer_takes_work(tmp_path, demo_gguf):
    report_path = tmp_path / "soak.json"
    assert main(["--dir", str(tmp_path), "--model", str(demo_gguf), "--streams", "4", "--counts", "1,2",
                 "--step-s", "4", "--duration-s", "12", "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["answered"] > 0 and report["failed"] == report["corrupted"] == 0
    assert [s["services"] for s in report["steps"]] == [1, 2, 1]
    assert len(report["steps"][1]["hops_by_service"]) == 2 and len(report["drain_s"]) == 1
