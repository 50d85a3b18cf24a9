"""The expert service over real gRPC: `splitmoe serve-experts` processes on loopback ports.

One service hosts experts 0-3 of the demo model; one starts `--unassigned`. Streams are driven
by hand here (the attention-side client has its own tests), so every field is checked as sent.
"""
import queue
import signal
import time
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitmoe.modelfile.expert_tensors import ExpertKey, ExpertShard
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.proto import codec, doorbell, expert_pb2, expert_pb2_grpc
from splitmoe.proto.shm import ShmRegion
from tests.support.processes import (
    CLUSTER,
    assert_refused_but_probes_pass,
    cluster_channel,
    free_port,
    grpc_service,
    spawn,
    stranger_channel,
    wait_grpc_serving,
)

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
HIDDEN = 64


@pytest.fixture(scope="module")
def service_address(demo_gguf, tmp_path_factory):
    port = free_port()
    args = ["serve-experts", str(demo_gguf), "--port", str(port), "--experts", "0-3", "--threads", "1"]
    with grpc_service(args, port, tmp_path_factory.mktemp("logs") / "experts.log"):
        yield f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def service(service_address):
    with cluster_channel(service_address) as channel:
        yield expert_pb2_grpc.ExpertServiceStub(channel)


@pytest.fixture(scope="module")
def unassigned(demo_gguf, tmp_path_factory):
    port = free_port()
    args = ["serve-experts", str(demo_gguf), "--port", str(port), "--unassigned"]
    with grpc_service(args, port, tmp_path_factory.mktemp("logs") / "unassigned.log"):
        with cluster_channel(f"127.0.0.1:{port}") as channel:
            yield expert_pb2_grpc.ExpertServiceStub(channel)


class Stream:
    """One open Forward stream: send a request, read its answer."""

    def __init__(self, stub):
        self._requests = queue.SimpleQueue()
        self._responses = stub.Forward(iter(self._requests.get, None), timeout=60)

    def ask(self, request: expert_pb2.ExpertRequest) -> expert_pb2.ExpertResponse:
        self._requests.put(request)
        return next(self._responses)

    def close(self):
        self._requests.put(None)


def request(layer, hidden, expert_ids, expert_weights, step_id=1):
    r = expert_pb2.ExpertRequest(step_id=step_id, layer=layer)
    codec.encode(hidden, r.hidden)
    codec.encode(expert_ids.to(torch.int32), r.expert_ids)
    codec.encode(expert_weights, r.expert_weights)
    return r


def routing(num_tokens, seed=0, num_experts=8, top_k=2):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    return hidden, ids, torch.rand(num_tokens, top_k, generator=gen)


@pytest.mark.stack
def test_health_and_shard_description(service, demo_gguf):
    info = service.DescribeShard(expert_pb2.DescribeShardRequest(), timeout=10)
    assert (list(info.layers), list(info.experts)) == ([0, 1], [0, 1, 2, 3])
    assert info.arch == "qwen3moe" and info.hidden_size == HIDDEN and info.num_threads == 1
    assert info.file_id == f"demo.gguf:{demo_gguf.stat().st_size}"
    assert info.num_bytes == ExpertShard(GGUFFile(demo_gguf), experts=range(4)).num_bytes
    assert info.hostname


@pytest.mark.stack
@pytest.mark.parametrize("secret", [None, "a-wrong-cluster-secret-0123456789"], ids=["no-secret", "wrong-secret"])
def test_every_rpc_without_the_cluster_secret_is_unauthenticated(service, service_address, secret):
    with stranger_channel(service_address, secret) as channel:
        stub = expert_pb2_grpc.ExpertServiceStub(channel)
        assert_refused_but_probes_pass(channel, {
            "DescribeShard": lambda: stub.DescribeShard(expert_pb2.DescribeShardRequest(), timeout=10),
            "LoadShard": lambda: stub.LoadShard(expert_pb2.LoadShardRequest(layers=[], experts=[]), timeout=10),
            "GetStats": lambda: stub.GetStats(expert_pb2.StatsRequest(), timeout=10),
            "Forward": lambda: next(stub.Forward(iter([request(0, *routing(2))]), timeout=10)),
        })
    # The refused LoadShard emptied nothing.
    info = service.DescribeShard(expert_pb2.DescribeShardRequest(), timeout=10)
    assert (list(info.layers), list(info.experts)) == ([0, 1], [0, 1, 2, 3])


