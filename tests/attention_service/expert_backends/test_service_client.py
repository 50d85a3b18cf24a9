"""One expert service connection under failure, against real `splitmoe serve-experts` processes.

A bad request is answered in-band (the stream lives on); a hung service hits the deadline; a
killed one fails the layer call at once with a clear error while the other service keeps
serving, and is picked up again after a restart (empty: its shard is loaded again).
"""
import time
from contextlib import contextmanager

import pytest
import torch

from splitmoe.attention_service.expert_backends.remote import (
    ExpertRequestError,
    ExpertsUnavailable,
    RemoteExperts,
    RemoteExpertsSettings,
)
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.proto import expert_pb2, expert_pb2_grpc
from tests.support.expert_services import ExpertServices
from tests.support.processes import CLUSTER, cluster_channel

pytestmark = [
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
    pytest.mark.stack,  # real `splitmoe serve-experts` processes
]
TIMEOUT_S = 1.0
FAST = dict(expert_timeout_s=TIMEOUT_S, connect_timeout_s=0.5, reconnect_interval_s=0.2, security=CLUSTER)


@pytest.fixture(scope="module")
def services(demo_gguf, tmp_path_factory):
    s = ExpertServices(tmp_path_factory.mktemp("logs"))
    s.start("low", demo_gguf, "--experts", "0-3")
    s.start("high", demo_gguf, "--unassigned")  # the placement gives it experts 4-7
    try:
        s.wait()
        yield s
    finally:
        s.stop_all()


@pytest.fixture(params=["grpc", "shm"])
def backend(services, demo_gguf, request):
    settings = RemoteExpertsSettings(addresses=(services.address("low"), services.address("high")), transport=request.param,
                                     **FAST)
    with RemoteExperts(GGUFFile(demo_gguf), settings) as b:
        yield b


@contextmanager
def paused(services, name):
    services.pause(name)
    try:
        yield
    finally:
        services.resume(name)


def routing(experts: list[int], num_tokens=6, seed=0):
    """Every token routed to `experts` (top-k = len(experts))."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([experts] * num_tokens)
    return torch.randn(num_tokens, 64, generator=gen), ids, torch.rand(num_tokens, len(experts), generator=gen)


def wait_healthy(backend, address, timeout_s=10.0):
    deadline_s = time.monotonic() + timeout_s
    while not backend.health()[address].healthy and time.monotonic() < deadline_s:
        time.sleep(0.05)
    return backend.health()[address].healthy


def test_bad_request_is_answered_in_band_and_the_stream_keeps_working(backend):
    hidden, ids, weights = routing([1, 6])
    good = backend.forward(0, hidden, ids, weights)
    with pytest.raises(ExpertRequestError, match="hidden"):
        backend.forward(0, torch.randn(6, 65), ids, weights)
    assert all(h.healthy for h in backend.health().values())
    assert torch.equal(backend.forward(0, hidden, ids, weights), good)
    assert {s.num_hops for s in backend.stats().values()} == {2}  # the same streams: nothing reconnected
    bad, fine = backend.submit(0, torch.randn(6, 65), ids, weights), backend.submit(0, hidden, ids, weights)
    with pytest.raises(ExpertRequestError, match="hidden"):  # two in flight: only the bad one fails
        bad.wait()
    assert torch.equal(fine.wait(), good)


def test_hung_service_hits_the_deadline_then_recovers(services, backend):
    low = services.address("low")
    hidden, ids, weights = routing([0, 5])
    expected = backend.forward(1, hidden, ids, weights)
    with paused(services, "low"):
        start_s = time.monotonic()
        with pytest.raises(ExpertsUnavailable, match=low):
            backend.forward(1, hidden, ids, weights)
        assert TIMEOUT_S <= time.monotonic() - start_s < TIMEOUT_S + 0.5
        assert "expert_timeout_s" in backend.health()[low].last_error
    assert wait_healthy(backend, low)
    assert torch.equal(backend.forward(1, hidden, ids, weights), expected)


def test_killed_service_fails_fast_others_keep_serving_and_a_restart_is_picked_up(services, backend):
    high = services.address("high")
    hidden, ids, weights = routing([2, 7])
    expected = backend.forward(1, hidden, ids, weights)
    assert backend.health()[high].shard.experts == (4, 5, 6, 7)
    services.kill("high")
    deadline_s = time.monotonic() + 2
    while backend.health()[high].healthy and time.monotonic() < deadline_s:
        time.sleep(0.01)
    assert not backend.health()[high].healthy  # noticed while idle: no hop needed
    start_s = time.monotonic()
    with pytest.raises(ExpertsUnavailable) as e:
        backend.forward(1, hidden, ids, weights)
    assert time.monotonic() - start_s < TIMEOUT_S
    assert high in str(e.value) and "layer 1" in str(e.value) and "L1.E7" in str(e.value)
    assert not backend.health()[high].healthy
    backend.forward(1, *routing([0, 3]))  # experts on the live service still answer
    services.restart("high")  # comes back empty: the client loads experts 4-7 into it again
    deadline_s = time.monotonic() + 10  # the reconnect interval, plus a loaded machine's restart
    while not backend.health()[high].healthy and time.monotonic() < deadline_s:
        time.sleep(FAST["reconnect_interval_s"] / 4)
    assert torch.equal(backend.forward(1, hidden, ids, weights), expected)
    assert backend.health()[high].healthy and backend.health()[high].shard.experts == (4, 5, 6, 7)


def test_a_service_that_stops_hosting_its_part_of_the_placement_is_unhealthy_until_it_does_again(services, backend):
    high = services.address("high")
    hidden, ids, weights = routing([2, 7])
    expected = backend.forward(1, hidden, ids, weights)
    with cluster_channel(high) as channel:  # an operator holding the secret, loading another shard
        stub = expert_pb2_grpc.ExpertServiceStub(channel)
        stub.LoadShard(expert_pb2.LoadShardRequest(layers=[0, 1], experts=[4]), timeout=10)
        deadline_s = time.monotonic() + 5
        while backend.health()[high].healthy and time.monotonic() < deadline_s:
            time.sleep(0.02)
        health = backend.health()[high]
        assert not health.healthy and "the placement needs" in health.last_error
        with pytest.raises(ExpertsUnavailable, match="L1.E7"):  # not zeros for experts 5-7
            backend.forward(1, hidden, ids, weights)
        time.sleep(3 * FAST["reconnect_interval_s"])
        assert not backend.health()[high].healthy  # a shard other than ours is not overwritten
        stub.LoadShard(expert_pb2.LoadShardRequest(), timeout=10)  # emptied: ours is loaded again
        assert wait_healthy(backend, high)
        info = stub.DescribeShard(expert_pb2.DescribeShardRequest(), timeout=10)
    assert (list(info.layers), list(info.experts)) == ([0, 1], [4, 5, 6, 7])
    assert torch.equal(backend.forward(1, hidden, ids, weights), expected)
