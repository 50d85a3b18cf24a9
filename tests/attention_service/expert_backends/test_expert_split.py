"""expert_backends/services.py (split_by_service), layer_call.py (the sum): every routed slot goes to exactly one service, and parts sum back."""
import torch

from splitmoe.attention_service.expert_backends.layer_call import add_part, unfinished_work
from splitmoe.attention_service.expert_backends.placement import NO_OWNER
from splitmoe.attention_service.expert_backends.services import OwnerTable, split_by_service


def fake_services_sum(hidden, work_ids, weights, parts, num_experts):
    """Each 'service' computes sum_k w * (e + 1) * x over the slots it was sent."""
    out = torch.zeros_like(hidden)
    scale = torch.arange(1, num_experts + 1, dtype=torch.float32)
    for part in parts:
        rows = torch.arange(hidden.shape[0]) if part.rows is None else part.rows
        ids = part.expert_ids.long()
        w = torch.where(ids >= 0, weights[rows] * scale[ids.clamp(min=0)], 0.0)
        add_part(out, part.rows, w.sum(1, keepdim=True) * hidden[rows])
    return out


def test_parts_sum_to_the_whole_for_random_routings_and_owners():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        num_tokens, num_experts, num_services = 13, 8, 3
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:2] for _ in range(num_tokens)])
        ids[torch.rand(num_tokens, generator=gen) < 0.2, 1] = -1  # some slots not wanted
        weights, hidden = torch.rand(num_tokens, 2, generator=gen), torch.randn(num_tokens, 4, generator=gen)
        owners = torch.randint(0, num_services, (num_experts,), generator=gen)
        parts, orphans = split_by_service(ids, OwnerTable.of(owners, num_services))
        assert orphans.numel() == 0 and len({p.service for p in parts}) == len(parts)
        everything = [type(parts[0])(0, None, ids.to(torch.int32))]
        expected = fake_services_sum(hidden, ids, weights, everything, num_experts)
        torch.testing.assert_close(fake_services_sum(hidden, ids, weights, parts, num_experts), expected)


def test_only_rows_a_service_needs_are_in_its_part():
    ids = torch.tensor([[0, 1], [0, 1], [2, 0]])
    parts, _ = split_by_service(ids, OwnerTable.of(torch.tensor([0, 0, 1]), 2))
    assert parts[0].rows is None and parts[0].expert_ids.tolist() == [[0, 1], [0, 1], [-1, 0]]
    assert parts[1].rows.tolist() == [2] and parts[1].expert_ids.tolist() == [[2, -1]]
    assert parts[1].expert_ids.dtype == torch.int32


def test_one_owner_sends_the_routing_as_is():
    ids = torch.tensor([[3, 1]])
    parts, _ = split_by_service(ids, OwnerTable.of(torch.tensor([1, 1, 1, 1]), 2))
    assert [(p.service, p.rows) for p in parts] == [(1, None)] and parts[0].expert_ids.tolist() == [[3, 1]]


def test_orphans_are_reported_not_sent():
    parts, orphans = split_by_service(torch.tensor([[0, 2], [2, 1]]), OwnerTable.of(torch.tensor([0, 0, NO_OWNER]), 1))
    assert parts == [] and orphans.tolist() == [2]


def test_unfinished_work_is_exactly_the_failed_parts_slots():
    ids = torch.tensor([[0, 2], [1, 1], [2, 3]])
    parts, _ = split_by_service(ids, OwnerTable.of(torch.tensor([0, 0, 1, 1]), 2))
    failed = [p for p in parts if p.service == 1]
    assert unfinished_work(ids.shape, failed).tolist() == [[-1, 2], [-1, -1], [2, 3]]


def test_add_part_accumulates_lower_precision_parts_in_float32():
    out = torch.zeros(3, 2)
    add_part(out, None, torch.ones(3, 2, dtype=torch.bfloat16))
    add_part(out, torch.tensor([2]), torch.full((1, 2), 0.5, dtype=torch.bfloat16))
    assert out.dtype == torch.float32 and out.tolist() == [[1, 1], [1, 1], [1.5, 1.5]]