@pytest.mark.stack
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_the_shard_in_process(service, demo_gguf, dtype):
    reference = ExpertShard(GGUFFile(demo_gguf), experts=range(4))
    stream = Stream(service)
    try:
        for layer in (0, 1):
            hidden, ids, weights = routing(9, seed=layer)
            hidden = hidden.to(dtype)
            answer = stream.ask(request(layer, hidden, ids, weights, step_id=7 + layer))
            assert not answer.error and (answer.step_id, answer.layer) == (7 + layer, layer)
            assert answer.compute_s > 0
            expected = reference.forward(layer, hidden, ids, weights)
            assert torch.equal(codec.decode(answer.output), expected)
    finally:
        stream.close()


@pytest.mark.stack
def test_bad_requests_are_answered_in_band_and_the_stream_survives(service):
    stream = Stream(service)
    try:
        hidden, ids, weights = routing(4)
        good = stream.ask(request(0, hidden, ids, weights)).output
        bad = [request(0, torch.randn(4, HIDDEN + 1), ids, weights),      # wrong hidden size
               request(5, hidden, ids, weights),                          # a layer nobody hosts
               request(0, hidden, ids[:3], weights[:3]),                  # routing rows != tokens
               expert_pb2.ExpertRequest(layer=0)]                         # no tensors at all
        bad[0].hidden.data = bad[0].hidden.data[:-4]                      # and a truncated payload
        for r in bad:
            answer = stream.ask(r)
            assert answer.error and not answer.HasField("output")
        assert "hidden" in stream.ask(request(0, torch.randn(4, HIDDEN + 1), ids, weights)).error
        assert stream.ask(request(0, hidden, ids, weights)).output == good
    finally:
        stream.close()


class Doorbell:
    """A hand-driven doorbell connection: one shared-memory slot, raw headers."""

    def __init__(self, address: str):
        self.sock = doorbell.new_socket()
        self.sock.settimeout(30)
        self.sock.connect(doorbell.socket_address(address))
        self.region = ShmRegion.create(1 << 16)
        self.announced = False
        self.seq = 0

    def hello(self, version=doorbell.VERSION) -> tuple[int, bytes]:
        """(status, the challenge or the error)."""
        self.sock.send(doorbell.HELLO.pack(doorbell.KIND_HELLO, version, doorbell.MAGIC))
        answer = self.sock.recv(4096)
        return doorbell.REPLY.unpack_from(answer)[1], answer[doorbell.REPLY.size:]

    def prove(self, token=CLUSTER.token) -> tuple[int, bytes]:
        """The whole handshake; (status, error) of the proof."""
        status, challenge = self.hello()
        assert status == doorbell.STATUS_OK and len(challenge) == doorbell.NONCE_BYTES
        self.sock.send(doorbell.PROOF.pack(doorbell.KIND_PROOF, doorbell.proof(token, challenge)))
        answer = self.sock.recv(4096)
        kind, status, *_ = doorbell.REPLY.unpack_from(answer)
        assert kind == doorbell.KIND_PROOF
        return status, answer[doorbell.REPLY.size:]

    def ask(self, layer, hidden, ids, weights, slot=0):
        """(status, error, output view, compute ns) of one hop through slot 0's region."""
        (num_tokens, hidden_size), top_k = hidden.shape, ids.shape[1]
        layout = doorbell.slot_layout(num_tokens, top_k, hidden_size, hidden.dtype)
        self.region.view(layout.hidden, tuple(hidden.shape), hidden.dtype).copy_(hidden)
        self.region.view(layout.expert_ids, tuple(ids.shape), torch.int32).copy_(ids)
        self.region.view(layout.expert_weights, tuple(ids.shape), torch.float32).copy_(weights)
        announced = b"" if self.announced else doorbell.announcement(self.region.name, self.region.num_bytes)
        self.announced = True
        self.seq += 1
        self.sock.send(doorbell.REQUEST.pack(doorbell.KIND_FORWARD, codec.proto_dtype(hidden.dtype), slot, layer,
                                             num_tokens, top_k, hidden_size, self.seq, len(announced), 0) + announced)
        answer = self.sock.recv(4096)
        kind, status, seq, start_ns, end_ns, compute_ns = doorbell.REPLY.unpack_from(answer)
        assert (kind, seq) == (doorbell.KIND_FORWARD, self.seq) and start_ns <= end_ns
        output = self.region.view(layout.output, tuple(hidden.shape), hidden.dtype)
        return status, answer[doorbell.REPLY.size:].decode(), output, compute_ns

    def close(self):
        self.sock.close()
        self.region.close()


