"""Split GGUF files end to end: every model, re-split into 2 and 3 parts by our llama-gguf-split
writer and named by its first part, gives logits bit-identical to the unsplit file, through
`splitmoe logits` and through real expert services; a broken set fails the command with one line.

The loader's own checks are in tests/modelfile/test_gguf_parts.py.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from gguf import GGUFReader

from splitmoe.attention_service.expert_backends.remote import RemoteExperts, RemoteExpertsSettings
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.cli import main
from splitmoe.modelfile.architectures import ARCHS
from splitmoe.modelfile.expert_tensors import expert_count
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.gguf_split import split_gguf
from tests.attention_service.model.test_hf_reference import mixtral_config
from tests.support.expert_services import ExpertServices
from tests.support.hf_reference import build_model
from tests.support.hf_to_gguf import Q8_0, convert
from tests.support.processes import CLUSTER, REPO, free_port, run_splitmoe
from tests.support.stack import running_stack, wait_http_ok

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
FIXTURES = REPO.parent / "shared" / "fixtures"
FIXTURE_FILES = sorted(FIXTURES.glob("*/*.gguf")) if FIXTURES.is_dir() else []
needs_fixtures = pytest.mark.skipif(not FIXTURE_FILES, reason=f"../shared/fixtures not found: {FIXTURES}")
TOKENS = [5, 17, 30, 42, 7, 99, 3, 11, 64, 128, 200, 0]
SPLITS = (2, 3)


def cli_logits(model: Path, out: Path) -> bytes:
    """`splitmoe logits`, float32 on the CPU: the raw bytes, so equal means bit for bit."""
    args = ["logits", str(model), "--token-ids", ",".join(map(str, TOKENS)), "--out", str(out), "--device", "cpu"]
    assert main(args) == 0
    return np.load(out).tobytes()


def skip_unless_served(model: Path) -> None:
    """Fixtures of architectures the attention service does not run yet: their split sets are read
    (tests/modelfile/test_gguf_parts.py) but give no logits to compare."""
    arch = GGUFFile(model).arch
    if arch not in ARCHS:
        pytest.skip(f"{model.name}: architecture {arch!r} is not served yet")


def split_into(model: Path, directory: Path, parts: int, **options) -> Path:
    """`model` split into `parts` files in `directory`, named as llama-gguf-split names them; the first."""
    directory.mkdir(parents=True)
    return split_gguf(model, directory / model.stem, parts, **options)[0]


def split_sets(model: Path, out_dir: Path) -> dict[int, Path]:
    """parts -> the first part of `model` split that many ways."""
    return {n: split_into(model, out_dir / f"{n}-parts", n) for n in SPLITS}


def assert_logits_survive_splitting(model: Path, tmp_path: Path) -> None:
    expected = cli_logits(model, tmp_path / "whole.npy")
    for parts, first in split_sets(model, tmp_path).items():
        assert cli_logits(first, tmp_path / f"split-{parts}.npy") == expected, f"{parts} parts"


@needs_fixtures
@pytest.mark.parametrize("model", FIXTURE_FILES, ids=lambda p: p.name)
def test_fixture_logits_through_the_logits_command(model, tmp_path):
    skip_unless_served(model)
    assert_logits_survive_splitting(model, tmp_path)


def test_demo_model_logits_through_the_logits_command(demo_gguf, tmp_path):
    assert_logits_survive_splitting(demo_gguf, tmp_path)


@pytest.mark.stack
def test_command_given_a_broken_set_says_one_line(demo_gguf, tmp_path):
    first = split_gguf(demo_gguf, tmp_path / "demo", 3)[0]
    first.with_name("demo-00002-of-00003.gguf").unlink()
    done = subprocess.run([sys.executable, "-m", "splitmoe", "logits", str(first), "--token-ids", "1,2",
                           "--out", str(tmp_path / "x.npy")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "splitmoe logits: error: demo-00002-of-00003.gguf: no such file, part 2 of 3 of demo-00001-of-00003.gguf"]


# ---- through the services -----------------------------------------------------------------------


def remote_logits(model: Path, *addresses: str) -> bytes:
    """The exact float32 path with the experts on the services at `addresses`, whose file must be `model`'s."""
    g = GGUFFile(model)
    settings = RemoteExpertsSettings(addresses=addresses, expert_timeout_s=60.0, startup_wait_s=120.0,
                                     security=CLUSTER)
    backend = RemoteExperts(g, settings)
    try:
        runner = ModelRunner.from_gguf(g, RunnerOptions(device=torch.device("cpu"), kv_cache_tokens=64),
                                       experts=backend)
        return runner.step([Sequence(0, list(TOKENS))], all_logits=True).numpy().tobytes()
    finally:
        backend.close()


