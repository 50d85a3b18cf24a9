"""RemoteExperts against real `splitmoe serve-experts` processes on loopback ports.

The transport seam: in-process, gRPC and shared memory give the same logits (demo model, and
the llama.cpp qwen2moe fixture when present). Then placement: only routed rows are sent, token
counts, local layers, services started empty, startup errors, and a replica killed mid-request.
One service's deadlines and reconnects are in test_service_client.py.
"""
import dataclasses
import functools
import os
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from splitmoe.attention_service.expert_backends.backend import InProcessExperts
from splitmoe.attention_service.expert_backends.hop_budget import MIN_MEASURED_HOPS
from splitmoe.attention_service.expert_backends.remote import ExpertsUnavailable
from splitmoe.attention_service.expert_backends.services import read_hosts_file, resolve_addresses
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.attention_service.server import _add_expert_stats
from splitmoe.modelfile.expert_tensors import ExpertKey
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.proto import attention_pb2
from splitmoe.runtime.cluster_auth import ClusterSecurity
from tests.support.decode_steps import decode_steps
from tests.support.expert_services import ExpertServices, remote_experts
from tests.support.processes import free_port

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
PROMPT = [5, 17, 30, 42, 7, 99, 250, 3, 11, 64, 128, 200, 271, 0]
OPTIONS = RunnerOptions(device=torch.device("cpu"), kv_cache_tokens=64)
EXPERT_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def services(demo_gguf, tmp_path_factory, request):
    s = ExpertServices(tmp_path_factory.mktemp("logs"))
    s.start("low", demo_gguf, "--experts", "0-3")
    s.start("high", demo_gguf, "--experts", "4-7")
    s.start("spare1", demo_gguf, "--unassigned")
    s.start("spare2", demo_gguf, "--unassigned")
    try:  # the fixture file's services start in the same wave: startup is mostly importing torch
        s.fixture_path = request.getfixturevalue("fixtures_dir") / "qwen2moe" / "qwen2moe-q8_0.gguf"
        s.start("fixture-low", s.fixture_path, "--experts", "0-7")
        s.start("fixture-high", s.fixture_path, "--experts", "8-15")
    except pytest.skip.Exception:
        s.fixture_path = None
    try:
        s.wait()
        yield s
    finally:
        s.stop_all()


remote = functools.partial(remote_experts, expert_timeout_s=EXPERT_TIMEOUT_S)  # a test's own settings win


def logits(path, backend=None, prompt=PROMPT):
    runner = ModelRunner.from_gguf(path, OPTIONS, experts=backend)
    return runner.step([Sequence(0, list(prompt))], all_logits=True)


def routing(num_tokens, seed=0, hidden_size=64, num_experts=8, top_k=2):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    return torch.randn(num_tokens, hidden_size, generator=gen), ids, torch.rand(num_tokens, top_k, generator=gen)


def no_regions_left():
    return not [n for n in os.listdir("/dev/shm") if n.startswith(f"splitmoe-{os.getpid()}-")]


# ---- the transport seam ---------------------------------------------------------------------

@pytest.mark.stack
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_calls_sent_ahead_answer_as_calls_sent_now(services, demo_gguf, transport):
    """The send-ahead thread (the GPU's micro-batches) starts calls in order, several in flight."""
    g = GGUFFile(demo_gguf)
    calls = [(layer, *routing(n, seed)) for layer, n, seed in ((0, 3, 1), (0, 9, 2), (1, 1, 3), (1, 5, 4), (0, 2, 5))]
    with remote(g, services.address("low"), services.address("high"), transport=transport) as backend:
        now = [backend.forward(*call) for call in calls]
        ahead = [backend.submit_ahead(*call) for call in calls]
        got = [handle.wait() for handle in ahead]
    for a, b in zip(got, now):
        assert torch.equal(a, b)


@pytest.mark.stack
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_static_decode_through_expert_services(services, demo_gguf, transport):
    """The GPU's decode path (fixed-shape segments, a hop after each: model/static_decode.py), here
    on the CPU, over real services: the logits of the generic path."""
    g = GGUFFile(demo_gguf)

    def decode(static):
        with remote(g, services.address("low"), services.address("high"), transport=transport) as backend:
            options = dataclasses.replace(OPTIONS, static_decode=static)
            runner = ModelRunner.from_gguf(demo_gguf, options, experts=backend)
            return decode_steps(runner, [PROMPT[:5], PROMPT[5:], PROMPT[2:4]], 3)

    assert (decode(True) - decode(False)).abs().max() <= 1e-5

