"""splitmoe/runtime/cluster_auth.py: the cluster secret's rules, and TLS links between real servers.

The secret's refusal on every RPC is tested per service (tests/expert_service/test_server.py,
tests/attention_service/test_server.py). Here: what counts as a secret and where it may be read
from, where a service without one may listen, and TLS with a throwaway CA made in the test: an
expert service and an attention service each serve TLS to the clients that really call them (the
attention side's expert link, the gateway's client, `splitmoe healthcheck`), and a plaintext
client, a client trusting another CA or one naming the wrong server are refused.
"""
from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch

from splitmoe.attention_service.expert_backends.service_client import ConnectionSettings, ExpertServiceClient
from splitmoe.attention_service.server import serve as serve_attention
from splitmoe.attention_service.settings import AttentionSettings, serving_runner_options
from splitmoe.cli import main
from splitmoe.expert_service.server import ExpertServer
from splitmoe.expert_service.settings import ExpertServiceSettings
from splitmoe.expert_service.shard import HostedShard
from splitmoe.gateway.attention_client import AttentionClient, AttentionError
from splitmoe.gateway.settings import GatewaySettings
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.proto import expert_pb2, expert_pb2_grpc
from splitmoe.runtime.cluster_auth import ClusterSecurity, is_loopback
from tests.support.processes import CLUSTER, free_port, wait_grpc_serving
from tests.support.tls import make_pki

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
TOKEN = CLUSTER.token


# ---- the secret ---------------------------------------------------------------------------------

@pytest.mark.parametrize("token, why", [("short", "at least 16"), ("with a space in it, long", "printable ASCII"),
                                        ("ünïcödé-secret-0123456789", "printable ASCII")])
def test_what_is_not_a_secret_is_refused(token, why):
    with pytest.raises(ValueError, match=why):
        ClusterSecurity(token=token)


def test_the_file_wins_over_the_environment_and_errors_name_the_file(tmp_path):
    (tmp_path / "token").write_text(f"  {TOKEN}-from-file\n")
    assert ClusterSecurity.load("environment-secret-0123456789", tmp_path / "token").token == f"{TOKEN}-from-file"
    assert ClusterSecurity.load("environment-secret-0123456789").token == "environment-secret-0123456789"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match=r"--cluster-token-file .*empty: the file is empty"):
        ClusterSecurity.load("", tmp_path / "empty")
    with pytest.raises(ValueError, match=r"--cluster-token-file .*missing: No such file"):
        ClusterSecurity.load("", tmp_path / "missing")
    (tmp_path / "cert.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match=r"--tls-ca .*cert.pem: not a PEM file"):
        ClusterSecurity.load(TOKEN, tls_ca=tmp_path / "cert.pem")
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        ClusterSecurity(TOKEN, tls_cert=b"-----BEGIN CERTIFICATE-----")


def test_the_secret_never_shows_in_what_is_printed():
    security = ClusterSecurity(TOKEN, b"-----BEGIN CERT", b"-----BEGIN KEY", b"-----BEGIN CA")
    assert TOKEN not in repr(security) and b"KEY" not in repr(security).encode()
    assert TOKEN not in security.describe_server()
    assert security.describe_server() == "the cluster secret required, TLS with client certificates"


def test_cluster_token_writes_a_private_file_once_and_keeps_it(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SPLITMOE_CLUSTER_TOKEN", raising=False)
    path = tmp_path / "cluster-token"
    assert main(["cluster-token", str(path)]) == 0
    made = path.read_text()
    assert len(made.strip()) >= 32 and (path.stat().st_mode & 0o777) == 0o600
    assert main(["cluster-token", str(path)]) == 0 and path.read_text() == made  # compose restarts keep it
    monkeypatch.setenv("SPLITMOE_CLUSTER_TOKEN", TOKEN)
    assert main(["cluster-token", str(path)]) == 0 and path.read_text() == TOKEN + "\n"  # the operator's own
    monkeypatch.setenv("SPLITMOE_CLUSTER_TOKEN", "short")
    assert main(["cluster-token", str(path)]) == 2 and path.read_text() == TOKEN + "\n"
    printed = capsys.readouterr()
    assert TOKEN not in printed.out + printed.err and made.strip() not in printed.out + printed.err


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True),
                                            ("localhost", True), ("0.0.0.0", False), ("::", False),
                                            ("10.0.0.5", False), ("expert", False)])
def test_without_a_secret_a_service_may_listen_on_loopback_only(host, loopback):
    assert is_loopback(host) == loopback
    if loopback:
        ClusterSecurity().check_listen(host)
    else:
        with pytest.raises(ValueError, match="needs the cluster secret"):
            ClusterSecurity().check_listen(host)
    CLUSTER.check_listen(host)  # with one, anywhere


# ---- TLS ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    return make_pki(directory, {"expert": ["127.0.0.1", "localhost"], "elsewhere": ["experts.internal"],
                                "attention": ["127.0.0.1"]})


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("other-pki"), {}).ca


