"""The prepared GPU check: bench/gpu_check.py (what travels, the wheels' requirements, the final
table) and the two scripts around it, bench/gpu/prepare.sh and bench/gpu/run.sh.

The scripts themselves run on the GPU machine (run.sh) or need PyPI (prepare.sh): here they are
held to their syntax and their usage text; `bench/gpu/run.sh OUT --dry-run` rehearses the rest
(too slow for the suite). The table is tested on made-up bench JSON, as the dry run writes it.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from splitmoe.bench.gpu_check import (
    FAMILIES,
    FLIP_FAMILIES,
    QUANTS,
    REFERENCE_FAMILIES,
    copy_fixtures,
    fixture_files,
    gpu_table,
    main,
    read_runs,
    wheel_problems,
)
from tests.support.processes import REPO

SCRIPTS = (REPO / "bench" / "gpu" / "prepare.sh", REPO / "bench" / "gpu" / "run.sh")


# ---- what travels -------------------------------------------------------------------------------

def test_the_carried_fixtures_are_what_the_cuda_tests_read():
    from tests.attention_service.expert_backends import test_device_experts
    from tests.attention_service.model import test_cuda_fixtures, test_fixtures, test_static_decode

    assert set(REFERENCE_FAMILIES) == set(test_fixtures.ARCHS) | set(test_cuda_fixtures.FAMILIES)
    assert set(FLIP_FAMILIES) == set(test_fixtures.PER_POSITION_ARCHS) and list(QUANTS) == test_fixtures.QUANTS
    files = set(fixture_files(num_prompts=2))
    for arch in REFERENCE_FAMILIES:
        for quant in QUANTS:
            assert {f"{arch}/ref/{test_fixtures.exact_reference(arch, quant)}_p{i}.npy" for i in range(2)} <= files
    for arch in test_static_decode.FAMILIES:
        assert f"{arch}/{arch}-q8_0.gguf" in files, arch
    assert set(test_device_experts.FIXTURES) <= files
    assert set(test_static_decode.FAMILIES) <= set(FAMILIES)
    assert "prompts.json" in files and not any("f32" in f or "hf_float32" in f for f in files)  # too big, unread


def test_copy_fixtures_mirrors_the_subset_and_a_second_run_changes_nothing(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "dbrx" / "ref").mkdir(parents=True)
    (src / "prompts.json").write_text(json.dumps({"prompts": [{"ids": [1]}, {"ids": [2]}]}))
    wanted = fixture_files(2, ("dbrx",))
    for i, name in enumerate(wanted[1:]):
        (src / name).write_bytes(bytes(10 + i))
    (src / "dbrx" / "dbrx-f32.gguf").write_bytes(bytes(1000))  # not read by the CUDA tests: stays behind
    (dst / "olmoe").mkdir(parents=True)
    (dst / "olmoe" / "olmoe-q8_0.gguf").write_bytes(b"left from an earlier list")

    size = copy_fixtures(src, dst, ("dbrx",))
    copied = sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file())
    assert copied == sorted(wanted) and size == sum((src / f).stat().st_size for f in wanted)
    assert "dbrx/ref/llamacpp_q8_0_p1.npy" in copied  # dbrx's flips are counted against llama.cpp's
    mtimes = {f: (dst / f).stat().st_mtime_ns for f in wanted}
    assert copy_fixtures(src, dst, ("dbrx",)) == size
    assert {f: (dst / f).stat().st_mtime_ns for f in wanted} == mtimes

    (src / wanted[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=wanted[-1]):
        copy_fixtures(src, dst, ("dbrx",))


def _wheel(folder: Path, name: str, version: str, *requires: str) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    metadata = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                          *(f"Requires-Dist: {r}" for r in requires)]) + "\n"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", metadata)
    return path


def test_wheel_problems_name_unmet_requirements_for_python_312(tmp_path):
    a = _wheel(tmp_path, "alpha", "1.0", "beta>=2", "numpy", "old-thing; python_version < '3.11'",
               'docs-thing; extra == "docs"', "typing-extensions>=4.14; python_version < '3.13'")
    b = _wheel(tmp_path, "beta", "2.1", "Typing_Extensions")
    t = _wheel(tmp_path, "typing_extensions", "4.16.0")
    assert wheel_problems([a, b, t], {"numpy"}) == []
    assert wheel_problems([a, b], {"numpy"}) == [
        "alpha-1.0-py3-none-any.whl needs typing-extensions>=4.14; python_version < '3.13': neither carried nor in "
        "the image", "beta-2.1-py3-none-any.whl needs Typing_Extensions: neither carried nor in the image"]
    assert wheel_problems([a, b], {"numpy", "typing-extensions"}) == []  # the image's version is not known here
    (tmp_path / "old").mkdir()
    old_beta = _wheel(tmp_path / "old", "beta", "1.9")
    assert wheel_problems([a, old_beta, t], {"numpy"}) == [
        "alpha-1.0-py3-none-any.whl needs beta>=2: carried beta 1.9"]
    assert wheel_problems([a, b, old_beta, t], {"numpy"})[0] == "beta carried twice: 2.1 and 1.9"


def test_the_prepared_wheels_meet_each_others_requirements_on_the_image():
    wheels = sorted((REPO / ".gpu" / "wheels").glob("*.whl"))
    if not wheels:
        pytest.skip("no .gpu/wheels: bench/gpu/prepare.sh has not run in this checkout")
    from splitmoe.bench.gpu_check import read_package_list

    assert wheel_problems(wheels, read_package_list(REPO / "bench" / "gpu" / "image-packages.txt")) == []


# ---- the table ----------------------------------------------------------------------------------

def _figures(device: str, decode: float, outside_pct: float | None, gpu: str | None = None) -> dict:
    return {"prefill_tok_s": 1000.0, "ttft_s": 0.5, "decode_tok_s": decode, "decode16_tok_s": 8 * decode,
            "hop_us": 30.0, "outside_experts_pct": outside_pct, "streams_step": {"step_ms": 40.0},
            "attention_device": device, "gpu": gpu, "cpu": "Some CPU", "model": "/tmp/m.gguf", "threads": 16,
            "expert_services": 1, "transport": "shm", "native_isa": "avx512vnni", "wall_s": 30.0,
            "command": f"splitmoe bench run --attention-device {device}",
            "workload": {"prompt_tokens": 512, "streams": 16}}


def test_the_table_compares_cuda_with_cpu_attention_and_judges_the_targets(tmp_path):
    runs = {(6, "cpu"): _figures("cpu", 20.0, 40.0), (6, "cuda"): _figures("cuda", 50.0, 9.5, "NVIDIA H100"),
            (24, "cpu"): _figures("cpu", 10.0, 45.0), (24, "cuda"): _figures("cuda", 12.0, 21.0, "NVIDIA H100")}
    for (n, device), figures in runs.items():
        (tmp_path / f"bench-{n}l-{device}.json").write_text(json.dumps(figures))
    (tmp_path / "bench-notes.json").write_text("{}")  # not a run: left out
    assert read_runs(tmp_path) == runs

    assert main(["table", str(tmp_path), "--note", "made up"]) == 0
    text = (tmp_path / "gpu-table.md").read_text()
    assert text == gpu_table(runs, "made up")
    assert text.startswith("## GPU check: attention on NVIDIA H100, expert services on Some CPU\n\nmade up\n")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ")}
    assert rows["metric"] == ["6 layers, CPU attn", "6 layers, CUDA attn", "CUDA vs CPU",
                              "24 layers, CPU attn", "24 layers, CUDA attn", "CUDA vs CPU"]
    assert rows["decode tok/s (1 stream)"] == ["20.0", "50.0", "2.50×", "10.0", "12.0", "1.20×"]
    assert rows["16-stream step outside the expert services, %"][:3] == ["40.0", "9.5", "4.21×"]
    assert "target: single-stream decode, CUDA attention / CPU attention >= 1.5×: 6 layers 2.50× MET; " \
           "24 layers 1.20× MISSED" in text
    assert "outside the expert services < 15%: 6 layers 9.5% MET; 24 layers 21.0% MISSED" in text


def test_a_dry_runs_table_has_cpu_figures_and_no_verdicts(tmp_path):
    text = gpu_table({(1, "cpu"): _figures("cpu", 20.0, 60.0)})
    assert "attention on no GPU measured" in text and "| 1 layer, CPU attn |" in text.replace("  ", " ")
    assert "1 layer not measured" in text and "MET" not in text and "MISSED" not in text
    assert gpu_table({}).count("not measured") == 2 and "(no bench JSON found)" in gpu_table({})


# ---- the scripts --------------------------------------------------------------------------------

@pytest.mark.stack
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_scripts_parse_and_explain_themselves(script):
    bash = shutil.which("bash")
    assert bash is not None
    assert subprocess.run([bash, "-n", str(script)], capture_output=True, text=True, timeout=30).returncode == 0
    done = subprocess.run([bash, str(script), "--help"], capture_output=True, text=True, timeout=30, cwd="/")
    assert done.returncode == 0, done.stderr
    assert "usage: bench/gpu/" in done.stdout and ".gpu/" in done.stdout


@pytest.mark.stack
def test_run_sh_wants_one_out_folder_and_knows_its_options():
    run = [shutil.which("bash"), str(SCRIPTS[1])]
    for args, said in [([], "OUT folder missing"), (["a", "b"], "one OUT folder"), (["a", "--fast"], "unknown option")]:
        done = subprocess.run([*run, *args], capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and said in done.stderr, (args, done.stderr)
    help_text = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=30).stdout
    assert "--dry-run" in help_text and "pytest -m cuda" in help_text and "OUT/gpu-table.md" in help_text


@pytest.mark.stack
def test_the_carried_folder_is_ignored_by_git():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    paths = [".gpu/wheels/x.whl", ".gpu/fixtures/prompts.json"]
    done = subprocess.run(["git", "check-ignore", *paths], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.stdout.split() == paths, ".gpu/ must stay out of the tree: it travels as a carried path"
