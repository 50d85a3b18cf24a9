"""Decode layers fused with their hop (expert_backends/direct_hop.py) against real `splitmoe
serve-experts` processes: the logits, hop counts and heat of the layer call's path; the usual path
wherever the hop cannot be direct; a service killed between two decode steps failed over to its
replica within the step."""
import errno
import functools

import pytest
import torch

import splitmoe.attention_service.model.transformer as transformer_module
from splitmoe.attention_service.expert_backends.backend import InProcessExperts
from splitmoe.attention_service.expert_backends.direct_hop import DirectHop
from splitmoe.attention_service.expert_backends.remote import RemoteExperts
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.kernels import native
from splitmoe.modelfile.gguf_file import GGUFFile
from tests.support.decode_steps import decode_steps
from tests.support.expert_services import ExpertServices, remote_experts

pytestmark = [pytest.mark.stack, pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
              pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels: {native.UNAVAILABLE_REASON}")]
OPTIONS = RunnerOptions(dtype=torch.bfloat16, device=torch.device("cpu"), kv_cache_tokens=256)
PROMPTS = [[5, 17, 30, 42, 7, 99], [250, 3, 11, 64, 128, 200, 271], [0, 9, 8]]
remote = functools.partial(remote_experts, expert_timeout_s=3.0)


@pytest.fixture(scope="module")
def services(demo_gguf, tmp_path_factory):
    s = ExpertServices(tmp_path_factory.mktemp("logs"))
    for name in ("all", "replica"):
        s.start(name, demo_gguf)
    try:
        s.wait()
        yield s
    finally:
        s.stop_all()


@pytest.fixture
def direct_hops(monkeypatch) -> list[bool]:
    """Each direct_hop asked: whether it was direct."""
    asked = []
    real = RemoteExperts.direct_hop

    def counted(self, *args):
        hop = real(self, *args)
        asked.append(hop is not None)
        return hop

    monkeypatch.setattr(RemoteExperts, "direct_hop", counted)
    return asked


def no_fusion(monkeypatch) -> None:
    monkeypatch.setattr(transformer_module, "fused_layers", lambda cfg, spec, layers, *rest: [None] * len(layers))


def decode(path, backend, prompts=PROMPTS, steps=4) -> torch.Tensor:
    return decode_steps(ModelRunner.from_gguf(path, OPTIONS, experts=backend), prompts, steps)


def test_as_the_layer_calls_path(services, demo_gguf, direct_hops, monkeypatch):
    g = GGUFFile(demo_gguf)
    one, three = PROMPTS[:1], PROMPTS
    with remote(g, services.address("all"), transport="shm") as backend:
        got = [decode(demo_gguf, backend, p) for p in (one, three)]
        hops, heat = backend.stats()[services.address("all")].num_hops, backend.heat.snapshot().tokens
    assert any(direct_hops) and all(direct_hops)  # every decode layer of every step
    with monkeypatch.context() as m:
        no_fusion(m)
        with remote(g, services.address("all"), transport="shm") as backend:
            want = [decode(demo_gguf, backend, p) for p in (one, three)]
            assert backend.stats()[services.address("all")].num_hops == hops
            assert torch.equal(backend.heat.snapshot().tokens, heat)
        in_process = [decode(demo_gguf, InProcessExperts(g), p) for p in (one, three)]
    for a, b, c in zip(got, want, in_process):
        assert (a - b).abs().max() <= 1e-5 and (a - c).abs().max() <= 1e-5


def test_grpc_takes_the_usual_path(services, demo_gguf, direct_hops):
    g = GGUFFile(demo_gguf)
    with remote(g, services.address("all"), transport="grpc") as backend:
        got = decode(demo_gguf, backend)
    assert direct_hops and not any(direct_hops)
    assert (got - decode(demo_gguf, InProcessExperts(g))).abs().max() <= 1e-5


def test_local_layers_take_the_usual_path(services, demo_gguf, direct_hops):
    g = GGUFFile(demo_gguf)
    with remote(g, services.address("all"), transport="shm", local_layers=1) as backend:
        got = decode(demo_gguf, backend, PROMPTS[:1])
        assert sum(s.num_hops for s in backend.stats().values()) > 0
    assert direct_hops and not all(direct_hops)  # the first MoE layer's hop is never direct
    assert (got - decode(demo_gguf, InProcessExperts(g), PROMPTS[:1])).abs().max() <= 1e-5


def test_a_hung_service_fails_over_within_the_step(services, demo_gguf, direct_hops, monkeypatch):
    """A direct hop unanswered past expert_timeout_s: the service is marked unhealthy and the layer's
    experts go to the replica, in the same step."""
    failed = []
    real_finish = DirectHop.finish
    monkeypatch.setattr(DirectHop, "finish", lambda self, rc, result, ids: (
        rc == 1 and failed.append(result.failed_errno)) or real_finish(self, rc, result, ids))
    g = GGUFFile(demo_gguf)
    want = decode(demo_gguf, InProcessExperts(g), PROMPTS[:1], steps=3)
    got = []
    with remote(g, services.address("all"), services.address("replica"), transport="shm") as backend:
        runner = ModelRunner.from_gguf(demo_gguf, OPTIONS, experts=backend)
        seq = Sequence(0, list(PROMPTS[0]))
        runner.step([seq])
        for t in range(3):
            seq.token_ids.append((seq.token_ids[-1] * 7 + t) % 200 + 3)  # decode_steps' rule
            if t == 1:  # replicas take turns by layer: the replica has a layer of the next step
                assert all(direct_hops) and backend.health()[services.address("replica")].healthy
                services.pause("replica")
            try:
                got.append(runner.step([seq]))
            finally:
                if t == 1:
                    services.resume("replica")
        assert failed == [errno.EAGAIN]  # the receive's timeout, in the native call
        health = backend.health()[services.address("replica")]
        assert not health.healthy and "expert_timeout_s" in health.last_error
        assert backend.health()[services.address("all")].healthy
    assert (torch.stack(got) - want).abs().max() <= 1e-5
