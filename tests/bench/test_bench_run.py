"""`splitmoe bench run` (bench/run.py and the modules beside it).

The end-to-end test runs the real command on the demo model with a small workload: real expert
and attention services, the in-process engine, the JSON and the table. The llama.cpp baseline is
tested when `llama-cpp-python` (the `bench` extra) is installed, on the same model and workload.
The figures' arithmetic (aggregate decode, hop overhead, touched-expert bytes, ratios) is tested
on made-up inputs.
"""
from __future__ import annotations

import json

import pytest
import torch

from splitmoe.bench.ceiling import ExpertBytes, RecordingExperts, ceiling_tok_s
from splitmoe.bench.llamacpp import available as llamacpp_available
from splitmoe.bench.report import add_ratios, table
from splitmoe.bench.services import hop_overhead
from splitmoe.bench.workload import (
    StreamTimes,
    Workload,
    aggregate_decode_tok_s,
    decode_tok_s,
    make_prompts,
    normal_token_ids,
)
from splitmoe.proto import attention_pb2 as pb
from splitmoe.runtime.topology import numa_nodes
from tests.support.processes import run_splitmoe

SMALL = ["--prompt-tokens", "32", "--decode-tokens", "6", "--streams", "3", "--stream-prompt-tokens", "4",
         "--bandwidth-mb", "32"]
HEADLINE = ("prefill_tok_s", "decode_tok_s", "decode16_tok_s", "ttft_s", "hop_us")
IN_PROCESS = ("inprocess_prefill_tok_s", "inprocess_decode_tok_s", "inprocess_decode16_tok_s", "inprocess_ttft_s")
CONTEXT = ("ceiling_decode_tok_s", "ceiling_decode16_tok_s", "bandwidth_gb_s", "expert_bytes_per_token",
           "touched_expert_bytes_per_step16")


def test_bench_run_measures_the_services_and_in_process_and_prints_the_table(demo_gguf, tmp_path):
    out = tmp_path / "figures.json"
    stdout = run_splitmoe("bench", "run", "--model", str(demo_gguf), "--threads", "2", "--json", str(out),
                          "--run-dir", str(tmp_path / "run"), "--plot", str(tmp_path / "curve.png"), *SMALL,
                          timeout_s=120)
    figures = json.loads(out.read_text())
    # --plot: every engine also decoded at 2 streams (the sweep's counts below --streams 3)
    assert {engine: sorted(curve) for engine, curve in figures["decode_curve_tok_s"].items()} == \
        {"services": ["1", "2", "3"], "inprocess": ["1", "2", "3"]}
    assert figures["decode_curve_tok_s"]["services"]["3"] == figures["decode16_tok_s"]
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for key in HEADLINE + IN_PROCESS + CONTEXT:
        assert isinstance(figures[key], (int, float)) and figures[key] > 0, key
    # one expert service per NUMA node by default, with every thread
    assert figures["threads"] == 2 and figures["expert_threads"] == [2] * numa_nodes() and figures["dtype"] == "bfloat16"
    assert figures["transport"] in ("shm", "grpc")
    # every service's memory, the model's blocks as mapped file pages
    memory = figures["memory_mib"]
    assert "attention" in memory and len(memory) == 1 + numa_nodes(), memory
    assert all(m["own"] > 0 and m["mapped_file"] > 0 for m in memory.values()), memory
    assert figures["touched_expert_bytes_source"] == "counted in the in-process run"
    # 3 streams of 2-of-8 experts touch between 2 and 6 distinct experts per layer
    per_layer = sum(ExpertBytes.of(_gguf(demo_gguf)).per_expert.values())
    assert 2 * per_layer <= figures["touched_expert_bytes_per_step16"] <= 6 * per_layer
    assert "llamacpp_decode_tok_s" not in figures
    assert figures["command"].startswith("splitmoe bench run --model ")
    assert "| decode tok/s (1 stream)" in stdout and "| per-hop overhead, µs" in stdout
    assert "splitmoe services" in stdout and "% of ceiling" in stdout
    logs = {"attention.log", *(f"expert-{i}.log" for i in range(numa_nodes()))}
    assert {p.name for p in (tmp_path / "run").iterdir()} >= logs


@pytest.mark.skipif(not llamacpp_available(), reason="llama-cpp-python is not installed (the optional `bench` "
                                                     "extra: pip install 'splitmoe[bench]'); baseline not tested")