@pytest.mark.stack
def test_forward_through_the_doorbell(service, demo_gguf):
    info = service.DescribeShard(expert_pb2.DescribeShardRequest(), timeout=10)
    assert info.doorbell.startswith("@splitmoe-experts-")
    reference = ExpertShard(GGUFFile(demo_gguf), experts=range(4))
    bell = Doorbell(info.doorbell)
    try:
        assert bell.prove() == (doorbell.STATUS_OK, b"")
        for layer in (0, 1):
            hidden, ids, weights = routing(5, seed=layer)
            status, error, output, compute_ns = bell.ask(layer, hidden, ids, weights)
            assert (status, error) == (doorbell.STATUS_OK, "") and compute_ns > 0
            assert torch.equal(output, reference.forward(layer, hidden, ids, weights))
        hidden, ids, weights = routing(3)
        status, error, _, _ = bell.ask(0, torch.randn(3, HIDDEN + 1), ids, weights)  # in-band, the link lives
        assert status == doorbell.STATUS_ERROR and "hidden" in error
        status, error, _, _ = bell.ask(0, hidden, ids, weights, slot=doorbell.NUM_SLOTS)
        assert status == doorbell.STATUS_ERROR and "slot" in error
        status, _, output, _ = bell.ask(1, hidden, ids, weights)
        assert status == doorbell.STATUS_OK and torch.equal(output, reference.forward(1, hidden, ids, weights))
        bell.sock.send(b"not a header")  # a protocol error: the service hangs up
        assert bell.sock.recv(4096) == b""
    finally:
        bell.close()


@pytest.mark.stack
def test_doorbell_refuses_another_version_and_can_be_turned_off(service, demo_gguf):
    bell = Doorbell(service.DescribeShard(expert_pb2.DescribeShardRequest(), timeout=10).doorbell)
    try:
        status, error = bell.hello(version=doorbell.VERSION + 1)
        assert status == doorbell.STATUS_ERROR and b"version" in error
    finally:
        bell.close()

    from splitmoe.expert_service.server import ExpertServer
    from splitmoe.expert_service.settings import ExpertServiceSettings
    from splitmoe.expert_service.shard import HostedShard

    server = ExpertServer(ExpertServiceSettings(demo_gguf, port=0, doorbell=False, security=CLUSTER),
                          HostedShard(GGUFFile(demo_gguf)))
    port = server.start()
    try:
        with cluster_channel(f"127.0.0.1:{port}") as channel:
            info = expert_pb2_grpc.ExpertServiceStub(channel).DescribeShard(expert_pb2.DescribeShardRequest(), timeout=10)
        assert info.doorbell == "" and info.layers
    finally:
        server.stop()


