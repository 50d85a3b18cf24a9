"""`splitmoe bench run`: SplitMoE through its real services, the same engine in-process, and
optionally its peers on the same file and threads (llama.cpp, ik_llama.cpp), with the
memory-bandwidth ceilings of decode.

Order: the bandwidth (nothing else running), the services (this process only drives them), the
in-process engine (the services are gone), then each peer in child processes, in the order asked.
Each engine warms up on its own prompt first, so every one is measured with the file in the page
cache. llama.cpp runs through llama-cpp-python (bench/llamacpp.py: our prompts, our phases) unless
a build directory is given; ik_llama.cpp always runs its build's own tools (bench/peer_cli.py).
"""
from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from splitmoe.bench.peer_cli import FORKS, check_bin_dir
from splitmoe.bench.peer_cli import run_peer as run_tools
from splitmoe.bench.workload import Workload, make_prompts, normal_token_ids
from splitmoe.runtime.memory import MIB

BASELINES = ("none", "llama.cpp", "ik_llama.cpp")
ATTENTION_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, slots=True)
class BenchSettings:
    model_path: str
    threads: int
    workload: Workload = Workload()
    baselines: tuple[str, ...] = ()    # the peers to run too, in order: "llama.cpp", "ik_llama.cpp"
    llama_cpp_dir: str = ""            # a llama.cpp build's bin directory: its tools, not llama-cpp-python
    ik_llama_cpp_dir: str = ""         # ik_llama.cpp's (its tools are the only way it runs)
    expert_services: int = 1            # one per NUMA node is the design (the CLI's default counts them)
    transport: str = "auto"
    dtype: str = "bfloat16"            # the attention side's (float32 is the exact reference path)
    attention_device: str = "cpu"      # the attention service's; the in-process run stays on the CPU
    omp_wait_policy: str = "PASSIVE"   # for the service processes; "" leaves OpenMP's default
    pin_threads: bool = True           # as `splitmoe up` runs them (its --no-pin-threads: False)
    inprocess: bool = True
    bandwidth_mb: int = 1024
    run_dir: str = ""

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        for name in self.baselines:
            if name not in BASELINES:
                raise ValueError(f"--baseline must be one of {', '.join(BASELINES)}, got {name!r}")
        object.__setattr__(self, "baselines", tuple(dict.fromkeys(n for n in self.baselines if n != "none")))
        if "ik_llama.cpp" in self.baselines and not self.ik_llama_cpp_dir:
            raise ValueError("--baseline ik_llama.cpp needs its build's bin directory: --ik-llama-cpp-dir DIR "
                             "(or SPLITMOE_IK_LLAMA_CPP_BIN)")
        if self.expert_services < 0:
            raise ValueError(f"--expert-services must be >= 0, got {self.expert_services}")
        if self.bandwidth_mb < 16:
            raise ValueError(f"--bandwidth-mb must be >= 16, got {self.bandwidth_mb}")
        if self.attention_device not in ATTENTION_DEVICES:
            raise ValueError(f"--attention-device must be one of {', '.join(ATTENTION_DEVICES)}, "
                             f"got {self.attention_device!r}")