@pytest.mark.stack
@pytest.mark.parametrize("transport", ["grpc", "shm", "auto"])
def test_same_logits_in_process_and_remote(services, demo_gguf, transport):
    g = GGUFFile(demo_gguf)
    expected = logits(demo_gguf, InProcessExperts(g))
    with remote(g, services.address("low"), services.address("high"), transport=transport) as backend:
        got = logits(demo_gguf, backend)
        health = backend.health()
        stats = backend.stats()
        published = attention_pb2.AttentionStats()
        _add_expert_stats(published, SimpleNamespace(experts=backend))  # what GetStats answers
    assert (got - expected).abs().max() <= 1e-5
    assert {(h.transport, h.num_hops) for h in published.hops} == {("grpc" if transport == "grpc" else "shm", 2)}
    assert all(h.overhead_us_median > 0 and h.overhead_us_mean > 0 for h in published.hops)
    assert {h.transport for h in health.values()} == {"grpc" if transport == "grpc" else "shm"}
    for s in stats.values():  # one hop per MoE layer per step per service, plus nothing else
        assert s.num_hops == 2 and s.sent_bytes > 0 and s.received_bytes > 0
        assert s.hop_s_total >= s.compute_s_total > 0
        assert s.hop_s_total * 1e6 >= s.overhead_us_mean * s.num_hops > 0 and s.overhead_us_median > 0
        assert s.transport == ("grpc" if transport == "grpc" else "shm")
    assert no_regions_left()


@pytest.mark.stack
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_same_logits_on_the_llama_cpp_fixture(services, transport):
    if services.fixture_path is None:
        pytest.skip("../shared/fixtures not found: the llama.cpp-made fixtures live beside the clone in CI")
    path = services.fixture_path
    g = GGUFFile(path)
    with remote(g, services.address("fixture-low"), services.address("fixture-high"), transport=transport) as backend:
        got = logits(path, backend)
    assert (got - logits(path, InProcessExperts(g))).abs().max() <= 1e-5


@pytest.mark.stack
def test_bfloat16_hidden_states_are_summed_in_float32(services, demo_gguf):
    g = GGUFFile(demo_gguf)
    hidden, ids, weights = routing(7, seed=5)
    expected = InProcessExperts(g).forward(1, hidden, ids, weights)
    with remote(g, services.address("low"), services.address("high")) as backend:
        got = backend.forward(1, hidden.bfloat16(), ids, weights)
    assert got.dtype == torch.float32
    # bfloat16 requests take the fast kernels (int8 activations, ~1.3% per layer): the fidelity
    # budget is rel-L2 3e-2 against the float32 path; the parts themselves add up to what one
    # process computing every expert on the same fast path gets, up to each part's bf16 rounding.
    assert (got - expected).norm() / expected.norm() < 3e-2
    one_process = InProcessExperts(g).forward(1, hidden.bfloat16(), ids, weights).float()
    torch.testing.assert_close(got, one_process, rtol=1e-2, atol=1e-2)


@pytest.mark.stack
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_two_layer_calls_in_flight_give_what_forward_gives(services, demo_gguf, transport):
    g = GGUFFile(demo_gguf)
    calls = [(layer, *routing(n, seed=seed)) for layer, n, seed in ((0, 5, 1), (1, 3, 2), (1, 7, 3))]
    calls[1][2][0] = torch.tensor([0, 1])  # the low service alone for one token: rows are gathered
    with remote(g, services.address("low"), services.address("high"), transport=transport) as backend:
        expected = [backend.forward(*call) for call in calls]
        first, second = backend.submit(*calls[0]), backend.submit(*calls[1])
        assert torch.equal(second.wait(), expected[1]) and torch.equal(first.wait(), expected[0])  # out of order
        handles = [backend.submit(*call) for call in calls]  # a third call collects the oldest first
        assert all(torch.equal(h.wait(), e) for h, e in zip(handles, expected))
        assert {s.num_hops for s in backend.stats().values()} == {8}  # every call needs both services


@pytest.mark.stack
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_micro_batched_steps_against_real_services(services, demo_gguf, transport):
    g = GGUFFile(demo_gguf)
    prompts = [PROMPT[:5], PROMPT[5:8], PROMPT[8:], PROMPT[2:4]]
    reference = ModelRunner.from_gguf(demo_gguf, OPTIONS, experts=InProcessExperts(g))
    expected = reference.step([Sequence(i, list(p)) for i, p in enumerate(prompts)], all_logits=True)
    with remote(g, services.address("low"), services.address("high"), transport=transport) as backend:
        runner = ModelRunner.from_gguf(demo_gguf, dataclasses.replace(OPTIONS, micro_batches=2), experts=backend)
        got = runner.step([Sequence(i, list(p)) for i, p in enumerate(prompts)], all_logits=True)
        hops = {s.num_hops for s in backend.stats().values()}
    assert (got - expected).abs().max() <= 1e-5
    assert hops == {4}  # 2 MoE layers x 2 micro-batches


