"""Placement by load as pure functions: heat's decayed rate, the hot experts' choice, EPLB packing,
the predicted imbalance, owner tables that deal a replicated expert's tokens, auto mode's trigger."""
import pytest
import torch

from splitmoe.attention_service.expert_backends.auto_rebalance import MIN_CALLS, AutoRebalancer
from splitmoe.attention_service.expert_backends.heat import ExpertHeat, load_heat, save_heat
from splitmoe.attention_service.expert_backends.load_plan import (
    HeatBudget,
    choose_hot,
    imbalance,
    plan_by_load,
    plan_layer,
)
from splitmoe.attention_service.expert_backends.placement import Placement, ServiceShard
from splitmoe.attention_service.expert_backends.services import OwnerTable, split_by_service
from splitmoe.modelfile.expert_tensors import ExpertKey


class Clock:
    def __init__(self):
        self.now_s = 0.0

    def __call__(self):
        return self.now_s


# ---- heat -----------------------------------------------------------------------------------

def test_the_rate_follows_steady_traffic_and_halves_per_half_life_without_it():
    clock = Clock()
    heat = ExpertHeat(1, 4, half_life_s=10.0, clock=clock)
    for _ in range(200):  # 100 tokens per second to expert 2, for 200 s
        clock.now_s += 1.0
        heat.add(0, torch.full((50, 2), 2))
        heat.snapshot()
    assert heat.snapshot().tokens_per_s[0].tolist() == pytest.approx([0, 0, 100.0, 0], abs=1e-3)
    clock.now_s += 10.0
    assert heat.snapshot().tokens_per_s[0, 2] == pytest.approx(50.0, rel=1e-6)
    assert heat.snapshot().tokens[0].tolist() == [0, 0, 20000, 0]


def test_a_heat_file_round_trips_and_refuses_another_model(tmp_path):
    rates = torch.tensor([[1.5, 0.0], [2.0, 3.25]], dtype=torch.float64)
    save_heat(tmp_path / "h.json", "model-a", rates)
    assert torch.equal(load_heat(tmp_path / "h.json", "model-a", (2, 2)), rates)
    assert load_heat(tmp_path / "none.json", "model-a", (2, 2)) is None
    with pytest.raises(ValueError, match="model-b"):
        load_heat(tmp_path / "h.json", "model-b", (2, 2))
    with pytest.raises(ValueError, match="shape"):
        load_heat(tmp_path / "h.json", "model-a", (3, 2))


# ---- hot experts ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, budget", [("24", HeatBudget(num_experts=24)), ("512M", HeatBudget(num_bytes=512 << 20)),
                                          ("1.5GiB", HeatBudget(num_bytes=3 << 29)), ("300B", HeatBudget(num_bytes=300)),
                                          ("0", HeatBudget())])
def test_a_budget_is_a_count_or_a_size(text, budget):
    assert HeatBudget.parse(text) == budget


def test_hot_experts_are_the_hottest_within_the_budget_and_never_cold_ones():
    rates = torch.tensor([[5.0, 0.0, 9.0], [7.0, 1.0, 0.0], [100.0, 100.0, 100.0]])
    by_count = choose_hot(rates, [0, 1], HeatBudget(num_experts=10), lambda layer: 10)
    assert by_count == [ExpertKey(0, 2), ExpertKey(1, 0), ExpertKey(0, 0), ExpertKey(1, 1)]  # layer 2 not ours
    sizes = {0: 30, 1: 10}
    assert choose_hot(rates, [0, 1], HeatBudget(num_bytes=45), sizes.get) == [ExpertKey(0, 2), ExpertKey(1, 0)]


# ---- EPLB packing ------------------------------------------------------------------------------

