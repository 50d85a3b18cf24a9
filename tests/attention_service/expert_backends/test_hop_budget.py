"""attention_service/expert_backends/hop_budget.py: when a hop is late enough to re-send to a replica."""
import pytest

from splitmoe.attention_service.expert_backends.hop_budget import MIN_MEASURED_HOPS, WINDOW_HOPS, HopBudget


def test_nothing_is_late_before_enough_hops_are_measured():
    budget = HopBudget(floor_s=0.25, margin=4.0, deadline_s=30.0)
    for _ in range(MIN_MEASURED_HOPS - 1):
        budget.add(0.002, 1)
    assert budget.after_s(1) == 30.0
    budget.add(0.002, 1)
    assert budget.after_s(1) == 0.25  # 4 x 2 ms is under the floor


def test_the_budget_grows_with_the_rows_up_to_the_deadline():
    budget = HopBudget(floor_s=0.25, margin=4.0, deadline_s=30.0)
    for _ in range(MIN_MEASURED_HOPS):
        budget.add(0.010, 10)  # 1 ms a row
    assert budget.after_s(100) == pytest.approx(0.4)  # a prefill chunk's hop gets longer
    assert budget.after_s(100_000) == 30.0


def test_a_rare_slow_hop_does_not_move_the_quantile_but_a_slow_service_does():
    budget = HopBudget(floor_s=0.001, margin=1.0, deadline_s=30.0)
    for i in range(WINDOW_HOPS):
        budget.add(5.0 if i == 7 else 0.002, 1)
    assert budget.after_s(1) == pytest.approx(0.002)
    for _ in range(WINDOW_HOPS):
        budget.add(0.050, 1)  # the window turns over: the service got slower
    assert budget.after_s(1) == pytest.approx(0.050)