def test_llamacpp_baseline_runs_the_same_workload(demo_gguf, tmp_path):
    from splitmoe.bench.llamacpp import run_baseline
    from splitmoe.modelfile.gguf_file import GGUFFile

    workload = Workload(prompt_tokens=32, decode_tokens=6, streams=3, stream_prompt_tokens=4)
    g = GGUFFile(demo_gguf)
    vocab = len(g.get("tokenizer.ggml.tokens"))
    prompts = make_prompts(workload, normal_token_ids(g.get("tokenizer.ggml.token_type"), vocab))
    result = run_baseline(str(demo_gguf), workload, prompts, threads=2, log_path=tmp_path / "llamacpp.log",
                          timeout_s=120)
    for value in (result.prefill_tok_s, result.decode_tok_s, result.decode16_tok_s, result.ttft_s):
        assert value > 0
    assert result.version

    figures = {"prefill_tok_s": 2 * result.prefill_tok_s, "llamacpp_prefill_tok_s": result.prefill_tok_s,
               "ttft_s": result.ttft_s / 2, "llamacpp_ttft_s": result.ttft_s, "workload": {"prompt_tokens": 32}}
    add_ratios(figures)
    assert figures["vs_llamacpp"] == {"prefill_tok_s": 2.0, "ttft_s": 2.0}
    assert "2.00×" in table(figures)


# ---- the arithmetic -----------------------------------------------------------------------------

def test_decode_rates_count_tokens_after_each_streams_first():
    one = StreamTimes(0.0, [1.0, 1.5, 2.0, 2.5])
    assert decode_tok_s(one) == pytest.approx(3 / 1.5)
    # two streams in lockstep, a third admitted one step later
    streams = [StreamTimes(0.0, [1.0, 2.0, 3.0]), StreamTimes(0.0, [1.0, 2.0, 3.0]), StreamTimes(0.0, [2.0, 3.0, 4.0])]
    assert aggregate_decode_tok_s(streams) == pytest.approx(6 / 3.0)


def test_hop_overhead_prefers_the_services_median_and_falls_back_to_the_sums():
    def stats(*hops):
        return pb.AttentionStats(hops=[pb.HopStats(expert_address=a, num_hops=n, hop_s_total=h, compute_s_total=c)
                                       for a, n, h, c in hops])

    before = stats(("a", 10, 1.0, 0.5), ("b", 10, 1.0, 0.5))
    after = stats(("a", 110, 1.0 + 100 * 150e-6, 0.5 + 100 * 100e-6), ("b", 60, 1.0 + 50 * 90e-6, 0.5 + 50 * 60e-6))
    sums = hop_overhead(before, after)
    assert sums.us == pytest.approx((100 * 50 + 50 * 30) / 150) and "mean" in sums.method
    if "overhead_us_median" in pb.HopStats.DESCRIPTOR.fields_by_name:  # services that report it
        after.hops[0].overhead_us_median, after.hops[1].overhead_us_median = 40.0, 10.0
        median = hop_overhead(before, after)
        assert median.us == pytest.approx((100 * 40 + 50 * 10) / 150) and "median" in median.method
    assert hop_overhead(after, after).us is None


def test_recording_experts_counts_distinct_experts_of_steps_of_the_asked_size():
    class Inner:
        def forward(self, layer, hidden, ids, weights):
            return hidden

        def stats(self):
            return {"passed": "through"}

    rec = RecordingExperts(Inner())
    x = torch.zeros(3, 4)
    rec.forward(0, x, torch.tensor([[0, 1], [1, 2], [0, 1]]), None)  # not recording yet
    rec.recording = True
    rec.forward(0, x, torch.tensor([[0, 1], [1, 2], [0, 1]]), None)   # 3 distinct
    rec.forward(0, x, torch.tensor([[0, 1], [0, 1], [0, -1]]), None)  # 2 distinct (-1: a dropped slot)
    rec.forward(1, x, torch.tensor([[5, 6], [7, 6], [5, 7]]), None)   # 3 distinct
    rec.forward(0, torch.zeros(5, 4), torch.zeros(5, 2, dtype=torch.long), None)  # a prefill: other size
    sizes = ExpertBytes(per_expert={0: 100, 1: 1000}, experts_used=2, num_experts=8)
    assert rec.touched_bytes_per_step(sizes, tokens=3) == pytest.approx(2.5 * 100 + 3 * 1000)
    assert rec.touched_bytes_per_step(sizes, tokens=7) is None
    assert rec.stats() == {"passed": "through"}
    assert sizes.per_token == 2 * 1100
    assert ceiling_tok_s(10.0, 1e9, 16) == pytest.approx(160.0)


def _gguf(path):
    from splitmoe.modelfile.gguf_file import GGUFFile

    return GGUFFile(path)