@pytest.mark.stack
def test_only_routed_rows_are_sent(services, demo_gguf):
    g = GGUFFile(demo_gguf)
    hidden, _, weights = routing(6)
    ids = torch.tensor([[0, 1]] * 5 + [[4, 2]])  # only the last token needs the high half
    with remote(g, services.address("low"), services.address("high"), transport="grpc") as backend:
        backend.forward(0, hidden, ids, weights)
        stats = backend.stats()
    high = stats[services.address("high")]
    assert high.received_bytes == 1 * 64 * 4 and stats[services.address("low")].received_bytes == 6 * 64 * 4


# ---- placement ------------------------------------------------------------------------------

@pytest.mark.stack
def test_tokens_per_expert_match_the_routing_sent(services, demo_gguf):
    g = GGUFFile(demo_gguf)
    hidden, ids, weights = routing(40, seed=1)
    with remote(g, services.address("low"), services.address("high")) as backend:
        before = backend.expert_token_counts()
        backend.forward(1, hidden, ids, weights)
        after = backend.expert_token_counts()
    sent = torch.bincount(ids.reshape(-1), minlength=8).tolist()
    assert {k: after[k] - before.get(k, 0) for k in after if k.layer == 1} == {ExpertKey(1, e): sent[e] for e in range(8)}
    assert all(after[k] == before.get(k, 0) for k in after if k.layer == 0)


@pytest.mark.stack
def test_local_layers_are_never_sent(services, demo_gguf):
    g = GGUFFile(demo_gguf)
    with remote(g, services.address("low"), services.address("high"), local_layers=1) as backend:
        before = backend.expert_token_counts()
        got = logits(demo_gguf, backend)
        after = backend.expert_token_counts()
        hops = {s.num_hops for s in backend.stats().values()}
    assert (got - logits(demo_gguf, InProcessExperts(g))).abs().max() <= 1e-5
    assert hops == {1}  # layer 1 only
    assert all(after[k] == before[k] for k in after if k.layer == 0)


@pytest.mark.stack
def test_unassigned_services_get_the_experts_split_evenly(services, demo_gguf):
    g = GGUFFile(demo_gguf)
    with remote(g, services.address("spare1"), services.address("spare2")) as backend:
        shards = [h.shard for h in backend.health().values()]
        got = logits(demo_gguf, backend)
    assert [(s.layers, s.experts) for s in shards] == [((0, 1), (0, 1, 2, 3)), ((0, 1), (4, 5, 6, 7))]
    assert (got - logits(demo_gguf, InProcessExperts(g))).abs().max() <= 1e-5


@pytest.mark.stack
def test_startup_fails_with_one_line_when_experts_have_no_service(services, demo_gguf):
    with pytest.raises(ExpertsUnavailable) as e:
        with remote(GGUFFile(demo_gguf), services.address("low")):
            pass
    message = str(e.value)
    assert "\n" not in message and "L0.E4" in message and services.address("low") in message


def test_startup_fails_with_one_line_when_a_service_never_answers(demo_gguf):
    silent = f"127.0.0.1:{free_port()}"
    start_s = time.monotonic()
    with pytest.raises(ExpertsUnavailable, match=silent):
        with remote(GGUFFile(demo_gguf), silent, startup_wait_s=0.5):
            pass
    assert time.monotonic() - start_s < 5


@pytest.mark.stack
def test_startup_without_the_cluster_secret_fails_with_one_line_saying_so(services, demo_gguf):
    low = services.address("low")
    with pytest.raises(ExpertsUnavailable) as e:
        with remote(GGUFFile(demo_gguf), low, security=ClusterSecurity(token="not-the-cluster-secret-0123")):
            pass
    message = str(e.value)
    assert "\n" not in message and f"{low} refused us: UNAUTHENTICATED" in message and "cluster secret" in message


