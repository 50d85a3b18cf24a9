"""A peer through a build directory's own CLI tools: llama.cpp's, or its fork ik_llama.cpp's.

`llama-bench` gives prefill (a `prompt_tokens` prompt; time to first token = prompt_tokens / its
rate) and single-stream decode (`decode_tokens` tokens); `llama-batched-bench` gives the aggregate
decode of `streams` concurrent streams of `stream_prompt_tokens`-token prompts (its S_TG column),
and of the sweep's stream counts. Same file, the same threads for both phases, CPU only, the
weights mmapped as each tool does by default.

A fork may have several settings worth trying (ik_llama.cpp: its run-time repack of the weights
into interleaved layouts, `-rtr`, on or off): each is run, and per figure the better one counts,
with the flags that gave it recorded.

Unlike bench.driver, these tools make up their own prompts: llama-bench and llama.cpp's
batched-bench draw random token ids; ik_llama.cpp's batched-bench decodes token 0 in every
sequence, so its streams route to the same experts (see FORKS). llama-bench's token generation
starts from an empty context unless asked otherwise: the decode figure is its test after a
`prompt_tokens` prompt, as our single stream decodes (ik_llama.cpp's `-gp P,N`, llama.cpp's `-d`),
each step attending to as many cached tokens as ours. Its decode from an empty context is kept
beside it (the variants' `decode_at_empty_context_tok_s`): on the Qwen3 and DeepSeek files ik_llama.cpp
decoded 4-13% faster there (Zen 5, session 21).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from splitmoe.bench.llamacpp import child_failed
from splitmoe.bench.workload import Workload

BENCH_TOOL, BATCHED_TOOL = "llama-bench", "llama-batched-bench"
REPETITIONS = 2  # llama-bench's -r: each test after its warm-up run; two keep the peer's minutes short
# llama.cpp's batched-bench prints through a logger thread that is left running at exit (on purpose,
# see common_log_main), so the lines logged last can be lost: a last single-stream row nobody reads
# gives the thread time to print the rest, and a run whose rows still went missing is repeated.
BATCHED_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Variant:
    """One setting of a fork, as each tool spells it."""
    flags: str                          # what the figures record: the llama-bench flags
    bench_args: tuple[str, ...] = ()
    batched_args: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Fork:
    name: str        # as --baseline names it
    key: str         # the prefix of its figures in the JSON
    variants: tuple[Variant, ...]
    note: str = ""   # what a reader of its figures should know
    # Its batched-bench streams all decode one token, so they route alike: their figure stands
    # beside our streams of one prompt (Prompts.alike), not beside our streams of their own prompts.
    streams_alike: bool = False
    # How its llama-bench decodes after a prompt: "gp" (-gp P,N: a tgN@ppP test) or "depth" (-d 0,P:
    # every test at depth 0 and at P).
    after_prompt: str = "depth"


FORKS = {
    "llama.cpp": Fork("llama.cpp", "llamacpp", (Variant("defaults"),)),
    # ik_llama.cpp's fused MoE (-fmoe) and flash attention (-fa) are on by default in both tools.
    # -rtr: llama-bench takes 0|1; the common options of batched-bench take a bare -rtr. Repacking
    # loads the weights into memory instead of mmapping them (the fork turns mmap off for it).
    "ik_llama.cpp": Fork("ik_llama.cpp", "ik_llamacpp", (
        Variant("-rtr 0", ("-rtr", "0")),
        Variant("-rtr 1", ("-rtr", "1"), ("-rtr",))),
        note="its llama-batched-bench decodes token 0 in every stream (the streams route alike: their figure "
             "is set beside ours for streams of one prompt)", streams_alike=True, after_prompt="gp"),
}


@dataclass(frozen=True, slots=True)
class PeerResult:
    prefill_tok_s: float
    ttft_s: float
    decode_tok_s: float
    decode16_tok_s: float
    version: str
    sweep_tok_s: dict[int, float] = field(default_factory=dict)  # more stream counts: aggregate decode
    flags: dict = field(default_factory=dict)        # per figure, the variant's flags that gave it
    variants: dict = field(default_factory=dict)     # per variant's flags, its own figures
    commands: list[str] = field(default_factory=list)


# ---- checking a build directory -----------------------------------------------------------------

def check_bin_dir(bin_dir: str, flag: str) -> Path:
    """The build's bin directory, once it holds both tools; else ValueError naming `flag`."""
    path = Path(bin_dir).expanduser()
    if not path.is_dir():
        raise ValueError(f"{flag} {bin_dir}: no such directory (a build's bin directory, e.g. build/bin)")
    for tool in (BENCH_TOOL, BATCHED_TOOL):
        if not (path / tool).is_file() or not _executable(path / tool):
            raise ValueError(f"{flag} {bin_dir}: no executable {tool} there (build it: cmake --build build "
                             f"--target {BENCH_TOOL} {BATCHED_TOOL})")
    return path.resolve()


