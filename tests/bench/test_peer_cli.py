"""bench.peer_cli: a peer through its build's own llama-bench and llama-batched-bench.

The parsers read outputs the real tools printed (tests/data/peer_cli/README.md says how they were
made); the better-of choice and the command lines are checked on made-up figures. Where a build's
bin directory is given (SPLITMOE_LLAMA_CPP_BIN, SPLITMOE_IK_LLAMA_CPP_BIN), the real tools run on
the demo model with a small workload; CI has no such build, so there they skip.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from splitmoe.bench.peer_cli import (
    BATCHED_TOOL,
    BENCH_TOOL,
    FORKS,
    VariantFigures,
    batched_command,
    bench_command,
    better_of,
    check_bin_dir,
    parse_batched_bench,
    parse_llama_bench,
    run_batched,
    run_peer,
    run_tool,
)
from splitmoe.bench.workload import Workload
from splitmoe.runtime import settings

DATA = Path(__file__).resolve().parents[1] / "data" / "peer_cli"
SMALL = Workload(prompt_tokens=32, decode_tokens=6, streams=3, stream_prompt_tokens=4, sweep=(2,))


# ---- parsing what the tools print ---------------------------------------------------------------

def test_llama_bench_json_gives_the_fastest_prefill_repetition_and_the_mean_decode():
    out = parse_llama_bench((DATA / "llamacpp-bench.json").read_text())
    assert out.version == "unknown (0)"  # a build from a source tree without git, as llama-bench says
    pp, tg = out.rows
    assert (pp.n_prompt, pp.n_gen, tg.n_prompt, tg.n_gen) == (32, 0, 0, 6)
    assert pp.avg_tok_s == pytest.approx(95.242014) and pp.best_tok_s == pytest.approx(95.2439)
    assert tg.avg_tok_s == pytest.approx(12704.678277) and tg.best_tok_s == pytest.approx(14512.2)
    assert pp.settings == {"flash_attn": -1, "repack": True, "n_threads": 2, "n_batch": 2048, "n_ubatch": 512}


def test_ik_llama_bench_json_records_its_switches():
    for rtr in (0, 1):
        out = parse_llama_bench((DATA / f"ik-bench-rtr{rtr}.json").read_text())
        pp, tg = out.rows
        assert (pp.n_prompt, pp.n_gen, tg.n_prompt, tg.n_gen) == (32, 0, 0, 6)
        assert pp.settings["repack"] is bool(rtr) and pp.settings["fused_moe"] is True
        assert pp.best_tok_s >= pp.avg_tok_s > 0 and tg.avg_tok_s > 0
        assert out.version.endswith(")")


@pytest.mark.parametrize("sample, rows", [
    ("llamacpp-bench-depth.json", [(32, 0, 0), (0, 6, 0), (32, 0, 32), (0, 6, 32)]),   # -d 0,32: each test twice
    ("llamacpp-bench-depth.md", [(32, 0, 0), (0, 6, 0), (32, 0, 32), (0, 6, 32)]),     # "tg6 @ d32"
    ("ik-bench-gp.json", [(32, 0, 0), (0, 6, 0), (0, 6, 32)]),                        # -gp 32,6: n_prompt 32, n_gen 6
    ("ik-bench-gp.md", [(32, 0, 0), (0, 6, 0), (0, 6, 32)]),                          # "tg6@pp32"
])
def test_llama_bench_decode_after_a_prompt_is_a_generation_test_at_that_depth(sample, rows):
    out = parse_llama_bench((DATA / sample).read_text())
    assert [(r.n_prompt, r.n_gen, r.n_depth) for r in out.rows] == rows
    assert all(r.avg_tok_s > 0 for r in out.rows)


@pytest.mark.parametrize("sample", ["llamacpp-bench.md", "ik-bench.md"])
def test_llama_bench_markdown_gives_the_means_and_the_build(sample):
    text = (DATA / sample).read_text()
    out = parse_llama_bench(text)
    assert [(r.n_prompt, r.n_gen) for r in out.rows] == [(32, 0), (0, 6)]
    means = [line.split("|")[-2].split("±")[0].strip() for line in text.splitlines() if "±" in line]
    assert [r.avg_tok_s for r in out.rows] == [float(m) for m in means]
    assert all(r.best_tok_s == r.avg_tok_s for r in out.rows)  # the table has no repetitions
    build = next(line for line in text.splitlines() if line.startswith("build: "))
    assert out.version == build.removeprefix("build: ")


def test_batched_bench_table_and_jsonl_give_s_tg_per_stream_count():
    # llama.cpp: its table on stdout, among its warnings on stderr (both captured in one log)
    assert parse_batched_bench((DATA / "llamacpp-batched.log").read_text()) == {2: 24390.24, 3: 46632.12, 1: 25316.46}
    # its --output-format jsonl
    jsonl = parse_batched_bench((DATA / "llamacpp-batched.jsonl.log").read_text())
    assert jsonl == {2: pytest.approx(5.870864), 3: pytest.approx(106.831268), 1: pytest.approx(24793.388672)}
    # ik_llama.cpp prints the same table on stderr, between its loader's lines and its timings
    ik = parse_batched_bench((DATA / "ik-batched.log").read_text())
    assert ik == {2: 67796.61, 3: 91836.73, 1: 39473.69}


def test_a_stream_count_run_twice_keeps_its_first_row():
    header = "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |"
    row = "|%6d | %6d | %4d | %6d | %8.3f | %8.2f | %8.3f | %8.2f | %8.3f | %8.2f |"
    text = "\n".join([header, row % (4, 6, 1, 10, 0.1, 40, 0.5, 12.0, 0.6, 16.7),
                      row % (4, 6, 1, 10, 0.1, 40, 0.5, 99.0, 0.6, 16.7)])
    assert parse_batched_bench(text) == {1: 12.0}


# ---- command lines and the better of a fork's settings -----------------------------------------

def test_commands_ask_for_the_workload_on_the_cpu_with_the_same_threads(tmp_path):
    ik = FORKS["ik_llama.cpp"]
    rtr0, rtr1 = ik.variants
    bench = bench_command(tmp_path, "m.gguf", 4, SMALL, rtr1, after_prompt=ik.after_prompt)
    # decode also after a 32-token prompt, as our single stream decodes (-gp 32,6)
    assert bench == [str(tmp_path / BENCH_TOOL), "-m", "m.gguf", "-t", "4", "-ngl", "0", "-p", "32", "-n", "6",
                     "-gp", "32,6", "-r", "2", "-o", "json", "-rtr", "1"]
    assert bench_command(tmp_path, "m.gguf", 4, SMALL, rtr0)[-2:] == ["-rtr", "0"]
    batched = batched_command(tmp_path, "m.gguf", 4, Workload(streams=16, sweep=(8, 2, 4)), rtr1)
    # 16 x (16 + 128) KV cells; every count, then one stream (the row the logger may lose)
    assert batched == [str(tmp_path / BATCHED_TOOL), "-m", "m.gguf", "-t", "4", "-ngl", "0", "-c", "2304",
                       "-npp", "16", "-ntg", "128", "-npl", "2,4,8,16,1", "-rtr"]
    assert batched_command(tmp_path, "m.gguf", 4, SMALL, rtr0)[-2:] == ["-npl", "2,3,1"]
    llama = FORKS["llama.cpp"]
    assert len(llama.variants) == 1
    assert bench_command(tmp_path, "m.gguf", 4, SMALL, llama.variants[0], after_prompt=llama.after_prompt)[-6:] == \
        ["-d", "0,32", "-r", "2", "-o", "json"]  # every test at depth 0 and 32


def test_better_of_takes_each_figure_from_the_variant_that_did_best():
    results = {"-rtr 0": VariantFigures(prefill_tok_s=100.0, decode_tok_s=30.0, streams_tok_s={1: 29.0, 2: 50.0, 3: 70.0},
                                        version="v", settings={}),
               "-rtr 1": VariantFigures(prefill_tok_s=140.0, decode_tok_s=28.0, streams_tok_s={1: 27.0, 2: 55.0, 3: 65.0},
                                        version="v", settings={})}
    values, flags = better_of(SMALL, results)
    assert values == {"prefill_tok_s": 140.0, "decode_tok_s": 30.0, "decode16_tok_s": 70.0, "sweep_tok_s": {2: 55.0}}
    assert flags == {"prefill_tok_s": "-rtr 1", "decode_tok_s": "-rtr 0", "decode16_tok_s": "-rtr 0",
                     "sweep_tok_s": {2: "-rtr 1"}}


# ---- refusing a build directory, and a tool that fails -------------------------------------------

def _tool(path: Path, script: str, executable: bool = True) -> None:
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755 if executable else 0o644)


def test_a_bin_directory_needs_both_tools_executable(tmp_path):
    with pytest.raises(ValueError, match=r"^--ik-llama-cpp-dir /nonexistent/bin: no such directory"):
        check_bin_dir("/nonexistent/bin", "--ik-llama-cpp-dir")
    with pytest.raises(ValueError, match=f"no executable {BENCH_TOOL} there"):
        check_bin_dir(str(tmp_path), "--llama-cpp-dir")
    _tool(tmp_path / BENCH_TOOL, "exit 0\n")
    _tool(tmp_path / BATCHED_TOOL, "exit 0\n", executable=False)
    with pytest.raises(ValueError, match=f"no executable {BATCHED_TOOL} there"):
        check_bin_dir(str(tmp_path), "--llama-cpp-dir")
    (tmp_path / BATCHED_TOOL).chmod(0o755)
    assert check_bin_dir(str(tmp_path), "--llama-cpp-dir") == tmp_path.resolve()


@pytest.mark.stack
def test_a_failing_tool_is_reported_with_the_last_lines_of_its_log(tmp_path):
    tool = tmp_path / BENCH_TOOL
    _tool(tool, "for i in $(seq 1 30); do echo \"loading line $i\" >&2; done\necho 'error: failed to load model' >&2\n"
                "exit 3\n")
    with pytest.raises(RuntimeError) as failed:
        run_tool([str(tool), "-m", "x.gguf"], tmp_path / "t.log", timeout_s=30, stdout_path=tmp_path / "t.json")
    message = str(failed.value)
    assert message.startswith(f"llama-bench exited with code 3; last lines of {tmp_path / 't.log'}:")
    assert "error: failed to load model" in message and "loading line 30" in message
    assert "loading line 10" not in message  # the tail, not the whole log
    assert (tmp_path / "t.log").read_text().startswith(f"$ {tool} -m x.gguf\n")  # what ran heads its log


@pytest.mark.stack
def test_batched_rows_lost_in_every_attempt_are_an_error(tmp_path):
    tool = tmp_path / BATCHED_TOOL
    _tool(tool, "echo run >> \"$0.runs\"\n")  # exits 0, prints no table: every row lost
    with pytest.raises(RuntimeError, match=r"printed no row for \[2, 3\] streams in 3 runs"):
        run_batched([str(tool)], [2, 3], tmp_path / "b.log", timeout_s=30)
    assert (tmp_path / f"{BATCHED_TOOL}.runs").read_text() == "run\n" * 3


# ---- the real tools, where a build is given ------------------------------------------------------

BUILDS = {"llama.cpp": settings.llama_cpp_bin_dir(), "ik_llama.cpp": settings.ik_llama_cpp_bin_dir()}


@pytest.mark.stack
@pytest.mark.parametrize("fork", ["llama.cpp", "ik_llama.cpp"])
def test_the_real_tools_measure_the_workload(fork, demo_gguf, tmp_path):
    if not BUILDS[fork]:
        env = settings.LLAMA_CPP_BIN_ENV if fork == "llama.cpp" else settings.IK_LLAMA_CPP_BIN_ENV
        pytest.skip(f"no {fork} build: set {env} to its bin directory (llama-bench, llama-batched-bench)")
    bin_dir = check_bin_dir(BUILDS[fork], "--dir")
    # 64 tokens, not 6: a llama.cpp batched-bench done in ~15 ms can exit before its logger thread
    # printed anything at all (peer_cli.BATCHED_ATTEMPTS); 25 ms was enough in 18 of 18 runs here
    workload = Workload(prompt_tokens=32, decode_tokens=64, streams=3, stream_prompt_tokens=4, sweep=(2,))
    result = run_peer(fork, bin_dir, str(demo_gguf), 2, workload, tmp_path, timeout_s=120)
    for value in (result.prefill_tok_s, result.decode_tok_s, result.decode16_tok_s, *result.sweep_tok_s.values()):
        assert value > 0
    assert result.ttft_s == pytest.approx(32 / result.prefill_tok_s) and set(result.sweep_tok_s) == {2}
    variants = [v.flags for v in FORKS[fork].variants]
    assert list(result.variants) == variants and len(result.commands) == 2 * len(variants)
    assert {result.flags[k] for k in ("prefill_tok_s", "decode_tok_s", "decode16_tok_s")} <= set(variants)
    for v in result.variants.values():
        assert v["prefill_tok_s"] <= result.prefill_tok_s and v["decode_tok_s"] <= result.decode_tok_s
        assert v["decode_at_empty_context_tok_s"] > 0  # the plain tg test, kept beside the one after the prompt
        assert sorted(v["streams_tok_s"]) == [1, 2, 3]
    key = FORKS[fork].key
    assert (tmp_path / f"{key}{'-rtr1' if fork == 'ik_llama.cpp' else ''}-batched.log").is_file()
