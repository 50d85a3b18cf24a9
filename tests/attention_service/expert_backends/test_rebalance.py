"""Placement by load against real `splitmoe serve-experts` processes: heat, hot experts kept in
the attention process, and rebalancing while decode steps run.

The demo model routes two experts per token, so in float32 every placement adds the same two
products per token (a + b == b + a): the logits must be bit-identical, not merely close.
"""
import functools
import json
import threading
import time

import pytest
import torch

from splitmoe.attention_service.expert_backends.heat import load_heat
from splitmoe.attention_service.expert_backends.load_plan import HeatBudget
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.modelfile.expert_tensors import ExpertKey
from splitmoe.modelfile.gguf_file import GGUFFile
from tests.support.expert_services import ExpertServices, remote_experts

pytestmark = [
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
    pytest.mark.stack,  # real `splitmoe serve-experts` processes
]
OPTIONS = RunnerOptions(device=torch.device("cpu"), kv_cache_tokens=512)
EXPERT_TIMEOUT_S = 10.0
PROMPTS = [[5, 17, 30, 42, 7, 99], [250, 3, 11, 64], [128, 200, 271, 0, 9], [1, 2, 3]]
NUM_LAYERS, NUM_EXPERTS = 2, 8  # the demo model's


@pytest.fixture(scope="module")
def services(demo_gguf, tmp_path_factory):
    s = ExpertServices(tmp_path_factory.mktemp("logs"))
    s.start("all", demo_gguf, "--experts", "0-7")
    for name, experts in (("r0", "0-3"), ("r1", "4-7"), ("r2", "0-7")):
        s.start(name, demo_gguf, "--experts", experts)
    try:
        s.wait()
        yield s
    finally:
        s.stop_all()


remote = functools.partial(remote_experts, expert_timeout_s=EXPERT_TIMEOUT_S)  # a test's own settings win