def _executable(path: Path) -> bool:
    return os.access(path, os.X_OK)


# ---- the command lines --------------------------------------------------------------------------

def bench_command(bin_dir: Path, model_path: str, threads: int, w: Workload, variant: Variant,
                  repetitions: int = REPETITIONS, after_prompt: str = "depth") -> list[str]:
    """llama-bench: prompt processing, and token generation from an empty context and after a
    `prompt_tokens` prompt (`after_prompt`: Fork's), as JSON on stdout."""
    P, N = w.prompt_tokens, w.decode_tokens
    depth = ("-gp", f"{P},{N}") if after_prompt == "gp" else ("-d", f"0,{P}")
    return [str(bin_dir / BENCH_TOOL), "-m", model_path, "-t", str(threads), "-ngl", "0",
            "-p", str(P), "-n", str(N), *depth, "-r", str(repetitions), "-o", "json", *variant.bench_args]


def stream_counts(w: Workload) -> list[int]:
    return sorted({w.streams, *w.sweep})


def batched_command(bin_dir: Path, model_path: str, threads: int, w: Workload, variant: Variant) -> list[str]:
    """llama-batched-bench: every stream count in one run, each sequence its own prompt (not shared),
    then one stream again, last (see BATCHED_ATTEMPTS)."""
    counts = stream_counts(w)
    n_ctx = _round_up(max(counts) * (w.stream_prompt_tokens + w.decode_tokens), 256)  # its check: pl * (pp + tg)
    return [str(bin_dir / BATCHED_TOOL), "-m", model_path, "-t", str(threads), "-ngl", "0", "-c", str(n_ctx),
            "-npp", str(w.stream_prompt_tokens), "-ntg", str(w.decode_tokens),
            "-npl", ",".join(map(str, [*counts, 1])), *variant.batched_args]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ---- parsing their outputs ----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class BenchRow:
    """One llama-bench test: a prompt-processing (n_gen 0) or a token-generation (n_prompt 0) one,
    `n_depth` tokens already in the context (ik_llama.cpp's tgN@ppP: n_gen N at depth P)."""
    n_prompt: int
    n_gen: int
    avg_tok_s: float
    best_tok_s: float   # the fastest repetition (the markdown table has only the mean: the mean)
    settings: dict = field(default_factory=dict)  # the fork's switches as it reported them (JSON only)
    n_depth: int = 0


@dataclass(frozen=True, slots=True)
class BenchOutput:
    rows: list[BenchRow]
    version: str


SETTINGS_FIELDS = ("flash_attn", "fused_moe", "repack", "use_mmap", "n_threads", "n_batch", "n_ubatch")
_TEST = re.compile(r"^(?:pp(\d+)|tg(\d+))(?:\s*@\s*(?:pp|d)(\d+))?$")  # tg128, tg128@pp512, pp512 @ d512
_RATE = re.compile(r"^([\d.]+)\s*±\s*([\d.]+)$")
_BUILD = re.compile(r"^build:\s*(.+?)\s*\((\d+)\)\s*$", re.MULTILINE)


def parse_llama_bench(text: str) -> BenchOutput:
    """llama-bench's stdout: its JSON array (-o json), or its markdown table and build line."""
    if text.lstrip().startswith("["):
        return _parse_bench_json(text)
    return _parse_bench_markdown(text)


def _parse_bench_json(text: str) -> BenchOutput:
    tests = json.loads(text)
    rows = []
    for t in tests:
        n_prompt, n_gen, depth = int(t["n_prompt"]), int(t["n_gen"]), int(t.get("n_depth", 0))
        if n_prompt and n_gen:  # ik_llama.cpp's -gp: generation after a prompt, timed alone
            n_prompt, depth = 0, depth + n_prompt
        rows.append(BenchRow(n_prompt, n_gen, float(t["avg_ts"]), max(map(float, t.get("samples_ts") or [t["avg_ts"]])),
                             {k: t[k] for k in SETTINGS_FIELDS if k in t}, depth))
    version = f"{tests[0].get('build_commit', 'unknown')} ({tests[0].get('build_number', '?')})" if tests else "unknown"
    return BenchOutput(rows, version)


