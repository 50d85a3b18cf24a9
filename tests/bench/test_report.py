"""bench.report with no peer, llama.cpp alone, and both peers, on figures made up for the test."""
from __future__ import annotations

import pytest

from splitmoe.bench.report import add_ratios, context_lines, table

OURS = {"prefill_tok_s": 900.0, "decode_tok_s": 40.0, "decode16_tok_s": 300.0, "ttft_s": 0.6, "hop_us": 25.0,
        "outside_experts_pct": 12.345, "inprocess_prefill_tok_s": 950.0, "inprocess_decode_tok_s": 45.0,
        "inprocess_decode16_tok_s": 320.0, "inprocess_ttft_s": 0.55,
        "ceiling_decode_tok_s": 50.0, "ceiling_decode16_tok_s": 400.0, "workload": {"prompt_tokens": 512, "streams": 16}}
LLAMA = {"llamacpp_prefill_tok_s": 600.0, "llamacpp_decode_tok_s": 32.0, "llamacpp_decode16_tok_s": 150.0,
         "llamacpp_ttft_s": 0.9, "llamacpp_version": "0.3.36"}
IK = {"ik_llamacpp_prefill_tok_s": 450.0, "ik_llamacpp_decode_tok_s": 40.0, "ik_llamacpp_decode16_alike_tok_s": 200.0,
      "ik_llamacpp_ttft_s": 512 / 450.0, "ik_llamacpp_version": "abc1234 (4321)",
      "ik_llamacpp_bin_dir": "/peers/ik/build/bin", "ik_llamacpp_sweep_tok_s": {},
      "ik_llamacpp_flags": {"prefill_tok_s": "-rtr 1", "decode_tok_s": "-rtr 0", "decode16_tok_s": "-rtr 1",
                            "sweep_tok_s": {}},
      "ik_llamacpp_note": "its llama-batched-bench decodes token 0 in every stream (the streams route alike)"}
CONTEXT = {"model": "/m.gguf", "threads": 2, "attention_threads": 2, "expert_threads": [2], "dtype": "bfloat16",
           "attention_device": "cpu", "gpu": None, "transport": "shm", "bandwidth_gb_s": 20.0,
           "expert_bytes_per_token": 1e6, "touched_expert_bytes_per_step16": 1e7,
           "touched_expert_bytes_source": "estimate", "dense_bytes_per_token": 1e6}

# The table as it was printed before ik_llama.cpp joined (llama.cpp the only peer): unchanged.
LLAMA_ONLY_TABLE = """\
| metric                                        | splitmoe services | in-process | llama.cpp | vs llama.cpp | ceiling | % of ceiling |
|-----------------------------------------------|------------------:|-----------:|----------:|-------------:|--------:|-------------:|
| prefill tok/s (512-token prompt)              |               900 |        950 |       600 |        1.50× |         |              |
| time to first token, s                        |             0.600 |      0.550 |     0.900 |        1.50× |         |              |
| decode tok/s (1 stream)                       |              40.0 |       45.0 |      32.0 |        1.25× |    50.0 |          80% |
| decode tok/s (16 streams, total)              |               300 |        320 |       150 |        2.00× |     400 |          75% |
| per-hop overhead, µs                          |              25.0 |            |           |              |         |              |
| 16-stream step outside the expert services, % |              12.3 |            |           |              |         |              |"""


def test_with_llama_cpp_alone_the_table_and_context_are_as_before():
    figures = {**OURS, **LLAMA, **CONTEXT}
    assert table(figures) == LLAMA_ONLY_TABLE
    lines = context_lines(figures)
    assert lines[-2:] == ["llama.cpp: llama-cpp-python 0.3.36, same file and thread count",
                          "vs llama.cpp: times better (rates: ours / llama.cpp; time to first token: llama.cpp / ours)"]
    add_ratios(figures)
    assert "vs_ik_llamacpp" not in figures
    assert figures["vs_llamacpp"] == {"prefill_tok_s": 1.5, "inprocess_prefill_tok_s": pytest.approx(950 / 600, abs=1e-3),
                                      "ttft_s": 1.5, "inprocess_ttft_s": pytest.approx(0.9 / 0.55, abs=1e-3),
                                      "decode_tok_s": 1.25, "inprocess_decode_tok_s": pytest.approx(45 / 32, abs=1e-3),
                                      "decode16_tok_s": 2.0, "inprocess_decode16_tok_s": pytest.approx(320 / 150, abs=1e-3)}


