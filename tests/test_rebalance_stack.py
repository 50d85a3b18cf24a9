"""`splitmoe rebalance` and `splitmoe heatmap` against real processes: two expert services and an
attention service on a model whose router sends most tokens to two experts per layer.

Streams decode at temperature 0 before, during and after the rebalance: every output is the same
and no request fails; the traffic's measured imbalance falls.
"""
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from splitmoe.bench.skewed_model import write_skewed
from splitmoe.proto import attention_pb2 as pb
from splitmoe.proto import attention_pb2_grpc
from splitmoe.run_dirs import latest_run, record_run
from tests.support.expert_services import ExpertServices
from tests.support.processes import CLUSTER, cluster_channel, free_port, grpc_service, run_splitmoe

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
PROMPTS = [[5 + i, 40 + 3 * i, 100 + i, 7, 200 - i, 33 + i][: 3 + i % 4] for i in range(8)]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def skewed_gguf(demo_gguf, tmp_path_factory):
    path = tmp_path_factory.mktemp("skewed") / "skewed.gguf"
    write_skewed(demo_gguf, path, per_layer=2, strength=4.0)
    return path


@pytest.fixture(scope="module")
def stack(skewed_gguf, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    experts = ExpertServices(logs)
    experts.start("e0", skewed_gguf, "--experts", "0-3")
    experts.start("e1", skewed_gguf, "--experts", "4-7")
    port = free_port()
    args = ["serve-attention", str(skewed_gguf), "--port", str(port), "--dtype", "float32", "--transport", "grpc",
            "--expert-services", f"{experts.address('e0')},{experts.address('e1')}", "--max-running", "16"]
    try:
        experts.wait()
        with grpc_service(args, port, logs / "attention.log"), cluster_channel(f"127.0.0.1:{port}") as channel:
            yield f"127.0.0.1:{port}", attention_pb2_grpc.AttentionServiceStub(channel)
    finally:
        experts.stop_all()


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "cluster-token"
    path.write_text(CLUSTER.token)
    path.chmod(0o600)
    return str(path)


def generate(stub, ids):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    responses = list(stub.Generate(request, timeout=120))
    assert responses[-1].finish_reason == "length"
    return [t.token_id for r in responses for t in r.tokens]


def generate_all(stub):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: one batch of many streams
        return list(pool.map(lambda ids: generate(stub, ids), PROMPTS))


@pytest.mark.stack
def test_rebalance_while_streaming_changes_no_output_and_evens_the_load(stack, token_file, tmp_path):
    address, stub = stack
    expected = generate_all(stub)
    before = stub.GetStats(pb.AttentionStatsRequest())
    outputs, errors, stop = [], [], threading.Event()

    def stream_meanwhile():
        while not stop.is_set():
            try:
                outputs.append(generate_all(stub))
            except Exception as e:  # noqa: BLE001 - the test's verdict
                errors.append(e)
                return

    streamer = threading.Thread(target=stream_meanwhile)
    streamer.start()
    try:
        said = run_splitmoe("rebalance", "--attention", address, "--cluster-token-file", token_file)
    finally:
        stop.set()
        streamer.join()
    after = generate_all(stub)
    stats = stub.GetStats(pb.AttentionStatsRequest())
    picture = tmp_path / "heat.svg"
    run_splitmoe("heatmap", str(picture), "--attention", address, "--cluster-token-file", token_file)

    assert "rebalanced" in said, said
    assert not errors and outputs
    assert all(o == expected for o in outputs) and after == expected
    # the skewed traffic was uneven between the two services, and is even now: the hot experts
    # have a replica on each service, their tokens dealt between them
    assert before.expert_imbalance > 1.3 and stats.expert_imbalance < before.expert_imbalance - 0.2
    hottest = {}
    for e in stats.expert_heat:
        if e.tokens_per_s > hottest.get(e.layer, (0, None))[0]:
            hottest[e.layer] = (e.tokens_per_s, e)
    assert all(len(e.placed_on) == 2 for _, e in hottest.values())
    assert "<svg" in picture.read_text()[:2000]


@pytest.mark.stack
def test_dry_run_reports_and_moves_nothing(stack, token_file):
    address, stub = stack
    placed = {(e.layer, e.expert): tuple(e.placed_on) for e in stub.GetStats(pb.AttentionStatsRequest()).expert_heat}
    said = run_splitmoe("rebalance", "--dry-run", "--attention", address, "--cluster-token-file", token_file)
    assert "imbalance" in said
    assert placed == {(e.layer, e.expert): tuple(e.placed_on) for e in stub.GetStats(pb.AttentionStatsRequest()).expert_heat}


def test_the_latest_up_run_is_found_with_its_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / "services.json").write_text(
        '{"supervisor_pid": %d, "services": [{"name": "attention", "address": "127.0.0.1:5"}]}' % os.getpid())
    record_run(run_dir, CLUSTER.token)
    found = latest_run()
    assert found.attention_address == "127.0.0.1:5" and found.token_file.read_text().strip() == CLUSTER.token
    assert (found.token_file.stat().st_mode & 0o777) == 0o600  # the secret: its user's only
    (run_dir / "services.json").write_text('{"supervisor_pid": 999999999, "services": []}')
    with pytest.raises(ValueError, match="has stopped"):
        latest_run()