@pytest.mark.stack
def test_unassigned_service_loads_a_shard_and_counts_its_tokens(unassigned):
    info = unassigned.DescribeShard(expert_pb2.DescribeShardRequest(), timeout=10)
    assert not info.layers and not info.experts and info.num_bytes == 0
    stream = Stream(unassigned)
    try:
        hidden, ids, weights = routing(20, seed=3)
        assert "not hosted" in stream.ask(request(1, hidden, ids, weights)).error
        loaded = unassigned.LoadShard(expert_pb2.LoadShardRequest(layers=[1], experts=[2, 3, 4]), timeout=10)
        assert (list(loaded.layers), list(loaded.experts)) == ([1], [2, 3, 4]) and loaded.num_bytes > 0
        ids[0, 0] = -1  # "computed elsewhere": skipped, not counted
        assert not stream.ask(request(1, hidden, ids, weights)).error
    finally:
        stream.close()
    stats = unassigned.GetStats(expert_pb2.StatsRequest(), timeout=10)
    counts = {ExpertKey(layer, e): n for layer, e, n in zip(stats.layers, stats.experts, stats.tokens)}
    sent = torch.bincount(ids[ids >= 0].reshape(-1), minlength=8)
    assert counts == {ExpertKey(1, e): int(sent[e]) for e in (2, 3, 4)}
    assert stats.num_requests == 1 and stats.compute_s_total > 0