def test_with_both_peers_the_table_has_an_ik_column_and_its_ratios():
    figures = {**OURS, **LLAMA, **IK, **CONTEXT, "decode16_alike_tok_s": 300.0, "inprocess_decode16_alike_tok_s": 340.0}
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table(figures).splitlines()]
    assert rows[0] == ["metric", "splitmoe services", "in-process", "llama.cpp", "vs llama.cpp", "ik_llama.cpp", "vs ik",
                       "ceiling", "% of ceiling"]
    by_metric = {r[0]: r[1:] for r in rows[2:]}
    assert by_metric["prefill tok/s (512-token prompt)"] == ["900", "950", "600", "1.50×", "450", "2.00×", "", ""]
    assert by_metric["time to first token, s"][5] == "1.90×"  # ik's 1.138 s / our 0.6 s
    assert by_metric["decode tok/s (1 stream)"] == ["40.0", "45.0", "32.0", "1.25×", "40.0", "1.00×", "50.0", "80%"]
    # ik's streams route alike: its figure stands beside ours for streams of one prompt, not of their own
    assert by_metric["decode tok/s (16 streams, total)"][2:6] == ["150", "2.00×", "-", "-"]
    assert by_metric["decode tok/s (16 streams of one prompt, total)"] == ["300", "340", "-", "-", "200", "1.50×",
                                                                          "", ""]
    assert by_metric["per-hop overhead, µs"] == ["25.0", "", "", "", "", "", "", ""]

    add_ratios(figures)
    vs_ik = figures["vs_ik_llamacpp"]
    assert vs_ik["decode_tok_s"] == 1.0 and vs_ik["inprocess_decode_tok_s"] == pytest.approx(1.125)
    assert vs_ik["decode16_alike_tok_s"] == 1.5 and vs_ik["prefill_tok_s"] == 2.0
    assert vs_ik["inprocess_decode16_alike_tok_s"] == pytest.approx(1.7) and "decode16_tok_s" not in vs_ik
    assert figures["vs_llamacpp"]["decode_tok_s"] == 1.25

    lines = context_lines(figures)
    ik_line = next(line for line in lines if line.startswith("ik_llama.cpp: "))
    assert "in /peers/ik/build/bin, build abc1234 (4321)" in ik_line
    assert "per figure the better flags: prefill -rtr 1, decode -rtr 0, streams -rtr 1" in ik_line
    assert "decodes token 0 in every stream" in ik_line
    assert lines[-1].startswith("vs llama.cpp, vs ik: times better")


def test_ik_alone_leaves_the_llama_cpp_columns_empty():
    figures = {**OURS, **IK, **CONTEXT}
    decode = next(line for line in table(figures).splitlines() if line.startswith("| decode tok/s (1 stream)"))
    assert [c.strip() for c in decode.strip("|").split("|")][3:7] == ["-", "-", "40.0", "1.00×"]
    assert not any(line.startswith("llama.cpp: ") for line in context_lines(figures))


def test_llama_cpp_through_its_tools_names_the_build_not_the_package():
    figures = {**OURS, **LLAMA, **CONTEXT, "llamacpp_version": "unknown (0)", "llamacpp_bin_dir": "/peers/llama.cpp/bin",
               "llamacpp_flags": {"prefill_tok_s": "defaults", "decode_tok_s": "defaults",
                                  "decode16_tok_s": "defaults", "sweep_tok_s": {}}, "llamacpp_note": ""}
    line = next(line for line in context_lines(figures) if line.startswith("llama.cpp: "))
    assert line == ("llama.cpp: llama-bench and llama-batched-bench in /peers/llama.cpp/bin, build unknown (0), "
                    "same file and thread count; first token = prompt / prefill rate; decode after a 512-token "
                    "prompt, as ours")
    assert table(figures) == LLAMA_ONLY_TABLE


def test_the_all_weights_ceiling_line_names_every_engine_that_ran():
    from splitmoe.bench.report import all_weights_line

    line = all_weights_line({"ceiling_all_weights_decode_tok_s": 200.0, "decode_tok_s": 120.0,
                             "inprocess_decode_tok_s": 150.0, "ik_llamacpp_decode_tok_s": 170.0})
    assert line.endswith("ceiling 200 tok/s; reached: services 60%, in-process 75%, ik_llama.cpp 85%")


def test_the_bandwidth_before_each_engine_is_reported_and_a_moving_machine_named():
    from splitmoe.bench.report import bandwidth_line
    steady = {"bandwidth_before_gb_s": {"services": 44.1, "inprocess": 46.0, "ik_llamacpp": 45.2}}
    assert bandwidth_line(steady) == "read bandwidth before each engine, GB/s: services 44.1, in-process 46.0, " \
                                     "ik_llama.cpp 45.2"
    moved = {"bandwidth_before_gb_s": {"services": 44.0, "inprocess": 45.0, "ik_llamacpp": 70.4}}
    assert bandwidth_line(moved).endswith("(it moved 60% during the run: the ratios mix the machine's states; "
                                          "compare within a state)")
    assert bandwidth_line({"bandwidth_before_gb_s": {"services": 44.0}}) == "" and bandwidth_line({}) == ""
    assert "read bandwidth before each engine" in "\n".join(context_lines({**OURS, **CONTEXT, **moved}))
