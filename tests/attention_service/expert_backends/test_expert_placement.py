"""attention_service/expert_backends/placement.py: shard assignment, coverage and failover order (no I/O)."""
import pytest

from splitmoe.attention_service.expert_backends.placement import (
    NO_OWNER,
    ExpertsUnavailable,
    Placement,
    ServiceShard,
    assign_empty_services,
    reshare,
    split_evenly,
)
from splitmoe.kernels.expert_kernels import format_ranges
from splitmoe.modelfile.expert_tensors import ExpertKey

LAYERS = (0, 1, 2)


def shard(address, layers=(), experts=()):
    return ServiceShard(address, tuple(layers), tuple(experts))


def test_split_evenly_makes_contiguous_runs_differing_by_at_most_one():
    assert split_evenly(list(range(8)), 3) == [(0, 1, 2), (3, 4, 5), (6, 7)]
    assert split_evenly([2, 5], 2) == [(2,), (5,)]


def test_empty_services_split_the_uncovered_experts():
    shards = [shard("a", LAYERS, range(4)), shard("b"), shard("c")]
    assert assign_empty_services(shards, LAYERS, 8) == {1: (LAYERS, (4, 5)), 2: (LAYERS, (6, 7))}


def test_more_empty_services_than_experts_become_replicas():
    shards = [shard("a", LAYERS, range(7)), shard("b"), shard("c")]
    assert assign_empty_services(shards, LAYERS, 8) == {1: (LAYERS, (7,)), 2: (LAYERS, (7,))}


def test_with_nothing_uncovered_empty_services_add_capacity():
    shards = [shard("a", LAYERS, range(8)), shard("b"), shard("c")]
    assert assign_empty_services(shards, LAYERS, 8) == {1: (LAYERS, (0, 1, 2, 3)), 2: (LAYERS, (4, 5, 6, 7))}


def test_no_empty_services_no_assignment():
    assert assign_empty_services([shard("a", LAYERS, range(8))], LAYERS, 8) == {}


def test_missing_experts_fail_in_one_line():
    with pytest.raises(ExpertsUnavailable) as e:
        Placement.build([shard("a:1", LAYERS, range(4))], LAYERS, 8)
    assert str(e.value).startswith("no expert service hosts L0.E4, L0.E5, L0.E6, L0.E7 (+8 more)")
    assert "a:1 [layers 0-2, experts 0-3]" in str(e.value) and "\n" not in str(e.value)


def test_layers_outside_the_placement_are_ignored():
    p = Placement.build([shard("a", (0, 1, 2, 3), range(2))], (1, 3), 2)
    assert set(p.replicas) == {ExpertKey(layer, e) for layer in (1, 3) for e in range(2)}


def test_replicas_take_turns_by_layer_and_cover_for_each_other():
    p = Placement.build([shard("lo", LAYERS, range(2)), shard("hi", LAYERS, range(2, 4)), shard("all", LAYERS, range(4))],
                        LAYERS, 4)
    everyone = (True, True, True)
    assert p.owners(0, everyone).tolist() == [0, 0, 1, 1]
    assert p.owners(1, everyone).tolist() == [2, 2, 2, 2]
    assert p.owners(1, (True, True, False)).tolist() == [0, 0, 1, 1]
    assert p.owners(0, (True, False, False)).tolist() == [0, 0, NO_OWNER, NO_OWNER]
    assert p.services_of([ExpertKey(0, 3)]) == [1, 2]


def test_format_ranges():
    assert format_ranges("experts", [0, 1, 2, 5, 7, 8]) == "experts 0-2,5,7-8"
    assert format_ranges("layers", []) == "no layers"


# ---- membership changes: the fewest pairs moved ------------------------------------------------

def placed(shards, movable, num_experts=8):
    keys = reshare(shards, movable, LAYERS, num_experts)
    return [ServiceShard.of_keys(s.address, k) for s, k in zip(shards, keys)]


def test_a_newcomer_takes_a_share_from_the_busiest_and_nothing_else_moves():
    a, b, new = shard("a", LAYERS, range(0, 4)), shard("b", LAYERS, range(4, 8)), shard("new")
    after = placed([a, b, new], [True] * 3)
    assert [s.experts for s in after] == [(0, 1, 2), (4, 5, 6), (3, 7)]
    assert all(s.layers == LAYERS and not s.by_layer for s in after)  # rectangles stay rectangles
    for old, now in zip((a, b), after):  # the staying services only give experts away
        assert old.covers(now)
    Placement.build(after, LAYERS, 8)  # every expert hosted


def test_a_leavers_experts_go_to_the_services_hosting_fewest():
    a, b = shard("a", LAYERS, (0, 1, 2)), shard("b", LAYERS, (3, 4, 5, 6))  # c (7) and d left
    after = placed([a, b], [True, True])
    assert [s.experts for s in after] == [(0, 1, 2, 7), (3, 4, 5, 6)]


def test_replicas_count_as_hosted_and_per_layer_shards_stay_per_layer():
    a = ServiceShard.of_keys("a", [ExpertKey(0, e) for e in range(8)] + [ExpertKey(1, e) for e in range(4)]
                             + [ExpertKey(2, e) for e in range(8)])
    b = ServiceShard.of_keys("b", [ExpertKey(1, e) for e in range(2, 8)])
    after = placed([a, b, shard("new")], [True] * 3)
    Placement.build(after, LAYERS, 8)
    for layer in LAYERS:
        counts = [len(s.experts_in(layer)) for s in after]
        assert max(counts) - min(counts) <= 1, (layer, counts)
    assert set(after[1].experts_in(1)) <= set(range(2, 8))  # b only gave


def test_a_service_that_cannot_load_keeps_its_pairs_and_takes_none():
    down, a = shard("down", LAYERS, range(0, 6)), shard("a", LAYERS, (6, 7))
    after = placed([down, a, shard("new")], [False, True, True])
    assert after[0].experts == tuple(range(6)) and after[1].experts == (6,) and after[2].experts == (7,)
    with pytest.raises(ExpertsUnavailable, match="no healthy expert service"):
        reshare([down], [False], LAYERS, 8)