def test_a_name_stands_for_every_address_it_resolves_to(monkeypatch, tmp_path):
    real = socket.getaddrinfo

    def compose_dns(host, port, family=0, kind=0, *args):
        if host != "expert":
            return real(host, port, family, kind, *args)
        if family != socket.AF_INET:
            raise socket.gaierror("no IPv6 here")
        return [(family, kind, 6, "", (f"172.18.0.{i}", int(port))) for i in (3, 4, 3)]

    monkeypatch.setattr(socket, "getaddrinfo", compose_dns)
    assert resolve_addresses(["expert:50061", "127.0.0.1:7", "localhost:8", "nowhere.invalid:9"]) == [
        ("172.18.0.3:50061", "expert"), ("172.18.0.4:50061", "expert"), ("127.0.0.1:7", "127.0.0.1"),
        ("127.0.0.1:8", "localhost"), ("nowhere.invalid:9", "nowhere.invalid")]
    # a hosts file overrides DNS, name by name, blank lines and comments ignored
    hosts = tmp_path / "hosts"
    hosts.write_text("# experts\n\n10.0.0.5 expert other\n10.0.0.6 expert  # the second\n")
    assert resolve_addresses(["expert:1", "other:2", "localhost:3"], read_hosts_file(str(hosts))) == [
        ("10.0.0.5:1", "expert"), ("10.0.0.6:1", "expert"), ("10.0.0.5:2", "other"), ("127.0.0.1:3", "localhost")]
    assert read_hosts_file(str(tmp_path / "absent")) == {} and read_hosts_file("") == {}


# ---- replicas -------------------------------------------------------------------------------

@pytest.mark.stack
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_a_hung_replica_costs_a_layer_call_its_learned_budget_not_the_deadline(services, demo_gguf, transport):
    g = GGUFFile(demo_gguf)
    addresses = [services.address(n) for n in ("low", "high", "spare1", "spare2")]
    low, high = addresses[:2]
    with remote(g, *addresses, transport=transport, expert_timeout_s=30.0) as backend:
        hidden, ids, weights = routing(4)
        expected = [backend.forward(layer, hidden, ids, weights) for layer in (0, 1)]
        for _ in range(MIN_MEASURED_HOPS):  # every service's budget learned (layer 1 goes to the spares)
            for layer in (0, 1):
                backend.forward(layer, hidden, ids, weights)
        before = backend.stats()[high]
        services.pause("low")  # layer 0's first replica: silent, its connections open
        try:
            start_s = time.monotonic()
            out = backend.forward(0, hidden, ids, weights)
            took_s = time.monotonic() - start_s
            assert torch.equal(out, expected[0]) and took_s < 1.0  # the spare answered; not the 30 s deadline
            # high answered at once: the time low kept the layer call waiting is not charged to it
            after = backend.stats()[high]
            assert after.num_hops == before.num_hops + 1 and after.hop_s_total - before.hop_s_total < 0.1
            low_hops = backend.stats()[low].num_hops  # low is left out now: nothing sent to it, nothing waited
            assert torch.equal(backend.forward(0, hidden, ids, weights), expected[0])
            assert backend.stats()[low].num_hops == low_hops and backend.health()[low].transport
        finally:
            services.resume("low")
        deadline_s = time.monotonic() + 10  # its late answer is read, or keepalive ended its stream: back
        while not (backend.health()[low].healthy and backend.stats()[low].num_hops > before.num_hops):
            assert time.monotonic() < deadline_s, backend.health()[low]
            backend.forward(0, hidden, ids, weights)
            time.sleep(0.05)
        assert torch.equal(backend.forward(0, hidden, ids, weights), expected[0])


@pytest.mark.stack
def test_replica_killed_mid_request_is_retried_on_another(services, demo_gguf):
    g = GGUFFile(demo_gguf)
    expected = logits(demo_gguf, InProcessExperts(g))
    addresses = [services.address(n) for n in ("low", "high", "spare1", "spare2")]
    with remote(g, *addresses) as backend:  # the spares host 0-3 and 4-7 too: replicas
        assert (logits(demo_gguf, backend) - expected).abs().max() <= 1e-5
        hops = {a: s.num_hops for a, s in backend.stats().items()}
        assert hops == dict.fromkeys(addresses, 1)  # replicas take turns by layer: layer 1 went to the spares
        services.pause("spare2")  # it takes the next layer-1 request and never answers...
        result = {}
        step = threading.Thread(target=lambda: result.update(logits=logits(demo_gguf, backend)))
        start_s = time.monotonic()
        step.start()
        time.sleep(0.5)
        services.kill("spare2")  # ...then dies with the request in flight
        step.join(30)
        assert time.monotonic() - start_s < EXPERT_TIMEOUT_S  # failed over, not timed out
        assert (result["logits"] - expected).abs().max() <= 1e-5
        assert not backend.health()[services.address("spare2")].healthy
        assert (logits(demo_gguf, backend) - expected).abs().max() <= 1e-5