def serve_each(models: dict[str, Path], log_dir: Path, halves: bool = False) -> ExpertServices:
    """One expert service per model hosting all of its experts, or two (`halves`) each hosting half;
    started in one wave. Services are named after the model, `-low` / `-high` for halves."""
    services = ExpertServices(log_dir)
    for name, model in models.items():
        n = expert_count(GGUFFile(model))
        ranges = {f"{name}-low": f"0-{n // 2 - 1}", f"{name}-high": f"{n // 2}-{n - 1}"} if halves \
            else {name: f"0-{n - 1}"}
        for service, experts in ranges.items():
            services.start(service, model, "--experts", experts)
    return services


def assert_services_logits_survive_splitting(model: Path, tmp_path: Path, halves: bool = False) -> None:
    models = {"whole": model, **{f"split-{n}": first for n, first in split_sets(model, tmp_path).items()}}
    services = serve_each(models, tmp_path, halves)
    try:
        services.wait()
        got = {name: remote_logits(path, *(services.address(s) for s in services.procs if s == name or s.startswith(f"{name}-")))
               for name, path in models.items()}
    finally:
        services.stop_all()
    for name in models:
        assert got[name] == got["whole"], name


@pytest.mark.stack
@needs_fixtures
@pytest.mark.parametrize("model", FIXTURE_FILES, ids=lambda p: p.name)
def test_fixture_logits_through_expert_services(model, tmp_path):
    skip_unless_served(model)
    assert_services_logits_survive_splitting(model, tmp_path)


@pytest.mark.stack
def test_demo_model_logits_through_expert_services(demo_gguf, tmp_path):
    assert_services_logits_survive_splitting(demo_gguf, tmp_path)


@pytest.mark.stack
def test_own_model_in_the_per_expert_layout(tmp_path):
    """Our converter's old-Mixtral layout (one tensor per expert, so a layer's experts end up in
    different parts): the logits command, and two services each hosting half of the experts."""
    model = build_model(mixtral_config(), seed=200)
    path = convert(model, tmp_path / "mixtral-per-expert.gguf", Q8_0, per_expert_tensors=True)
    for step in ("logits", "services"):
        (tmp_path / step).mkdir()
    assert_logits_survive_splitting(path, tmp_path / "logits")
    assert_services_logits_survive_splitting(path, tmp_path / "services", halves=True)
    parts = sorted((tmp_path / "services" / "3-parts").iterdir())
    holding = [p.name for p in parts if any(".ffn_gate." in t.name for t in GGUFReader(p, "r").tensors)]
    assert len(holding) > 1  # the experts were in more than one part


@pytest.mark.stack
def test_demo_model_with_experts_split_across_two_services(demo_gguf, tmp_path):
    assert_services_logits_survive_splitting(demo_gguf, tmp_path, halves=True)