def _parse_bench_markdown(text: str) -> BenchOutput:
    rows, columns = [], None
    for line in text.splitlines():
        if not line.lstrip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "test" in cells and "t/s" in cells:
            columns = (cells.index("test"), cells.index("t/s"))
            continue
        if columns is None or len(cells) <= max(columns):
            continue
        test, rate = _TEST.match(cells[columns[0]]), _RATE.match(cells[columns[1]])
        if test and rate:
            n_prompt, n_gen, depth = (int(g or 0) for g in test.groups())
            rows.append(BenchRow(n_prompt, n_gen, float(rate.group(1)), float(rate.group(1)), n_depth=depth))
    build = _BUILD.search(text)
    return BenchOutput(rows, f"{build.group(1)} ({build.group(2)})" if build else "unknown")


_BATCHED_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 6 + r"\s*$")


def parse_batched_bench(text: str) -> dict[int, float]:
    """llama-batched-bench's output: {streams: aggregate decode tok/s (S_TG)}, from its table rows
    (| PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |) or its JSONL lines."""
    rates = {}
    for line in text.splitlines():
        line = line.strip()
        if m := _BATCHED_ROW.match(line):
            rates.setdefault(int(m.group(3)), float(m.group(8)))  # a stream count's first row: the one asked for
        elif line.startswith("{") and '"speed_tg"' in line:
            row = json.loads(line)
            rates.setdefault(int(row["pl"]), float(row["speed_tg"]))
    return rates


# ---- running them -------------------------------------------------------------------------------

def run_tool(command: list[str], log_path: Path, timeout_s: float, stdout_path: Path | None = None) -> str:
    """Run one tool with the user's environment and return what it printed: its stdout goes to
    `stdout_path` when given (llama-bench's JSON, kept apart from its chatter), else with its stderr
    to `log_path` (batched-bench's table: llama.cpp prints it on stdout, ik_llama.cpp on stderr).
    It runs in the log's directory: ik_llama.cpp's tools also write a llama.log where they run."""
    from splitmoe import user_environment  # the package's import sets our runtime defaults; not theirs

    with contextlib.ExitStack() as files:
        log = files.enter_context(open(log_path, "wb"))
        log.write(f"$ {shlex.join(command)}\n".encode())
        log.flush()
        out = files.enter_context(open(stdout_path, "wb")) if stdout_path else log
        try:
            # the user's environment: the peer as it runs for them, not with our runtime defaults
            done = subprocess.run(command, stdout=out, stderr=log, timeout=timeout_s, env=user_environment(),
                                  cwd=log_path.parent)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{Path(command[0]).name} did not finish within {timeout_s:g} s "
                               f"(log: {log_path})") from None
    if done.returncode != 0:
        raise child_failed(Path(command[0]).name, done.returncode, log_path)
    return (stdout_path or log_path).read_text(errors="replace")


@dataclass(frozen=True, slots=True)
class VariantFigures:
    prefill_tok_s: float
    decode_tok_s: float               # after a prompt_tokens prompt, as our single stream
    streams_tok_s: dict[int, float]   # every stream count batched-bench ran
    version: str
    settings: dict
    decode_at_empty_context_tok_s: float = math.nan  # llama-bench's plain tgN


def run_variant(fork: Fork, variant: Variant, bin_dir: Path, model_path: str, threads: int, w: Workload,
                run_dir: Path, timeout_s: float) -> tuple[VariantFigures, list[str]]:
    tag = f"{fork.key}{_file_tag(variant.flags)}"
    bench = bench_command(bin_dir, model_path, threads, w, variant, after_prompt=fork.after_prompt)
    out = parse_llama_bench(run_tool(bench, run_dir / f"{tag}-bench.log", timeout_s, run_dir / f"{tag}-bench.json"))
    pp = _row(out.rows, lambda r: (r.n_prompt, r.n_gen, r.n_depth) == (w.prompt_tokens, 0, 0), "prompt processing", bench)
    tg = _row(out.rows, lambda r: (r.n_prompt, r.n_gen, r.n_depth) == (0, w.decode_tokens, w.prompt_tokens),
              f"token generation after a {w.prompt_tokens}-token prompt", bench)
    empty = [r for r in out.rows if (r.n_prompt, r.n_gen, r.n_depth) == (0, w.decode_tokens, 0)]
    batched = batched_command(bin_dir, model_path, threads, w, variant)
    rates = run_batched(batched, stream_counts(w), run_dir / f"{tag}-batched.log", timeout_s)
    figures = VariantFigures(prefill_tok_s=pp.best_tok_s, decode_tok_s=tg.avg_tok_s, streams_tok_s=rates,
                             version=out.version, settings=pp.settings,
                             decode_at_empty_context_tok_s=empty[0].avg_tok_s if empty else math.nan)
    return figures, [shlex.join(bench), shlex.join(batched)]