def run_bench(settings: BenchSettings, say: Callable[[str], None] = print) -> dict:
    """Every figure, as the JSON that `--json` writes; see report.table for the printed form."""
    from splitmoe.bench.ceiling import ExpertBytes, ceiling_tok_s, dense_bytes_per_token, read_bandwidth_gb_s
    from splitmoe.bench.services import ServicesOptions, run_services
    from splitmoe.local_stack import make_run_dir
    from splitmoe.modelfile.gguf_file import GGUFFile

    started = time.perf_counter()
    s, w = settings, settings.workload
    if not Path(s.model_path).is_file():
        raise ValueError(f"{s.model_path}: no such file")
    peer_dirs = check_peers(s)  # before minutes of measuring, not after
    gpu = gpu_name() if s.attention_device == "cuda" else None
    if s.attention_device == "cuda" and gpu is None:
        raise ValueError("--attention-device cuda: torch sees no CUDA GPU here")
    run_dir = make_run_dir(s.run_dir or "")
    say(f"splitmoe bench run: {Path(s.model_path).name}, {s.threads} threads; logs in {run_dir}/")
    g = GGUFFile(s.model_path)
    vocab = len(g.get("tokenizer.ggml.tokens", [])) or int(g.arch_require("vocab_size"))
    prompts = make_prompts(w, normal_token_ids(g.get("tokenizer.ggml.token_type"), vocab))
    expert_bytes = ExpertBytes.of(g)

    say(f"  memory read bandwidth ({s.threads} threads, {s.bandwidth_mb} MB buffer)")
    bandwidth = read_bandwidth_gb_s(s.threads, s.bandwidth_mb)
    # Measured again before each engine: where the machine's bandwidth moves during a run (a shared
    # host's does, by up to 40% within minutes), the ratios mix its states, and the report says so.
    bandwidth_before = {"services": bandwidth}
    wall = {"bandwidth": time.perf_counter() - started}  # seconds per phase, each from the end of the one before

    def lap(name: str) -> None:
        wall[name] = time.perf_counter() - started - sum(v for k, v in wall.items() if k != "services_startup")

    say(f"  services: attention (on {gpu or s.attention_device}) + {s.expert_services} expert services")
    services = run_services(s.model_path, w, prompts, ServicesOptions(
        threads=s.threads, expert_services=s.expert_services, transport=s.transport, dtype=s.dtype,
        attention_device=s.attention_device, omp_wait_policy=s.omp_wait_policy, pin_threads=s.pin_threads),
        run_dir, say)
    m = services.measured
    say(_summary(m, w) + (f", per hop {services.hop_us:.0f} µs" if services.hop_us else ""))
    share = services.streams_share
    if share is not None and share.outside_experts is not None:
        say(f"    {w.streams}-stream steps: {share.step_ms:.1f} ms each, "
            f"{100 * share.outside_experts:.1f}% outside the expert services")
    lap("services")
    wall["services_startup"] = services.startup_s  # part of "services"
    detail = {"services": asdict(m), "wall_s": wall}
    curves = {"services": _curve(m, w)}
    figures: dict = {"prefill_tok_s": m.prefill_tok_s, "decode_tok_s": m.decode_tok_s,
                     "decode16_tok_s": m.decode16_tok_s, "decode16_alike_tok_s": m.decode16_alike_tok_s,
                     "ttft_s": m.ttft_s, "hop_us": services.hop_us,
                     "hop_us_method": services.hop_method,
                     "outside_experts_pct": _pct(share.outside_experts) if share else None,
                     "streams_step": _share_figures(share),
                     "memory_mib": {name: {"own": r.own_bytes / MIB, "mapped_file": r.file_bytes / MIB,
                                           "shared": r.shared_bytes / MIB} for name, r in services.memory.items()}}
    for name, r in services.memory.items():
        say(f"    memory of {name}: {r.describe()}")

    touched, touched_source = None, "uniform-routing estimate"
    if s.inprocess:
        from splitmoe.bench.inprocess import run_inprocess

        say("  in-process: the same engine, experts in this process")
        bandwidth_before["inprocess"] = read_bandwidth_gb_s(s.threads, s.bandwidth_mb)
        inproc = run_inprocess(g, w, prompts, s.threads, s.dtype, expert_bytes, say)
        lap("inprocess")
        im = inproc.measured
        say(_summary(im, w))
        detail["inprocess"] = asdict(im)
        curves["inprocess"] = _curve(im, w)
        figures |= {"inprocess_prefill_tok_s": im.prefill_tok_s, "inprocess_decode_tok_s": im.decode_tok_s,
                    "inprocess_decode16_tok_s": im.decode16_tok_s,
                    "inprocess_decode16_alike_tok_s": im.decode16_alike_tok_s, "inprocess_ttft_s": im.ttft_s}
        if inproc.touched_expert_bytes_per_step is not None:
            touched, touched_source = inproc.touched_expert_bytes_per_step, "counted in the in-process run"
    if touched is None:
        touched = expert_bytes.uniform_estimate_per_step(w.streams)

    for name in s.baselines:
        key, bin_dir = FORKS[name].key, peer_dirs.get(name)  # key: its figures' prefix in the JSON
        bandwidth_before[key] = read_bandwidth_gb_s(s.threads, s.bandwidth_mb)
        base = run_peer(name, bin_dir, s, prompts, run_dir, say)
        lap(key)
        say(_summary(base, w))
        curves[key] = _curve(base, w)
        streams_key = "decode16_alike_tok_s" if FORKS[name].streams_alike else "decode16_tok_s"
        figures |= {f"{key}_prefill_tok_s": base.prefill_tok_s, f"{key}_decode_tok_s": base.decode_tok_s,
                    f"{key}_{streams_key}": base.decode16_tok_s, f"{key}_ttft_s": base.ttft_s,
                    f"{key}_version": base.version}
        if bin_dir is not None:  # its own tools: where they came from, which flags won, what ran
            figures |= {f"{key}_bin_dir": str(bin_dir), f"{key}_flags": base.flags,
                        f"{key}_sweep_tok_s": base.sweep_tok_s, f"{key}_note": FORKS[name].note}
            detail[key] = {"variants": base.variants, "commands": base.commands}

    dense = dense_bytes_per_token(g)
    figures |= {
        "ceiling_decode_tok_s": ceiling_tok_s(bandwidth, expert_bytes.per_token, 1),
        "ceiling_decode16_tok_s": ceiling_tok_s(bandwidth, touched, w.streams),
        # context: the same, were every other weight (as stored in the file) read once per step too
        "ceiling_all_weights_decode_tok_s": ceiling_tok_s(bandwidth, expert_bytes.per_token + dense, 1),
        "ceiling_all_weights_decode16_tok_s": ceiling_tok_s(bandwidth, touched + dense, w.streams),
        "model": str(Path(s.model_path).resolve()), "threads": s.threads, "attention_threads": s.threads,
        "expert_services": s.expert_services, "expert_threads": services.expert_threads, "dtype": s.dtype,
        "attention_device": s.attention_device, "gpu": gpu,
        "transport": services.transport, "omp_wait_policy": s.omp_wait_policy or "default",
        "pin_threads": s.pin_threads,
        "bandwidth_gb_s": bandwidth, "bandwidth_before_gb_s": bandwidth_before,
        "expert_bytes_per_token": expert_bytes.per_token,
        "touched_expert_bytes_per_step16": touched, "touched_expert_bytes_source": touched_source,
        "dense_bytes_per_token": dense, "native_isa": native_isa(), "cpu": cpu_model(),
        "decode_curve_tok_s": curves,
        "workload": asdict(w), "detail": detail, "run_dir": str(run_dir), "command": command_line(s),
        "wall_s": time.perf_counter() - started,
    }
    from splitmoe.bench.report import add_ratios

    add_ratios(figures)
    return figures