@pytest.mark.stack
def test_expert_service_refuses_another_split_of_the_model(demo_gguf, tmp_path):
    """The identity the services compare covers every part: another split of the same model is
    another file to them, though its first part has the same name."""
    ours = split_into(demo_gguf, tmp_path / "ours", 3)
    theirs = split_into(demo_gguf, tmp_path / "theirs", 3, metadata_only_first=True)
    assert ours.name == theirs.name and GGUFFile(ours).file_id != GGUFFile(theirs).file_id
    services = serve_each({"theirs": theirs}, tmp_path)
    try:
        services.wait()
        with pytest.raises(Exception, match=r"serves 'demo-00001-of-00003.gguf:\d+\+\d+\+\d+', not this model"):
            remote_logits(ours, services.address("theirs"))
    finally:
        services.stop_all()


@pytest.mark.stack
@needs_fixtures
def test_whole_stack_on_a_split_model_equals_generate_on_the_file(tmp_path):
    """gateway -> attention -> two expert services, each process opening the 3-part set."""
    model = FIXTURES / "gptoss" / "gptoss-mxfp4_moe.gguf"
    first = split_into(model, tmp_path / "parts", 3)
    with running_stack(first, tmp_path) as stack:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model_id = client.models.list().data[0].id
        assert model_id == "gptoss-mxfp4_moe"  # the set's name: no "-00001-of-00003"
        reply = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "def norm(v):"}],
                                               max_tokens=12, temperature=0)
    reference = run_splitmoe("generate", str(model), "--prompt", "def norm(v):", "--chat", "-n", "12")
    assert reply.choices[0].message.content and reply.choices[0].message.content == reference[:-1]


# ---- the other commands that take a model --------------------------------------------------------


def test_generate_on_a_split_model_equals_generate_on_the_file(demo_gguf, tmp_path, capsys):
    first = split_into(demo_gguf, tmp_path / "parts", 3)
    texts = []
    for model in (demo_gguf, first):
        assert main(["generate", str(model), "--prompt", "Hello", "--chat", "-n", "8", "--device", "cpu"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] and texts[1] == texts[0]


@pytest.mark.stack
def test_bench_run_on_a_split_model(demo_gguf, tmp_path):
    first = split_into(demo_gguf, tmp_path / "parts", 2)
    out = tmp_path / "figures.json"
    run_splitmoe("bench", "run", "--model", str(first), "--threads", "2", "--json", str(out), "--no-inprocess",
                 "--run-dir", str(tmp_path / "run"), "--prompt-tokens", "8", "--decode-tokens", "3", "--streams", "1",
                 "--stream-prompt-tokens", "4", "--bandwidth-mb", "32", timeout_s=180)
    assert json.loads(out.read_text())["decode_tok_s"] > 0


@pytest.mark.stack
def test_up_on_a_split_model_serves_it_by_the_set_name(demo_gguf, tmp_path):
    first = split_into(demo_gguf, tmp_path / "parts", 3)
    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    up = subprocess.Popen([sys.executable, "-m", "splitmoe", "up", str(first), "--expert-services", "2",
                           "--port", str(port), "--threads", "2", "--startup-timeout-s", "60"],
                          cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", up, timeout_s=90)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["demo"]
        reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hello"}],
                                               max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens > 0
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed (the optional `bench` extra): our parts not checked "
                           "against llama.cpp's own loader")
@pytest.mark.parametrize("metadata_only_first", [False, True])
def test_llama_cpp_reads_our_parts_as_the_file(demo_gguf, tmp_path, metadata_only_first):
    """Our writer follows llama-gguf-split's format closely enough for llama.cpp's loader: the same logits."""
    from llama_cpp import Llama

    def llama_cpp_logits(model: Path) -> np.ndarray:
        llm = Llama(model_path=str(model), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
        try:
            llm.eval(TOKENS)
            return np.array(llm.scores[:len(TOKENS)])
        finally:
            llm.close()

    first = split_into(demo_gguf, tmp_path / "parts", 3, metadata_only_first=metadata_only_first)
    expected = llama_cpp_logits(demo_gguf)
    assert np.isfinite(expected).all() and np.array_equal(llama_cpp_logits(first), expected)
