"""attention_service/expert_backends/placement.py: shard assignment, coverage and failover order (no I/O)."""
import pytest

from splitmoe.attention_service.expert_backends.placement import (
    NO_OWNER,
    ExpertsUnavailable,
    Placement,
    ServiceShard,
    assign_empty_services,
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