def check_peers(s: BenchSettings) -> dict[str, Path]:
    """The bin directory of every peer that runs its build's tools; ValueError (one line) when a
    directory or tool is missing, or llama-cpp-python is, for the llama.cpp peer without one."""
    dirs = {}
    if "llama.cpp" in s.baselines:
        if s.llama_cpp_dir:
            dirs["llama.cpp"] = check_bin_dir(s.llama_cpp_dir, "--llama-cpp-dir")
        else:
            from splitmoe.bench.llamacpp import PACKAGE, available

            if not available():
                raise ValueError(f"--baseline llama.cpp needs the {PACKAGE} package (pip install 'splitmoe[bench]') "
                                 f"or a llama.cpp build: --llama-cpp-dir DIR")
    if "ik_llama.cpp" in s.baselines:
        dirs["ik_llama.cpp"] = check_bin_dir(s.ik_llama_cpp_dir, "--ik-llama-cpp-dir")
    return dirs


def run_peer(name: str, bin_dir: Path | None, s: BenchSettings, prompts, run_dir: Path, say: Callable[[str], None]):
    """One peer's figures: through its build's tools when `bin_dir` is given, else (llama.cpp)
    through llama-cpp-python on our own prompts."""
    if bin_dir is None:
        from splitmoe.bench.llamacpp import run_baseline

        say("  llama.cpp: the same file, threads and workload")
        return run_baseline(s.model_path, s.workload, prompts, s.threads, run_dir / "llamacpp.log")
    say(f"  {name}: its llama-bench and llama-batched-bench ({bin_dir}), the same file, threads and workload")
    return run_tools(name, bin_dir, s.model_path, s.threads, s.workload, run_dir, say)


