"""Expert services joining and leaving a serving attention service, as real processes.

Two expert services behind one name (`experts`, resolved through the attention service's
`--expert-hosts-file`, as compose's DNS or a Kubernetes headless Service would) while 8 streams
decode at temperature 0 in float32: a third service joins by `--join`, a fourth by the name
starting to resolve to one more address, each serving hops within seconds; one gets SIGTERM, is
drained and exits; and through all of it no request fails and every output stays the same. Then
`kill -9` of another: requests get an answer or a clean error, never a hang, and once its
address leaves the name the others take its experts over.
"""
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from splitmoe.proto import attention_pb2 as pb
from splitmoe.proto import attention_pb2_grpc
from tests.support.expert_services import ExpertServices
from tests.support.processes import cluster_channel, free_port, grpc_service

pytestmark = [pytest.mark.stack, pytest.mark.filterwarnings("ignore:The given buffer is not writable")]
PROMPTS = [[5 + i, 40 + 3 * i, 100 + i, 7, 200 - i, 33 + i][: 3 + i % 4] for i in range(8)]
MAX_TOKENS = 12
JOIN_WITHIN_S = 5.0


def generate(stub, ids):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    responses = list(stub.Generate(request, timeout=60))
    assert responses[-1].finish_reason == "length"
    return [t.token_id for r in responses for t in r.tokens]


def generate_all(stub):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: one batch of 8 streams
        return list(pool.map(lambda ids: generate(stub, ids), PROMPTS))


def hops_by_service(stub) -> dict[str, int]:
    return {h.expert_address: h.num_hops for h in stub.GetStats(pb.AttentionStatsRequest(), timeout=30).hops}


def wait_for(condition, timeout_s: float, what: str):
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


class Streams:
    """8 streams decoding again and again in the background; every result and error kept."""

    def __init__(self, stub):
        self.stub, self.outputs, self.errors = stub, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.outputs.append(generate_all(self.stub))
            except Exception as e:  # noqa: BLE001 - the test's verdict
                self.errors.append(e)
                return


@pytest.fixture(scope="module")
def cluster(demo_gguf, tmp_path_factory):
    logs = tmp_path_factory.mktemp("membership")
    hosts = logs / "hosts"
    hosts.write_text("127.0.0.2 experts\n127.0.0.3 experts\n")
    port, attention_port = free_port(), free_port()
    experts = ExpertServices(logs)
    experts.start("e0", demo_gguf, "--experts", "0-3", host="127.0.0.2", port=port)
    experts.start("e1", demo_gguf, "--experts", "4-7", host="127.0.0.3", port=port)
    args = ["serve-attention", str(demo_gguf), "--port", str(attention_port), "--dtype", "float32",
            "--expert-services", f"experts:{port}", "--expert-hosts-file", str(hosts), "--max-running", "16",
            "--expert-timeout-s", "10"]
    try:
        experts.wait()
        with grpc_service(args, attention_port, logs / "attention.log") as attention, \
                cluster_channel(f"127.0.0.1:{attention_port}") as channel:
            yield experts, hosts, port, f"127.0.0.1:{attention_port}", attention_pb2_grpc.AttentionServiceStub(channel), attention
    finally:
        experts.stop_all()


def test_services_join_and_drain_while_streams_decode_and_nothing_is_lost(cluster, demo_gguf):
    experts, hosts, port, attention, stub, _ = cluster
    expected = generate_all(stub)
    assert set(hops_by_service(stub)) == {f"127.0.0.2:{port}", f"127.0.0.3:{port}"}

    with Streams(stub) as streams:
        # joins by announcing itself
        experts.start("e2", demo_gguf, "--unassigned", "--join", attention, "--advertise", f"127.0.0.4:{port}",
                      host="127.0.0.4", port=port)
        experts.wait(names=("e2",))
        serving_s = time.monotonic()
        wait_for(lambda: hops_by_service(stub).get(f"127.0.0.4:{port}", 0) > 0, 30, "e2 serving hops")
        joined_by_announcing_s = time.monotonic() - serving_s

        # joins by the name resolving to one more address
        experts.start("e3", demo_gguf, "--unassigned", host="127.0.0.5", port=port)
        experts.wait(names=("e3",))
        serving_s = time.monotonic()
        hosts.write_text(hosts.read_text() + "127.0.0.5 experts\n")
        wait_for(lambda: hops_by_service(stub).get(f"127.0.0.5:{port}", 0) > 0, 30, "e3 serving hops")
        joined_by_name_s = time.monotonic() - serving_s

        # told to stop: drained first, then it exits by itself
        experts.procs["e0"].send_signal(signal.SIGTERM)
        assert experts.procs["e0"].wait(timeout=30) == 0
        left = set(hops_by_service(stub))
        decoded_meanwhile = len(streams.outputs)

        wait_for(lambda: len(streams.outputs) > decoded_meanwhile, 60, "a round of streams after the drain")

    assert not streams.errors, streams.errors[:1]
    assert streams.outputs and all(o == expected for o in streams.outputs)
    assert generate_all(stub) == expected
    assert joined_by_announcing_s < JOIN_WITHIN_S and joined_by_name_s < JOIN_WITHIN_S
    assert left == {f"127.0.0.{i}:{port}" for i in (3, 4, 5)}
    now = hops_by_service(stub)
    before = dict(now)
    generate_all(stub)
    after = hops_by_service(stub)
    assert all(after[a] > before[a] for a in after), (before, after)  # every member takes work
    log = (experts.log_dir / "e0.log").read_text()
    assert "drained: no attention service sends hops here any more" in log


def test_a_killed_service_costs_a_clean_error_until_its_name_drops_it(cluster):
    experts, hosts, port, attention, stub, _ = cluster
    expected = generate_all(stub)
    experts.kill("e1")
    start_s = time.monotonic()
    try:
        assert generate(stub, PROMPTS[0]) == expected[0]  # a replica took its experts
    except grpc.RpcError as e:  # or none had them: a clean error, soon (the gateway answers it with 503)
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e
    assert time.monotonic() - start_s < 30
    hosts.write_text("".join(line + "\n" for line in hosts.read_text().splitlines() if "127.0.0.3" not in line))
    wait_for(lambda: f"127.0.0.3:{port}" not in hops_by_service(stub), 30, "e1 dropped")
    assert generate_all(stub) == expected
