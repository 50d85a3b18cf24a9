"""The prepared GPU check's Python half (bench/gpu/prepare.sh here, bench/gpu/run.sh on the GPU
machine): which llama.cpp fixtures travel with the tree, whether the carried wheels' requirements
are met there, and the table that ends the check.

    python -m splitmoe.bench.gpu_check fixtures SRC DST     copy the CUDA tests' fixtures
    python -m splitmoe.bench.gpu_check check-wheels DIR IMAGE_PACKAGES
    python -m splitmoe.bench.gpu_check table OUT           OUT/gpu-table.md from OUT/bench-<N>l-<device>.json

The GPU machine has no network and takes 64 MiB of tree, so the fixtures are a subset: every
family's q8_0 and q4_k_m files (the CUDA tests load them: test_static_decode.py, test_device_experts.py),
and only the references the quantized bfloat16 tests read (test_fixtures.py on the CPU,
test_cuda_fixtures.py on CUDA); tests/bench/test_gpu_check.py holds these lists to the tests'.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from splitmoe.bench.report import markdown_table, number, ratio

# test_cuda_fixtures.FAMILIES (test_fixtures.ARCHS and gpt-oss), QUANTS, PER_POSITION_ARCHS and
# exact_reference's names.
REFERENCE_FAMILIES = ("qwen3moe", "qwen2moe", "mixtral", "olmoe", "dbrx", "deepseek", "glm4moe", "llama4", "gptoss")
FAMILIES = (*REFERENCE_FAMILIES, "deepseek2", "deepseek3")  # whose quantized files travel
QUANTS = ("q8_0", "q4_k_m")
FLIP_FAMILIES = ("dbrx", "deepseek", "glm4moe", "llama4")  # their llama.cpp runs' routing flips are counted
EXACT_REFERENCE = {"deepseek": "llamacpp_deq"}  # else "hfdeq": transformers on the dequantized weights

# The targets, on the same machine: attention on CUDA against attention on its CPU.
DECODE_SPEEDUP_TARGET = 1.5     # single-stream decode, CUDA attention / CPU attention, at least
OUTSIDE_EXPERTS_TARGET_PCT = 15.0  # of a concurrent-streams step outside the expert services, less than
BENCH_JSON = re.compile(r"bench-(\d+)l-(cpu|cuda)\.json")


# ---- what travels -------------------------------------------------------------------------------

def fixture_files(num_prompts: int, families: tuple[str, ...] = FAMILIES) -> list[str]:
    """Paths under the fixtures folder the CUDA tests read: each family's quantized files, the
    exact-dequant reference of each where the bfloat16 tests compare against it, and llama.cpp's
    own runs where their flips are counted."""
    files = ["prompts.json"]
    for arch in families:
        for quant in QUANTS:
            files.append(f"{arch}/{arch}-{quant}.gguf")
            refs = [f"{EXACT_REFERENCE.get(arch, 'hfdeq')}_{quant}"] if arch in REFERENCE_FAMILIES else []
            if arch in FLIP_FAMILIES:
                refs.append(f"llamacpp_{quant}")
            files += [f"{arch}/ref/{ref}_p{i}.npy" for ref in refs for i in range(num_prompts)]
    return files


def copy_fixtures(src: Path, dst: Path, families: tuple[str, ...] = FAMILIES) -> int:
    """Mirror the subset into `dst` (files whose size matches are kept, files no longer listed
    removed, so a second run copies nothing); its size in bytes."""
    num_prompts = len(json.loads((src / "prompts.json").read_text())["prompts"])
    wanted = fixture_files(num_prompts, families)
    missing = [f for f in wanted if not (src / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{src}: missing {', '.join(missing)}")
    for path in [p for p in dst.rglob("*") if p.is_file()] if dst.is_dir() else []:
        if path.relative_to(dst).as_posix() not in wanted:
            path.unlink()
    for name in wanted:
        source, target = src / name, dst / name
        if not target.is_file() or target.stat().st_size != source.stat().st_size:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
    return sum((dst / name).stat().st_size for name in wanted)


# ---- the carried wheels' requirements -----------------------------------------------------------

# The GPU machine's interpreter, for the wheels' environment markers.
TARGET_ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
                      "platform_python_implementation": "CPython", "sys_platform": "linux", "os_name": "posix",
                      "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}


def wheel_problems(wheels: list[Path], image_packages: set[str]) -> list[str]:
    """What would keep the carried wheels from working together on the image: a package carried
    twice, or a requirement (for Python 3.12 on x86-64 Linux, no extras) that no carried wheel's
    version meets and that the image does not name. Empty: none found (the image's own versions
    are not known here)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    carried, problems = {}, []
    for wheel in wheels:
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if name in carried:
            problems.append(f"{name} carried twice: {carried[name]} and {version}")
        carried[name] = version
    image = {canonicalize_name(n) for n in image_packages}
    for wheel in wheels:
        for line in _requires_dist(wheel):
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(TARGET_ENVIRONMENT):
                continue
            name = canonicalize_name(req.name)
            if name in carried:
                if not req.specifier.contains(carried[name], prereleases=True):
                    problems.append(f"{wheel.name} needs {line}: carried {name} {carried[name]}")
            elif name not in image:
                problems.append(f"{wheel.name} needs {line}: neither carried nor in the image")
    return problems