def skewed_rates(hot=(0, 1), seed=0) -> torch.Tensor:
    """Most tokens to the `hot` experts of every layer, a trickle to the rest."""
    rates = torch.rand(NUM_LAYERS, NUM_EXPERTS, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    rates[:, list(hot)] += 50.0
    return rates


def write_heat(path, g, rates):
    path.write_text(json.dumps({"file_id": g.file_id, "tokens_per_s": rates.tolist()}))
    return str(path)


def greedy(runner, num_tokens=12, first_seq_id=0):
    """Temperature-0 continuations of every prompt, decoded together; and every step's logits."""
    seqs = [Sequence(first_seq_id + i, list(p)) for i, p in enumerate(PROMPTS)]
    steps = []
    for _ in range(num_tokens):
        logits = runner.step(seqs)
        steps.append(logits)
        for seq, token in zip(seqs, logits.argmax(-1).tolist()):
            seq.token_ids.append(token)
    for seq in seqs:
        runner.release(seq)
    return [s.token_ids[len(p):] for s, p in zip(seqs, PROMPTS)], torch.stack(steps)


# ---- heat ------------------------------------------------------------------------------------

def test_heat_counts_the_routing_and_its_rate_decays(services, demo_gguf):
    g = GGUFFile(demo_gguf)
    with remote(g, services.address("all")) as backend:
        ids = torch.tensor([[0, 1]] * 30 + [[2, 1]] * 10)
        backend.forward(1, torch.randn(40, 64), ids, torch.rand(40, 2))
        heat = backend.expert_heat()
    assert heat.tokens[1].tolist() == [30, 40, 10, 0, 0, 0, 0, 0] and not heat.tokens[0].any()
    assert heat.tokens_per_s[1, 1] > heat.tokens_per_s[1, 0] > heat.tokens_per_s[1, 2] > 0 == heat.tokens_per_s[1, 3]


# ---- hot experts in the attention process ---------------------------------------------------------

def test_hot_experts_give_the_logits_of_the_all_remote_placement(services, demo_gguf, tmp_path):
    g = GGUFFile(demo_gguf)
    with remote(g, services.address("all")) as backend:
        all_remote = ModelRunner.from_gguf(demo_gguf, OPTIONS, experts=backend).step(
            [Sequence(0, PROMPTS[0] * 3)], all_logits=True)
    heat_file = write_heat(tmp_path / "heat.json", g, skewed_rates(hot=(2, 5)))
    with remote(g, services.address("all"), local_by_heat=HeatBudget(num_experts=3), heat_file=heat_file) as backend:
        before = backend.expert_token_counts()
        hot_logits = ModelRunner.from_gguf(demo_gguf, OPTIONS, experts=backend).step(
            [Sequence(0, PROMPTS[0] * 3)], all_logits=True)
        sent = {k: n - before.get(k, 0) for k, n in backend.expert_token_counts().items()}
        view = backend.placement_view()
        routed = backend.expert_heat().tokens
    hot = [k for k, where in view.items() if where == ("local",)]
    assert len(hot) == 3 and {k.expert for k in hot} <= {2, 5}  # the hottest three of the file's heat
    assert all(sent.get(k, 0) == 0 for k in hot) and sum(routed[k].item() for k in hot) > 0  # routed, not sent
    assert torch.equal(hot_logits, all_remote)


def test_a_size_budget_keeps_as_many_hot_experts_as_fit(services, demo_gguf, tmp_path):
    g = GGUFFile(demo_gguf)
    heat_file = write_heat(tmp_path / "heat.json", g, skewed_rates())
    with remote(g, services.address("all"), heat_file=heat_file) as probe:
        one_expert_bytes = probe._bytes_of_expert(0)
    budget = HeatBudget.parse(str(int(one_expert_bytes * 2.5)) + "B")
    with remote(g, services.address("all"), local_by_heat=budget, heat_file=heat_file) as backend:
        assert sum(where == ("local",) for where in backend.placement_view().values()) == 2


# ---- rebalancing while serving ------------------------------------------------------------------

def test_dry_run_moves_nothing(services, demo_gguf):
    g = GGUFFile(demo_gguf)
    with remote(g, services.address("r0"), services.address("r1")) as backend:
        backend.heat.seed(skewed_rates(hot=(0, 1)))
        before = backend.placement_view()
        report = backend.rebalance(dry_run=True)
        assert not report.changed and report.imbalance_after < report.imbalance_before
        assert backend.placement_view() == before


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_rebalance_while_decoding_changes_no_output_and_fails_nothing(services, demo_gguf, tmp_path, transport):
    g = GGUFFile(demo_gguf)
    addresses = [services.address(n) for n in ("r0", "r1", "r2")]
    heat_file = tmp_path / "heat.json"
    with remote(g, *addresses, transport=transport, heat_file=str(heat_file)) as backend:
        runner = ModelRunner.from_gguf(demo_gguf, OPTIONS, experts=backend)
        expected, expected_logits = greedy(runner)
        outputs, errors, stop = [], [], threading.Event()

        def decode_meanwhile():
            seq_ids = iter(range(100, 10**6, len(PROMPTS)))
            while not stop.is_set():
                try:
                    outputs.append(greedy(runner, first_seq_id=next(seq_ids)))
                except Exception as e:  # noqa: BLE001 - the test's verdict
                    errors.append(e)
                    return

        decoder = threading.Thread(target=decode_meanwhile)
        decoder.start()
        reports = []
        try:
            for hot in ((0, 1), (6, 7), (3, 4)):  # a new skew each time: experts move every round
                while len(outputs) < len(reports) + 1 and decoder.is_alive():
                    stop.wait(0.01)  # at least one whole decode on each placement
                backend.heat.seed(skewed_rates(hot))
                reports.append(backend.rebalance())
        finally:
            while len(outputs) < len(reports) + 1 and decoder.is_alive():
                stop.wait(0.01)
            stop.set()
            decoder.join()
        after, after_logits = greedy(runner)
        view = backend.placement_view()
        shards = [c.describe(5.0) for c in backend._services._clients]
        planned = {s.address: set(s.keys()) for s in backend._services.placement.shards}

    assert not errors
    assert all(r.changed and r.imbalance_after < r.imbalance_before for r in reports), reports
    assert all(tokens == expected for tokens, _ in outputs) and after == expected
    assert (after_logits - expected_logits).abs().max() <= 1e-5
    # the last skew's hot experts have replicas, and every service hosts only its new shard
    assert all(len(view[ExpertKey(layer, e)]) >= 2 for layer in range(NUM_LAYERS) for e in (3, 4))
    # (by its keys: a shard the plan happens to make rectangular has no by_layer, and the plan moves
    # with the heat the decoding thread adds)
    assert all(set(shard.keys()) == planned[shard.address] and len(planned[shard.address]) == 2 * 4
               for shard in shards)
    assert load_heat(heat_file, g.file_id, (NUM_LAYERS, NUM_EXPERTS)) is not None  # written at each rebalance


def test_rebalance_splits_a_hot_experts_tokens_between_its_replicas_in_large_calls(services, demo_gguf):
    g = GGUFFile(demo_gguf)
    addresses = [services.address(n) for n in ("r0", "r1", "r2")]
    with remote(g, *addresses, transport="grpc", split_tokens_min_rows=16) as backend:
        backend.heat.seed(skewed_rates(hot=(0,)))
        report = backend.rebalance()
        replicas = backend.placement_view()[ExpertKey(1, 0)]
        stats = [backend.stats()]
        for num_rows in (30, 8):  # a prefill-sized call, then a decode-sized one
            ids = torch.tensor([[0, -1]] * num_rows)
            backend.forward(1, torch.randn(num_rows, 64), ids, torch.ones(num_rows, 2))
            stats.append(backend.stats())
    assert report.changed and len(replicas) == 3  # 3 services x 4 slots: expert 0 gets every spare
    for (before, after), hops, rows in zip(zip(stats, stats[1:]), ({1}, {0, 1}), ({10}, {0, 8})):
        assert {after[a].num_hops - before[a].num_hops for a in addresses} == hops
        assert {(after[a].received_bytes - before[a].received_bytes) // (64 * 4) for a in addresses} == rows
    # 30 rows: dealt 10 to each replica; 8 rows: too few to split, the expert goes whole to one


def test_auto_mode_rebalances_when_the_measured_imbalance_passes_its_threshold(services, demo_gguf):
    g = GGUFFile(demo_gguf)
    addresses = [services.address(n) for n in ("r0", "r1", "r2")]
    hidden, ids, weights = torch.randn(24, 64), torch.tensor([[0, 1]] * 24), torch.rand(24, 2)
    with remote(g, *addresses, auto_rebalance_imbalance=1.2, auto_rebalance_interval_s=0.2,
                split_tokens_min_rows=16) as backend:  # 24-row calls: dealt between replicas
        expected = backend.forward(1, hidden, ids, weights)
        deadline_s = time.monotonic() + 30
        # both layers' traffic is measured: wait until both are dealt over every service
        while (min(len(backend.placement_view()[ExpertKey(layer, e)]) for layer in (0, 1) for e in (0, 1)) < 3
               and time.monotonic() < deadline_s):
            for layer in (0, 1):  # all traffic on experts 0 and 1: two services busy, one idle
                assert torch.equal(backend.forward(layer, hidden, ids, weights), expected) or layer == 0
        view = backend.placement_view()
        busiest, mean, num_calls = backend.imbalance_meter()
    assert all(len(view[ExpertKey(layer, e)]) == 3 for layer in (0, 1) for e in (0, 1))  # dealt over every service
    assert num_calls == 0 or busiest / mean < 1.2  # measured anew since the switch


def test_a_service_restarted_after_a_rebalance_is_given_its_new_shard_again(services, demo_gguf):
    g = GGUFFile(demo_gguf)
    addresses = [services.address(n) for n in ("r0", "r1", "r2")]
    hidden, ids, weights = torch.randn(12, 64), torch.randint(0, 8, (12, 2)), torch.rand(12, 2)
    with remote(g, *addresses, transport="grpc") as backend:
        backend.heat.seed(skewed_rates(hot=(2, 3)))
        assert backend.rebalance().changed
        expected = backend.forward(1, hidden, ids, weights)
        planned = backend._services._clients[1].shard
        services.kill("r1")
        services.restart("r1")  # comes back with its command line's shard, experts 4-7
        deadline_s = time.monotonic() + 30
        while not backend.health()[addresses[1]].healthy and time.monotonic() < deadline_s:
            time.sleep(0.05)
        reported = backend._services._clients[1].describe(5.0)
        got = backend.forward(1, hidden, ids, weights)
    assert planned.by_layer and reported.covers(planned)
    assert torch.equal(got, expected)
