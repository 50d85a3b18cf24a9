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
from splitmoe.bench.report import add_ratios, context_lines, table
from splitmoe.bench.run import BenchSettings, command_line, run_bench
from splitmoe.bench.services import ServicesOptions, attention_options, hop_overhead, step_share
from splitmoe.bench.workload import (
    StreamTimes,
    Workload,
    aggregate_decode_tok_s,
    decode_tok_s,
    make_prompts,
    normal_token_ids,
)
from splitmoe.cli import build_parser
from splitmoe.proto import attention_pb2 as pb
from splitmoe.runtime.topology import numa_nodes
from tests.support.processes import run_splitmoe

SMALL = ["--prompt-tokens", "32", "--decode-tokens", "6", "--streams", "3", "--stream-prompt-tokens", "4",
         "--bandwidth-mb", "32"]
HEADLINE = ("prefill_tok_s", "decode_tok_s", "decode16_tok_s", "decode16_alike_tok_s", "ttft_s", "hop_us")
IN_PROCESS = ("inprocess_prefill_tok_s", "inprocess_decode_tok_s", "inprocess_decode16_tok_s",
              "inprocess_decode16_alike_tok_s", "inprocess_ttft_s")
CONTEXT = ("ceiling_decode_tok_s", "ceiling_decode16_tok_s", "bandwidth_gb_s", "expert_bytes_per_token",
           "touched_expert_bytes_per_step16")


@pytest.mark.stack
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
    assert figures["attention_device"] == "cpu" and figures["gpu"] is None
    # the 3-stream phase: its steps, and the share of its time no expert service computed
    step = figures["streams_step"]
    assert step["num_steps"] >= 5 and step["expert_s"] > 0 and step["hop_s"] >= step["expert_s"]
    assert 0 < figures["outside_experts_pct"] == step["outside_experts_pct"] < 100
    assert step["outside_hops_pct"] <= step["outside_experts_pct"]
    assert figures["command"].startswith("splitmoe bench run --model ")
    assert "| decode tok/s (1 stream)" in stdout and "| per-hop overhead, µs" in stdout
    assert "| decode tok/s (3 streams of one prompt, total)" in stdout
    assert "| 3-stream step outside the expert services, %" in stdout and "attention cpu, dtype" in stdout
    assert "splitmoe services" in stdout and "% of ceiling" in stdout
    logs = {"attention.log", *(f"expert-{i}.log" for i in range(numa_nodes()))}
    assert {p.name for p in (tmp_path / "run").iterdir()} >= logs


@pytest.mark.stack
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


def _stats(num_steps, *hops):
    return pb.AttentionStats(num_steps=num_steps, hops=[
        pb.HopStats(expert_address=a, num_hops=n, hop_s_total=h, compute_s_total=c) for a, n, h, c in hops])


def test_step_share_counts_the_busiest_services_compute_once_against_the_phases_wall_time():
    # one expert service: 10 steps over 2.0 s, 1.5 s of it expert compute inside 1.8 s of hops
    before = _stats(100, ("a", 50, 4.0, 3.0))
    one = step_share(before, _stats(110, ("a", 530, 5.8, 4.5)), wall_s=2.0)
    assert one.num_steps == 10 and one.step_ms == pytest.approx(200.0)
    assert one.expert_s == pytest.approx(1.5) and one.hop_s == pytest.approx(1.8)
    assert one.outside_experts == pytest.approx(0.25) and one.outside_hops == pytest.approx(0.1)
    # two services in parallel: the busier one's compute (1.6 s) counts, not the sum; one new since
    two = step_share(before, _stats(110, ("a", 530, 5.8, 4.5), ("b", 480, 1.7, 1.6)), wall_s=2.0)
    assert two.expert_s == pytest.approx(1.6) and two.outside_experts == pytest.approx(0.2)
    assert two.hop_s == pytest.approx(1.8) and two.outside_hops == pytest.approx(0.1)
    # no step in between: nothing to share out
    idle = step_share(before, before, wall_s=0.5)
    assert idle.num_steps == 0 and idle.outside_experts is None and idle.step_ms is None


def test_attention_device_reaches_the_attention_services_argv():
    workload = Workload(prompt_tokens=32, decode_tokens=6, streams=3, stream_prompt_tokens=4)
    for device in ("cpu", "cuda"):
        extra = attention_options(ServicesOptions(threads=2, attention_device=device), workload)
        args = build_parser().parse_args(["serve-attention", "m.gguf", *extra])
        assert args.device == device and args.dtype == "bfloat16" and args.kv_cache_tokens == workload.kv_tokens()
    args = build_parser().parse_args(["bench", "run", "--model", "m.gguf", "--attention-device", "cuda"])
    assert args.attention_device == "cuda"
    assert build_parser().parse_args(["bench", "run", "--model", "m.gguf"]).attention_device == "cpu"
    settings = BenchSettings("m.gguf", threads=2, attention_device="cuda", inprocess=False)
    assert command_line(settings).endswith("--attention-device cuda --no-inprocess")
    assert "--attention-device" not in command_line(BenchSettings("m.gguf", threads=2))
    with pytest.raises(ValueError, match="--attention-device must be one of cpu, cuda"):
        BenchSettings("m.gguf", threads=2, attention_device="tpu")