def client(pki, cert: str = "", ca=None) -> ClusterSecurity:
    pair = pki.certs[cert] if cert else (None, None)
    return ClusterSecurity.load(TOKEN, None, *pair, ca or pki.ca)


@pytest.fixture(scope="module")
def tls_experts(pki, demo_gguf):
    """Expert services: one with a certificate for 127.0.0.1, one for another name, one requiring client
    certificates; address by name."""
    servers = {}
    for name, cert, require_client_certificate in (("tls", "expert", False), ("elsewhere", "elsewhere", False),
                                                   ("mutual", "expert", True)):
        security = ClusterSecurity.load(TOKEN, None, *pki.certs[cert], pki.ca if require_client_certificate else None)
        server = ExpertServer(ExpertServiceSettings(demo_gguf, port=0, security=security), HostedShard(GGUFFile(demo_gguf)))
        servers[name] = (server, f"127.0.0.1:{server.start()}")
    yield {name: address for name, (_, address) in servers.items()}
    for server, _ in servers.values():
        server.stop()


def describe(security: ClusterSecurity, address: str, server_name: str = "") -> expert_pb2.ShardInfo:
    with security.channel(address, server_name=server_name) as channel:
        return expert_pb2_grpc.ExpertServiceStub(channel).DescribeShard(expert_pb2.DescribeShardRequest(), timeout=5)


def refused(security: ClusterSecurity, address: str, server_name: str = "") -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        describe(security, address, server_name)
    return e.value.code()


def test_the_attention_sides_expert_link_works_over_tls(pki, tls_experts):
    settings = ConnectionSettings(connect_timeout_s=2.0, transport="grpc", shm_initial_bytes=1 << 20, security=client(pki))
    expert = ExpertServiceClient(tls_experts["tls"], settings)
    try:
        expert.open_stream(expert.describe(5.0))
        assert expert.transport == "grpc"
        gen = torch.Generator().manual_seed(0)
        hidden, ids = torch.randn(3, 64, generator=gen), torch.tensor([[0, 5], [1, 2], [7, 3]], dtype=torch.int32)
        out = expert.wait(expert.submit(0, hidden, None, ids, torch.rand(3, 2, generator=gen)))
        assert out.shape == (3, 64) and out.abs().sum() > 0
    finally:
        expert.close()


def test_plaintext_another_ca_and_the_wrong_server_name_are_refused(pki, other_ca, tls_experts):
    address = tls_experts["tls"]
    assert refused(CLUSTER, address) == grpc.StatusCode.UNAVAILABLE  # plaintext to a TLS port: no handshake
    assert refused(client(pki, ca=other_ca), address) == grpc.StatusCode.UNAVAILABLE
    assert refused(ClusterSecurity.load("", tls_ca=pki.ca), address) == grpc.StatusCode.UNAUTHENTICATED
    # Certificates name the service, not the address dialed (a compose service name resolved per replica).
    assert refused(client(pki), tls_experts["elsewhere"]) == grpc.StatusCode.UNAVAILABLE
    assert describe(client(pki), tls_experts["elsewhere"], server_name="experts.internal").layers


def test_a_server_given_the_ca_requires_client_certificates(pki, tls_experts):
    assert refused(client(pki), tls_experts["mutual"]) == grpc.StatusCode.UNAVAILABLE
    assert describe(client(pki, cert="attention"), tls_experts["mutual"]).layers


def test_healthcheck_probes_a_tls_service_with_the_ca(pki, tls_experts):
    assert main(["healthcheck", tls_experts["tls"], "--tls-ca", str(pki.ca), "--timeout-s", "5"]) == 0
    assert main(["healthcheck", tls_experts["tls"], "--timeout-s", "2"]) == 1


def test_the_gateway_reaches_a_tls_attention_service(pki, demo_gguf):
    port = free_port()
    security = ClusterSecurity.load(TOKEN, None, *pki.certs["attention"])
    stop = threading.Event()
    attention = threading.Thread(target=lambda: asyncio.run(serve_attention(
        AttentionSettings(model_path=str(demo_gguf), port=port, runner=serving_runner_options(kv_cache_tokens=64),
                          security=security),
        external_stop=stop)))
    attention.start()
    try:
        wait_grpc_serving(f"127.0.0.1:{port}", 60, security=client(pki))

        async def model_info(cluster: ClusterSecurity):
            gateway_client = AttentionClient(GatewaySettings(attention_address=f"127.0.0.1:{port}", cluster=cluster,
                                                             probe_timeout_s=5))
            try:
                return await gateway_client.model_info()
            finally:
                await gateway_client.close()

        assert asyncio.run(model_info(client(pki))).ready
        with pytest.raises(AttentionError) as plaintext:
            asyncio.run(model_info(CLUSTER))
        assert plaintext.value.status == 503
    finally:
        stop.set()
        attention.join(30)