def run_batched(command: list[str], counts: list[int], log_path: Path, timeout_s: float) -> dict[int, float]:
    """{streams: S_TG} for every count asked, from up to BATCHED_ATTEMPTS runs (only the last log kept)."""
    for _ in range(BATCHED_ATTEMPTS):
        rates = parse_batched_bench(run_tool(command, log_path, timeout_s))
        if not (missing := [n for n in counts if n not in rates]):
            return rates
    raise RuntimeError(f"{BATCHED_TOOL} printed no row for {missing} streams in {BATCHED_ATTEMPTS} runs "
                       f"(log: {log_path})")


def _file_tag(flags: str) -> str:
    return "" if flags == "defaults" else "-" + re.sub(r"[^A-Za-z0-9]+", "", flags)


def _row(rows: list[BenchRow], wanted: Callable[[BenchRow], bool], what: str, command: list[str]) -> BenchRow:
    found = [r for r in rows if wanted(r)]
    if not found:
        raise RuntimeError(f"{BENCH_TOOL} reported no {what} test (command: {shlex.join(command)})")
    return found[0]


def better_of(w: Workload, results: dict[str, VariantFigures]) -> tuple[dict, dict]:
    """Per figure, the best variant's value and its flags: ({figure: value}, {figure: flags}).
    Prefill counts its fastest repetition (as bench.driver counts the fastest prefill prompt),
    decode llama-bench's mean (our single stream is one run); sweep counts go under `sweep_tok_s`."""
    def best(value: Callable[[VariantFigures], float]) -> tuple[float, str]:
        flags = max(results, key=lambda f: _finite(value(results[f])))
        return value(results[flags]), flags

    values, flags = {}, {}
    for name, get in (("prefill_tok_s", lambda v: v.prefill_tok_s), ("decode_tok_s", lambda v: v.decode_tok_s),
                      ("decode16_tok_s", lambda v: v.streams_tok_s[w.streams])):
        values[name], flags[name] = best(get)
    values["sweep_tok_s"], flags["sweep_tok_s"] = {}, {}
    for n in w.sweep:
        values["sweep_tok_s"][n], flags["sweep_tok_s"][n] = best(lambda v, n=n: v.streams_tok_s[n])
    return values, flags


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -math.inf


def run_peer(fork_name: str, bin_dir: Path, model_path: str, threads: int, w: Workload, run_dir: Path,
             say: Callable[[str], None] = lambda line: None, timeout_s: float = 1800.0) -> PeerResult:
    """Every variant of the fork, one after the other; per figure the better one."""
    fork, model_path = FORKS[fork_name], str(Path(model_path).resolve())  # the tools run in run_dir
    results, commands = {}, []
    for variant in fork.variants:
        if len(fork.variants) > 1:
            say(f"    {variant.flags}")
        results[variant.flags], ran = run_variant(fork, variant, bin_dir, model_path, threads, w, run_dir, timeout_s)
        commands += ran
    values, flags = better_of(w, results)
    first = next(iter(results.values()))
    return PeerResult(prefill_tok_s=values["prefill_tok_s"], ttft_s=w.prompt_tokens / values["prefill_tok_s"],
                      decode_tok_s=values["decode_tok_s"], decode16_tok_s=values["decode16_tok_s"],
                      version=first.version, sweep_tok_s=values["sweep_tok_s"], flags=flags,
                      variants={f: _variant_json(v) for f, v in results.items()}, commands=commands)


def _variant_json(v: VariantFigures) -> dict:
    return {"prefill_tok_s": v.prefill_tok_s, "decode_tok_s": v.decode_tok_s,
            "decode_at_empty_context_tok_s": v.decode_at_empty_context_tok_s,
            "streams_tok_s": dict(sorted(v.streams_tok_s.items())), "settings": v.settings}