def test_baselines_repeat_and_carry_their_build_directories(monkeypatch):
    for name in ("SPLITMOE_LLAMA_CPP_BIN", "SPLITMOE_IK_LLAMA_CPP_BIN"):
        monkeypatch.delenv(name, raising=False)
    args = build_parser().parse_args(["bench", "run", "--model", "m.gguf"])
    assert (args.baseline, args.llama_cpp_dir, args.ik_llama_cpp_dir) == ([], "", "")
    args = build_parser().parse_args(["bench", "run", "--model", "m.gguf", "--baseline", "llama.cpp", "--baseline",
                                      "ik_llama.cpp", "--ik-llama-cpp-dir", "/ik/bin", "--llama-cpp-dir", "/lc/bin"])
    assert (args.baseline, args.llama_cpp_dir, args.ik_llama_cpp_dir) == (["llama.cpp", "ik_llama.cpp"], "/lc/bin",
                                                                          "/ik/bin")
    monkeypatch.setenv("SPLITMOE_IK_LLAMA_CPP_BIN", "/env/ik/bin")  # the environment stands in for the flag
    assert build_parser().parse_args(["bench", "run", "--model", "m.gguf"]).ik_llama_cpp_dir == "/env/ik/bin"

    both = BenchSettings("m.gguf", threads=2, baselines=("ik_llama.cpp", "none", "llama.cpp", "ik_llama.cpp"),
                         ik_llama_cpp_dir="/ik/bin", llama_cpp_dir="/lc/bin")
    assert both.baselines == ("ik_llama.cpp", "llama.cpp")  # in the order asked, each once, "none" dropped
    assert command_line(both) == ("splitmoe bench run --model m.gguf --threads 2 --baseline ik_llama.cpp "
                                  "--baseline llama.cpp --llama-cpp-dir /lc/bin --ik-llama-cpp-dir /ik/bin")
    # a directory with no peer asking for it changes nothing; llama-cpp-python needs none
    assert command_line(BenchSettings("m.gguf", threads=2, llama_cpp_dir="/lc/bin")).endswith("--threads 2")
    assert command_line(BenchSettings("m.gguf", threads=2, baselines=("llama.cpp",))).endswith("--baseline llama.cpp")
    with pytest.raises(ValueError, match=r"--baseline ik_llama.cpp needs its build's bin directory: "
                                         r"--ik-llama-cpp-dir DIR \(or SPLITMOE_IK_LLAMA_CPP_BIN\)"):
        BenchSettings("m.gguf", threads=2, baselines=("ik_llama.cpp",))
    with pytest.raises(ValueError, match="--baseline must be one of none, llama.cpp, ik_llama.cpp, got 'vllm'"):
        BenchSettings("m.gguf", threads=2, baselines=("vllm",))


@pytest.mark.parametrize("flags, error", [
    (["--baseline", "ik_llama.cpp", "--ik-llama-cpp-dir", "{tmp}/none"], "--ik-llama-cpp-dir {tmp}/none: no such directory"),
    (["--baseline", "ik_llama.cpp"], "--baseline ik_llama.cpp needs its build's bin directory"),
    (["--baseline", "llama.cpp", "--llama-cpp-dir", "{tmp}"], "--llama-cpp-dir {tmp}: no executable llama-bench there"),
])
def test_a_missing_peer_build_is_one_line_and_exit_2_before_anything_runs(flags, error, tmp_path, monkeypatch, capsys):
    from splitmoe.cli import main

    for name in ("SPLITMOE_LLAMA_CPP_BIN", "SPLITMOE_IK_LLAMA_CPP_BIN"):
        monkeypatch.delenv(name, raising=False)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")  # never read: the refusal comes first
    argv = ["bench", "run", "--model", str(model), "--threads", "1", "--run-dir", str(tmp_path / "run"),
            *(f.format(tmp=tmp_path) for f in flags)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitmoe bench: error: " + error.format(tmp=tmp_path)) and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no GPU")
def test_cuda_attention_is_refused_before_anything_starts_where_torch_sees_no_gpu(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")  # never read: the refusal comes first
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        run_bench(BenchSettings(str(model), threads=1, attention_device="cuda", run_dir=str(tmp_path / "run")),
                  say=lambda line: None)
    assert not (tmp_path / "run").exists()


def test_table_and_context_show_the_outside_share_and_the_gpu():
    figures = {"prefill_tok_s": 900.0, "decode_tok_s": 40.0, "decode16_tok_s": 300.0, "ttft_s": 0.6,
               "hop_us": 25.0, "outside_experts_pct": 12.345, "workload": {"prompt_tokens": 512, "streams": 16},
               "model": "/m.gguf", "threads": 16, "attention_threads": 16, "expert_threads": [16],
               "dtype": "bfloat16", "attention_device": "cuda", "gpu": "NVIDIA H100 80GB HBM3", "transport": "shm",
               "bandwidth_gb_s": 200.0, "expert_bytes_per_token": 1e6, "touched_expert_bytes_per_step16": 1e7,
               "touched_expert_bytes_source": "estimate", "dense_bytes_per_token": 1e6}
    row = next(line for line in table(figures).splitlines() if "outside the expert services" in line)
    assert row.startswith("| 16-stream step outside the expert services, % ") and " 12.3 |" in row
    assert "attention cuda (NVIDIA H100 80GB HBM3), dtype bfloat16" in context_lines(figures)[0]
    assert "attention cpu, dtype" in context_lines({**figures, "attention_device": "cpu", "gpu": None})[0]


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