def _curve(m, w: Workload) -> dict[int, float]:
    """Aggregate decode tok/s by concurrent streams: 1, the sweep's, and `streams`."""
    return dict(sorted({1: m.decode_tok_s, w.streams: m.decode16_tok_s, **m.sweep_tok_s}.items()))


def _pct(share: float | None) -> float | None:
    return None if share is None else 100.0 * share


def _share_figures(share) -> dict | None:
    """The concurrent streams' phase as bench.services.step_share measured it (see its docstring)."""
    if share is None:
        return None
    return {**asdict(share), "step_ms": share.step_ms, "outside_experts_pct": _pct(share.outside_experts),
            "outside_hops_pct": _pct(share.outside_hops),
            "definition": "1 - the busiest expert service's compute / the phase's wall time (step_share)"}


def _summary(m, w: Workload) -> str:
    alike = getattr(m, "decode16_alike_tok_s", None)
    return (f"    prefill {m.prefill_tok_s:.1f} tok/s, first token {m.ttft_s:.3f} s, "
            f"decode {m.decode_tok_s:.2f} tok/s, {w.streams} streams {m.decode16_tok_s:.2f} tok/s"
            + (f" ({alike:.2f} of one prompt)" if alike else ""))


def command_line(s: BenchSettings) -> str:
    """The command that repeats this run (the defaults left out)."""
    d, w, dw = BenchSettings(s.model_path, s.threads), s.workload, Workload()
    args = ["splitmoe", "bench", "run", "--model", s.model_path, "--threads", str(s.threads)]
    for name in s.baselines:
        args += ["--baseline", name]
    if "llama.cpp" in s.baselines and s.llama_cpp_dir:  # written out even when the environment gave it
        args += ["--llama-cpp-dir", s.llama_cpp_dir]
    if "ik_llama.cpp" in s.baselines:
        args += ["--ik-llama-cpp-dir", s.ik_llama_cpp_dir]
    for flag, value, default in [
            ("--expert-services", s.expert_services, d.expert_services),
            ("--transport", s.transport, d.transport), ("--dtype", s.dtype, d.dtype),
            ("--attention-device", s.attention_device, d.attention_device),
            ("--omp-wait-policy", s.omp_wait_policy or "default", d.omp_wait_policy),
            ("--bandwidth-mb", s.bandwidth_mb, d.bandwidth_mb), ("--prompt-tokens", w.prompt_tokens, dw.prompt_tokens),
            ("--decode-tokens", w.decode_tokens, dw.decode_tokens), ("--streams", w.streams, dw.streams),
            ("--stream-prompt-tokens", w.stream_prompt_tokens, dw.stream_prompt_tokens), ("--seed", w.seed, dw.seed)]:
        if value != default:
            args += [flag, str(value)]
    if not s.pin_threads:
        args.append("--no-pin-threads")
    if not s.inprocess:
        args.append("--no-inprocess")
    return shlex.join(args)


def cpu_model() -> str:
    from splitmoe.kernels.cpu_features import cpu_model as model

    return model()


def gpu_name() -> str | None:
    """The name of the CUDA GPU torch sees (the first), or None: none, or a CPU-only torch."""
    import torch

    try:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except (RuntimeError, AssertionError):  # a driver that answers is_available but fails the query
        return None


def native_isa() -> str | None:
    """The ISA the native expert kernels were built for, when kernels.native exists and loaded."""
    try:
        from splitmoe.kernels import native
    except ImportError:
        return None
    try:
        return native.isa() if getattr(native, "AVAILABLE", False) else None
    except Exception:  # noqa: BLE001 - a context field; never fail the benchmark over it
        return None


def write_json(figures: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(figures, indent=2) + "\n")
    os.replace(tmp, path)
