"""LoRA adapters on routed experts applied by the expert services (expert_service/adapters.py).

Two real `splitmoe serve-experts` processes host the LoRA fixture's experts 0-7 and 8-15
(tests/data/lora/: llama.cpp's conversion of a checkpoint and of a routed-experts adapter, and
peft's float32 logits); each hop names its rows' adapter, which the services load from the same
path and check by identity. Over gRPC and over shared memory the logits match peft's, a step mixes
base and adapted rows, and a file that is not the one the attention side read fails the request
with one clear line instead of computing wrong answers or hanging.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from splitmoe.attention_service.expert_backends.layer_call import lora_of_part
from splitmoe.attention_service.expert_backends.service_client import ExpertRequestError
from splitmoe.attention_service.lora_adapters import LoraAdapters, LoraSettings
from splitmoe.attention_service.model.lora import AdapterWeights
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.lora_adapter import AdapterRef, adapter_identity, load_lora_adapter
from splitmoe.proto import doorbell
from tests.attention_service.model.test_lora import bfloat16_rows, logits
from tests.support.expert_services import ExpertServices, remote_experts

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
DATA = Path(__file__).resolve().parents[1] / "data" / "lora"
BASE = DATA / "base-qwen3moe.gguf"
F32_TOL = 1e-4  # as tests/attention_service/model/test_lora.py: peft's float32 logits
OPTIONS = RunnerOptions(dtype=torch.float32, device=torch.device("cpu"), kv_cache_tokens=512)


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    s = ExpertServices(tmp_path_factory.mktemp("logs"))
    s.start("low", BASE, "--experts", "0-7")
    s.start("high", BASE, "--experts", "8-15")
    try:
        s.wait()
        yield s
    finally:
        s.stop_all()


@pytest.fixture(scope="module")
def refs():
    return np.load(DATA / "references.npz")


@pytest.fixture(scope="module")
def base():
    return GGUFFile(BASE)


def adapter(base, path: Path, name: str = "experts") -> AdapterWeights:
    return AdapterWeights.of(load_lora_adapter(path, base, name))


def both(services, base, transport: str):
    return remote_experts(base, services.address("low"), services.address("high"), transport=transport,
                          expert_timeout_s=10.0)


@pytest.mark.stack
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_float32_logits_match_peft_through_two_services(services, base, refs, transport):
    lora = adapter(base, DATA / "experts-lora.gguf")
    with both(services, base, transport) as backend:
        runner = ModelRunner.from_gguf(base, OPTIONS, experts=backend)
        for i, p in enumerate(("p0", "p1")):
            [got] = logits(runner, [Sequence(i, refs[f"prompts/{p}"].tolist(), lora=lora)])
            assert (got - torch.from_numpy(refs[f"experts/{p}/logits"])).abs().max() <= F32_TOL, p
        assert {h.transport for h in backend.health().values()} == {transport}
    # the adapter moves the logits well past that bound: the comparison can tell
    assert (torch.from_numpy(refs["experts/p0/logits"]) - torch.from_numpy(refs["base/p0/logits"])).abs().max() > 0.1


@pytest.mark.stack
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_one_step_mixes_base_and_adapted_rows(services, base, refs, transport):
    lora = adapter(base, DATA / "experts-lora.gguf")
    plan = [("base", "p1"), ("experts", "p0"), ("base", "p0")]
    with both(services, base, transport) as backend:
        runner = ModelRunner.from_gguf(base, OPTIONS, experts=backend)
        seqs = [Sequence(i, refs[f"prompts/{p}"].tolist(), lora=lora if n == "experts" else None)
                for i, (n, p) in enumerate(plan)]
        got = logits(runner, seqs)
    for out, (n, p) in zip(got, plan):
        assert (out - torch.from_numpy(refs[f"{n}/{p}/logits"])).abs().max() <= F32_TOL, (n, p)


@pytest.mark.stack
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_another_file_at_the_path_fails_the_request_and_the_services_stay_usable(services, base, refs, tmp_path,
                                                                                 transport):
    """The attention side read one adapter; the services find another file under its path (a stale
    copy): the request fails at once, naming the adapter and both identities; a missing file, naming
    the path. The next base request is answered as before."""
    path = tmp_path / "adapter.gguf"
    shutil.copy(DATA / "experts-lora.gguf", path)
    lora = adapter(base, path)
    shutil.copy(DATA / "attn-lora.gguf", path)  # an adapter of the same base, under the same name
    theirs = adapter_identity(path)
    prompt = refs["prompts/p0"].tolist()
    with both(services, base, transport) as backend:
        runner = ModelRunner.from_gguf(base, OPTIONS, experts=backend)
        with pytest.raises(ExpertRequestError) as failed:
            runner.step([Sequence(0, prompt, lora=lora)], all_logits=True)
        message = str(failed.value)
        assert "'experts'" in message and next(iter(lora.experts.values())).adapter.identity in message and theirs in message
        assert len(message.splitlines()) == 1
        path.unlink()
        with pytest.raises(ExpertRequestError, match=f"cannot load {re.escape(str(path))}"):
            ModelRunner.from_gguf(base, OPTIONS, experts=backend).step([Sequence(1, prompt, lora=lora)])
        [got] = logits(ModelRunner.from_gguf(base, OPTIONS, experts=backend), [Sequence(2, prompt)])
        assert all(h.healthy for h in backend.health().values())
    assert (got - torch.from_numpy(refs["base/p0/logits"])).abs().max() <= F32_TOL


def changed_first(prepare, path: Path, change):
    """`prepare`, after `change(path)`: the file the services find is not the one the attention side read."""
    def call(ref):
        change(path)
        return prepare(ref)
    return call


@pytest.mark.stack
def test_loading_an_adapter_has_every_service_read_and_check_it_first(services, base, refs, tmp_path):
    """PrepareLora at load time: an adapter the services can apply loads (and then computes as
    peft's); a stale copy at the path, or no file there, fails the load in one line naming the
    service and the cause, not the first request using it, and leaves nothing loaded."""
    with both(services, base, "grpc") as backend:
        adapters = LoraAdapters(base, "base", LoraSettings(), prepare_experts=backend.prepare_lora)
        lora = adapters.load("experts", str(DATA / "experts-lora.gguf"))
        [got] = logits(ModelRunner.from_gguf(base, OPTIONS, experts=backend),
                       [Sequence(0, refs["prompts/p0"].tolist(), lora=lora)])
        assert (got - torch.from_numpy(refs["experts/p0/logits"])).abs().max() <= F32_TOL
        for name, change, why in (
                ("stale", lambda p: shutil.copy(DATA / "attn-lora.gguf", p), "the two must read the same file"),
                ("missing", Path.unlink, "cannot load")):
            path = tmp_path / f"{name}.gguf"
            shutil.copy(DATA / "experts-lora.gguf", path)
            changing = LoraAdapters(base, "base", LoraSettings(),
                                    prepare_experts=changed_first(backend.prepare_lora, path, change))
            with pytest.raises(ValueError) as failed:
                changing.load(name, str(path))
            message = str(failed.value)
            assert len(message.splitlines()) == 1, message
            assert message.startswith("expert service 127.0.0.1:") and why in message and str(path) in message
            assert not changing.listed()
        assert all(h.healthy for h in backend.health().values())


def test_a_part_gets_its_own_rows_of_each_adapter_renumbered():
    a, b = AdapterRef("a", "/a", "ia"), AdapterRef("b", "/b", "ib")
    lora = [(a, torch.tensor([0, 3, 5])), (b, torch.tensor([4]))]
    assert lora_of_part(lora, None, 6) is lora
    part = lora_of_part(lora, torch.tensor([1, 3, 5]), 6)
    assert [(ref, rows.tolist()) for ref, rows in part] == [(a, [1, 2])]
    assert lora_of_part(lora, torch.tensor([1, 2]), 6) is None


def test_a_doorbell_request_names_its_adapters_and_each_row_its_adapter(tmp_path):
    adapters = [("a", "/path/a.gguf", "a.gguf:1:2:abc"), ("b", "/b", "b:3")]
    assert doorbell.parse_adapters(doorbell.adapters_message(adapters)) == adapters
    from splitmoe.proto.shm import ShmRegion

    region = ShmRegion.create(doorbell.lora_slot_bytes(5, 2, 16, torch.bfloat16))
    try:
        index = doorbell.lora_rows_view(region, 5, 2, 16, torch.bfloat16)
        views = doorbell.Slot(region).views(5, 2, 16, torch.bfloat16)
        views.output.fill_(1.0)  # the output area ends where the rows' adapters begin
        index.fill_(-1)
        assert (views.output == 1.0).all() and (index == -1).all()
    finally:
        region.close()


@pytest.mark.stack
def test_bfloat16_decode_hops_with_an_adapter_are_not_left_to_the_native_loop(services, base, refs):
    """Decode-sized bfloat16 hops over shared memory are the C++ loop's, which knows no adapters: a
    hop with adapted rows goes to Python, and the logits are the in-process experts' with the adapter."""
    lora = adapter(base, DATA / "experts-lora.gguf")
    options = RunnerOptions(dtype=torch.bfloat16, device=torch.device("cpu"), kv_cache_tokens=512)
    ids = refs["prompts/p0"].tolist()
    with both(services, base, "shm") as backend:
        got = bfloat16_rows(ModelRunner.from_gguf(base, options, experts=backend), ids, lora)
    here = ModelRunner.from_gguf(base, options)  # in-process experts
    want, without = bfloat16_rows(here, ids, lora), bfloat16_rows(here, ids, None)
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()
    assert (without - want).abs().max() > 10 * (got - want).abs().max()