def test_hot_experts_get_replicas_and_the_services_even_out():
    load = [100.0, 100.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    hosted = plan_layer(load, num_services=2, slots_per_service=5)
    assert all(0 in h and 1 in h for h in hosted)  # each hot expert on both services
    assert sorted(e for h in hosted for e in h) == [0, 0, 1, 1, 2, 3, 4, 5, 6, 7]
    per_service = [sum(load[e] / sum(e in h2 for h2 in hosted) for e in h) for h in hosted]
    assert max(per_service) / (sum(per_service) / 2) < 1.01


def test_every_expert_is_hosted_once_per_service_at_most_within_the_slots():
    gen = torch.Generator().manual_seed(3)
    rates = torch.rand(4, 16, generator=gen, dtype=torch.float64) ** 4 * 100
    shards = plan_by_load(rates, [0, 1, 2, 3], num_services=3, spare_slots=2)
    for layer in range(4):
        per_service = [[k.expert for k in s if k.layer == layer] for s in shards]
        assert all(len(experts) == len(set(experts)) <= 6 + 2 for experts in per_service)
        assert {e for experts in per_service for e in experts} == set(range(16))


def test_the_predicted_imbalance_falls_with_the_plan():
    rates = torch.tensor([[50.0, 40.0, 1.0, 1.0], [1.0, 1.0, 30.0, 60.0]], dtype=torch.float64)
    even = Placement.build([ServiceShard("a", (0, 1), (0, 1)), ServiceShard("b", (0, 1), (2, 3))], [0, 1], 4)
    healthy = [True, True]
    before = imbalance(rates, lambda layer: even.owners(layer, healthy), [0, 1], 2)
    assert before == pytest.approx((90 + 90) / (46 + 46))
    planned = [ServiceShard.of_keys(name, keys) for name, keys in zip("ab", plan_by_load(rates, [0, 1], 2))]
    after_placement = Placement.build(planned, [0, 1], 4, split_tokens=True)
    after = imbalance(rates, lambda layer: after_placement.owners(layer, healthy), [0, 1], 2)
    assert after < 1.05 < before


# ---- dealing tokens between replicas ---------------------------------------------------------------

def test_a_replicated_experts_tokens_are_dealt_by_row_between_its_healthy_replicas():
    shards = [ServiceShard.of_keys(name, keys) for name, keys in (
        ("a", [ExpertKey(0, 0), ExpertKey(0, 1)]), ("b", [ExpertKey(0, 0), ExpertKey(0, 2)]),
        ("c", [ExpertKey(0, 0), ExpertKey(0, 3)]))]
    placement = Placement.build(shards, [0], 4, split_tokens=True)
    table = OwnerTable.of(placement.owners(0, [True, True, True]), 3)
    parts, orphans = split_by_service(torch.tensor([[0, 1]] * 6), table)
    assert not orphans.numel()
    rows = {p.service: (p.rows.tolist() if p.rows is not None else "all") for p in parts}
    assert rows == {0: "all", 1: [1, 4], 2: [2, 5]}  # expert 0 dealt a, b, c; expert 1 on a: every row
    down = OwnerTable.of(placement.owners(0, [True, False, True]), 3)
    parts, _ = split_by_service(torch.tensor([[0, -1]] * 4), down)
    assert {p.service: p.rows.tolist() for p in parts} == {0: [0, 2], 2: [1, 3]}


def test_a_shard_by_layer_is_written_as_a_rectangle_when_it_is_one():
    rectangle = ServiceShard.of_keys("a", [ExpertKey(layer, e) for layer in (0, 1) for e in (2, 3)])
    assert rectangle.by_layer == () and rectangle.layers == (0, 1) and rectangle.experts == (2, 3)
    ragged = ServiceShard.of_keys("a", [ExpertKey(0, 2), ExpertKey(1, 3)])
    assert ragged.by_layer == ((0, (2,)), (1, (3,))) and set(ragged.keys()) == {ExpertKey(0, 2), ExpertKey(1, 3)}
    assert rectangle.covers(ragged) and not ragged.covers(rectangle)


# ---- auto mode ------------------------------------------------------------------------------------

@pytest.fixture
def auto():
    """(meter, rebalance calls, an AutoRebalancer over them that checks only when told)."""
    meter, calls = [0.0, 0.0, 0], []
    rebalancer = AutoRebalancer(lambda: tuple(meter), lambda: calls.append(1), threshold=1.3, interval_s=3600)
    yield meter, calls, rebalancer
    rebalancer.close()


def test_auto_mode_rebalances_only_past_its_threshold_on_enough_calls(auto):
    meter, calls, rebalancer = auto
    start = rebalancer.check((0.0, 0.0, 0))
    meter[:] = [1.2 * MIN_CALLS, 1.0 * MIN_CALLS, MIN_CALLS]  # even enough
    reading = rebalancer.check(start)
    assert not calls
    meter[:] = [reading[0] + 2.0 * 10, reading[1] + 10, reading[2] + 10]  # uneven, but too few calls
    rebalancer.check(reading)
    assert not calls
    meter[:] = [reading[0] + 2.0 * MIN_CALLS, reading[1] + MIN_CALLS, reading[2] + MIN_CALLS]
    rebalancer.check(reading)
    assert calls == [1]


def test_auto_mode_judges_light_traffic_over_as_many_checks_as_it_takes(auto):
    meter, calls, rebalancer = auto
    reading = rebalancer.check((0.0, 0.0, 0))
    for _ in range(MIN_CALLS // 10 + 1):  # uneven, 10 calls between checks
        meter[:] = [meter[0] + 2.0 * 10, meter[1] + 10, meter[2] + 10]
        reading = rebalancer.check(reading)
    assert calls == [1]


def test_small_calls_send_each_replicated_expert_whole_to_one_replica_evening_the_planned_load():
    both = [ExpertKey(0, e) for e in range(4)]
    load = torch.tensor([[10.0, 9.0, 1.0, 1.0]])
    placement = Placement.build([ServiceShard.of_keys("a", both), ServiceShard.of_keys("b", both)], [0], 4,
                                split_tokens=True, load=load)
    assert placement.whole_expert_owners(0, [True, True]).tolist() == [0, 1, 1, 0]
    assert placement.whole_expert_owners(0, [False, True]).tolist() == [1, 1, 1, 1]
    table = OwnerTable.of(placement.owners(0, [True, True]), 2, placement.whole_expert_owners(0, [True, True]),
                          split_min_rows=4)
    few, _ = split_by_service(torch.tensor([[0, 1]] * 3), table)
    many, _ = split_by_service(torch.tensor([[0, 1]] * 4), table)
    assert {p.service: p.expert_ids.tolist() for p in few} == {0: [[0, -1]] * 3, 1: [[-1, 1]] * 3}
    assert {p.service: p.rows.tolist() for p in many} == {0: [0, 2], 1: [1, 3]}  # dealt by row