@pytest.mark.stack
@pytest.mark.parametrize("layers, experts", [([7], [0]), ([0], [99]), ([0], [-1])])
def test_load_shard_rejects_what_the_file_lacks(unassigned, layers, experts):
    with pytest.raises(grpc.RpcError) as e:
        unassigned.LoadShard(expert_pb2.LoadShardRequest(layers=layers, experts=experts), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_span_per_layer_call_parented_by_the_callers_trace(demo_gguf):
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from splitmoe.expert_service.server import ExpertServer
    from splitmoe.expert_service.settings import ExpertServiceSettings
    from splitmoe.expert_service.shard import HostedShard
    from splitmoe.runtime.telemetry import inject_grpc_metadata, setup_tracing

    spans = InMemorySpanExporter()
    setup_tracing("test-experts", extra_processors=[SimpleSpanProcessor(spans)])
    server = ExpertServer(ExpertServiceSettings(demo_gguf, port=0, security=CLUSTER), HostedShard(GGUFFile(demo_gguf)))
    port = server.start()
    try:
        with cluster_channel(f"127.0.0.1:{port}") as channel:
            stub = expert_pb2_grpc.ExpertServiceStub(channel)
            with trace.get_tracer("test").start_as_current_span("decode step") as step:
                r = request(0, *routing(2))
                r.trace_context.update(inject_grpc_metadata())
                answer = next(stub.Forward(iter([r]), timeout=30))
        assert not answer.error
        served = [s for s in spans.get_finished_spans() if s.name == "expert.forward"]
        assert served and served[-1].parent.span_id == step.get_span_context().span_id
        assert served[-1].context.trace_id == step.get_span_context().trace_id
    finally:
        server.stop()


@pytest.mark.stack
def scrape(port: int) -> dict[str, float]:
    """The samples of an expert service's /metrics, by name (unlabelled)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}


def test_sigterm_drains_answering_hops_until_the_last_link_closes(demo_gguf, tmp_path):
    """... and /metrics tells how busy it is, and that it is draining."""
    port, metrics_port = free_port(), free_port()
    log_path = tmp_path / "experts.log"
    proc = spawn(["serve-experts", str(demo_gguf), "--port", str(port), "--layers", "1-1", "--cpus", "0",
                  "--metrics-port", str(metrics_port)], log_path)
    try:
        wait_grpc_serving(f"127.0.0.1:{port}", 60, proc)
        with cluster_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = expert_pb2_grpc.ExpertServiceStub(channel)

            def serving():
                return health.Check(health_pb2.HealthCheckRequest(service="splitmoe.v1.ExpertService"),
                                    timeout=10).status == health_pb2.HealthCheckResponse.SERVING

            assert serving() and not stub.DescribeShard(expert_pb2.DescribeShardRequest(), timeout=10).draining
            assert scrape(metrics_port)["splitmoe_expert_hops_total"] == 0
            stream = Stream(stub)
            expected = stream.ask(request(1, *routing(2)))
            assert not expected.error  # an open stream: an attention service relying on us
            for _ in range(2):
                stream.ask(request(1, *routing(64)))
            busy = scrape(metrics_port)
            assert busy["splitmoe_expert_hops_total"] == 3 and busy["splitmoe_expert_compute_seconds_total"] > 0
            assert busy["splitmoe_expert_links"] == 1 and busy["splitmoe_expert_hops_in_progress"] == 0
            assert busy["splitmoe_expert_hosted_pairs"] == 8 and busy["splitmoe_expert_hosted_bytes"] > 0
            assert busy["splitmoe_expert_draining"] == 0
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            assert scrape(metrics_port)["splitmoe_expert_draining"] == 1
            # draining: it says so (and probes fail, so that Kubernetes takes it out of its Service),
            # and goes on answering hops until its last link closes
            assert stub.DescribeShard(expert_pb2.DescribeShardRequest(), timeout=10).draining and not serving()
            again = stream.ask(request(1, *routing(2)))
            assert not again.error and again.output == expected.output
            assert proc.poll() is None
            start_s = time.monotonic()
            stream.close()
            assert proc.wait(30) == 0
            assert time.monotonic() - start_s < 3  # gone as soon as nobody sends it hops
    finally:
        proc.kill()
    log = log_path.read_text()
    assert f"ready on 127.0.0.1:{port}: demo.gguf layers 1, experts 0-7" in log
    assert "drained: no attention service sends hops here any more" in log


@pytest.mark.stack
def test_a_link_never_closed_holds_the_drain_only_until_its_timeout(demo_gguf, tmp_path):
    port = free_port()
    proc = spawn(["serve-experts", str(demo_gguf), "--port", str(port), "--layers", "1-1", "--drain-timeout-s", "1"],
                 tmp_path / "experts.log")
    try:
        wait_grpc_serving(f"127.0.0.1:{port}", 60, proc)
        with cluster_channel(f"127.0.0.1:{port}") as channel:
            stream = Stream(expert_pb2_grpc.ExpertServiceStub(channel))
            assert not stream.ask(request(1, *routing(2))).error
            start_s = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
            assert 1 <= time.monotonic() - start_s < 5
            with pytest.raises(grpc.RpcError):
                stream.ask(request(1, *routing(2)))
    finally:
        proc.kill()
    assert "still open after 1 s; stopping anyway" in (tmp_path / "experts.log").read_text()


def test_bad_command_lines_fail_with_one_line(demo_gguf, tmp_path, monkeypatch, capsys):
    from splitmoe.cli import main

    assert main(["serve-experts", str(demo_gguf), "--port", "1", "--unassigned", "--experts", "0-3"]) == 2
    assert main(["serve-experts", str(tmp_path / "missing.gguf"), "--port", "1"]) == 2
    monkeypatch.delenv("SPLITMOE_CLUSTER_TOKEN", raising=False)
    capsys.readouterr()
    # No secret: every caller is admitted, so only callers on this host may reach it.
    assert main(["serve-experts", str(demo_gguf), "--port", "1", "--host", "0.0.0.0"]) == 2
    assert "--host 0.0.0.0: listening beyond loopback needs the cluster secret" in capsys.readouterr().err
    (tmp_path / "short").write_text("tooshort\n")
    assert main(["serve-experts", str(demo_gguf), "--port", "1", "--cluster-token-file", str(tmp_path / "short")]) == 2
    assert "at least 16" in capsys.readouterr().err
    monkeypatch.setenv("SPLITMOE_CLUSTER_TOKEN", CLUSTER.token)
    assert main(["serve-experts", str(demo_gguf), "--port", "1", "--host", "0.0.0.0", "--tls-cert",
                 str(tmp_path / "missing.pem"), "--tls-key", str(tmp_path / "missing.pem")]) == 2
    assert "--tls-cert" in capsys.readouterr().err