def _requires_dist(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        [metadata] = [n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        text = z.read(metadata).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def read_package_list(path: Path) -> set[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line}


# ---- the table ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Row:
    label: str
    value: Callable[[dict], float | None]  # a run's figures -> the number, or None when missing
    higher_is_better: bool


ROWS = (
    Row("prefill tok/s ({prompt}-token prompt)", lambda f: f.get("prefill_tok_s"), True),
    Row("time to first token, s", lambda f: f.get("ttft_s"), False),
    Row("decode tok/s (1 stream)", lambda f: f.get("decode_tok_s"), True),
    Row("decode tok/s ({streams} streams, total)", lambda f: f.get("decode16_tok_s"), True),
    Row("per-hop overhead, µs", lambda f: f.get("hop_us"), False),
    Row("{streams}-stream step, ms", lambda f: (f.get("streams_step") or {}).get("step_ms"), False),
    Row("{streams}-stream step outside the expert services, %", lambda f: f.get("outside_experts_pct"), False),
)


def read_runs(out_dir: Path) -> dict[tuple[int, str], dict]:
    """(layers, attention device) -> the bench JSON of `bench-<layers>l-<device>.json`."""
    runs = {}
    for path in sorted(out_dir.glob("bench-*l-*.json")):
        if match := BENCH_JSON.fullmatch(path.name):
            runs[(int(match.group(1)), match.group(2))] = json.loads(path.read_text())
    return runs


def gpu_table(runs: dict[tuple[int, str], dict], note: str = "") -> str:
    """Per model depth: CPU attention, CUDA attention and how many times better CUDA is, then
    the targets, each met, missed or not measured."""
    any_run = next(iter(runs.values()), {})
    workload = any_run.get("workload", {})
    layers = sorted({n for n, _ in runs})
    header = ("metric", *(h for n in layers for h in (f"{_layers(n)}, CPU attn", f"{_layers(n)}, CUDA attn",
                                                       "CUDA vs CPU")))
    rows = [header]
    for row in ROWS:
        cells = [row.label.format(prompt=workload.get("prompt_tokens", "?"), streams=workload.get("streams", "?"))]
        for n in layers:
            cpu, cuda = (row.value(runs.get((n, d), {})) for d in ("cpu", "cuda"))
            r = ratio(cuda, cpu, row.higher_is_better)
            cells += [number(cpu), number(cuda), f"{r:.2f}×" if r is not None else "-"]
        rows.append(tuple(cells))
    gpu = next((f["gpu"] for f in runs.values() if f.get("gpu")), None)
    title = f"GPU check: attention on {gpu or 'no GPU measured'}, expert services on {any_run.get('cpu', '?')}"
    lines = [f"## {title}", ""]
    if note:
        lines += [note, ""]
    lines += [markdown_table(rows) if layers else "(no bench JSON found)", "",
              *target_lines(runs, layers, workload.get("streams", "?")), "",
              *context(runs)]
    return "\n".join(lines) + "\n"


def target_lines(runs: dict[tuple[int, str], dict], layers: list[int], streams: object) -> list[str]:
    speedups, shares = [], []
    for n in layers:
        cpu, cuda = runs.get((n, "cpu"), {}), runs.get((n, "cuda"), {})
        r = ratio(cuda.get("decode_tok_s"), cpu.get("decode_tok_s"), True)
        pct = cuda.get("outside_experts_pct")
        speedups.append(f"{_layers(n)} " + (_judged(f"{r:.2f}×", r >= DECODE_SPEEDUP_TARGET) if r is not None
                                            else "not measured"))
        shares.append(f"{_layers(n)} " + (_judged(f"{pct:.1f}%", pct < OUTSIDE_EXPERTS_TARGET_PCT) if pct is not None
                                          else "not measured"))
    return [f"target: single-stream decode, CUDA attention / CPU attention >= {DECODE_SPEEDUP_TARGET}×: "
            + ("; ".join(speedups) or "not measured"),
            f"target: a {streams}-stream step (CUDA attention) outside the expert services "
            f"< {OUTSIDE_EXPERTS_TARGET_PCT:.0f}%: " + ("; ".join(shares) or "not measured")]


def _judged(value: str, met: bool) -> str:
    return f"{value} {'MET' if met else 'MISSED'}"


def _layers(n: int) -> str:
    return f"{n} layer" if n == 1 else f"{n} layers"


def context(runs: dict[tuple[int, str], dict]) -> list[str]:
    lines = []
    for (n, device), f in sorted(runs.items()):
        lines.append(f"{_layers(n)}, {device} attention: {Path(f.get('model', '?')).name}, {f.get('threads')} threads, "
                     f"{f.get('expert_services')} expert service(s), transport {f.get('transport')}, "
                     f"native kernels {f.get('native_isa') or 'none'}, {f.get('wall_s', 0):.0f} s; {f.get('command')}")
    return lines


# ---- the command line ---------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitmoe.bench.gpu_check", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fixtures", help="copy the CUDA tests' fixtures (a subset) from SRC to DST")
    f.add_argument("src", type=Path)
    f.add_argument("dst", type=Path)
    f.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: %(default)s)")
    w = sub.add_parser("check-wheels", help="the carried wheels' requirements, against the image's package list")
    w.add_argument("wheels", type=Path)
    w.add_argument("image_packages", type=Path)
    t = sub.add_parser("table", help="OUT/gpu-table.md from OUT/bench-<N>l-<device>.json, printed too")
    t.add_argument("out", type=Path)
    t.add_argument("--note", default="", help="a line under the title (e.g. what a dry run left out)")
    args = p.parse_args(argv)
    if args.command == "fixtures":
        size = copy_fixtures(args.src, args.dst, tuple(a for a in args.families.split(",") if a))
        print(f"fixtures: {args.dst} {size / 2**20:.1f} MiB")
        return 0
    if args.command == "check-wheels":
        wheels = sorted(args.wheels.glob("*.whl"))
        problems = wheel_problems(wheels, read_package_list(args.image_packages))
        for line in problems:
            print(f"wheels: {line}", file=sys.stderr)
        print(f"wheels: {len(wheels)} in {args.wheels}, {len(problems)} problems")
        return 1 if problems else 0
    text = gpu_table(read_runs(args.out), args.note)
    (args.out / "gpu-table.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
