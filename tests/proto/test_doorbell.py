"""proto/doorbell.py: the fast path's slot layout, addresses, proof and announcements, the same on both sides."""
import pytest
import torch

from splitmoe.proto import doorbell
from splitmoe.proto.shm import ALIGN_BYTES, tensor_nbytes


@pytest.mark.parametrize("num_tokens, top_k, hidden_size, dtype", [(1, 8, 2048, torch.float32), (3, 2, 64, torch.bfloat16),
                                                                   (0, 1, 64, torch.float32), (512, 8, 4096, torch.float16)])
def test_slot_layout_is_aligned_disjoint_and_tight(num_tokens, top_k, hidden_size, dtype):
    layout = doorbell.slot_layout(num_tokens, top_k, hidden_size, dtype)
    sizes = [tensor_nbytes((num_tokens, hidden_size), dtype), tensor_nbytes((num_tokens, top_k), torch.int32),
             tensor_nbytes((num_tokens, top_k), torch.float32), tensor_nbytes((num_tokens, hidden_size), dtype)]
    offsets = [layout.hidden, layout.expert_ids, layout.expert_weights, layout.output, layout.num_bytes]
    assert all(o % ALIGN_BYTES == 0 for o in offsets) and offsets[0] == 0
    for start, end, size in zip(offsets, offsets[1:], sizes):
        assert start + size <= end < start + size + ALIGN_BYTES


def test_headers_are_fixed_size_and_addresses_abstract():
    assert (doorbell.HELLO.size, doorbell.REQUEST.size, doorbell.REPLY.size) == (8, 32, 40)
    assert doorbell.socket_address("@splitmoe-experts-1-ab") == "\0splitmoe-experts-1-ab"
    assert doorbell.socket_address("/run/experts.sock") == "/run/experts.sock"


def test_the_proof_binds_the_secret_to_the_challenge_and_reveals_neither():
    challenge, other = bytes(range(32)), bytes(32)
    mine = doorbell.proof("the-cluster-secret-0123456789", challenge)
    assert len(mine) == doorbell.PROOF.size - 4 and b"cluster-secret" not in mine
    assert mine == doorbell.proof("the-cluster-secret-0123456789", challenge)  # the service recomputes it
    assert mine != doorbell.proof("the-cluster-secret-0123456789", other)      # no replay on another challenge
    assert mine != doorbell.proof("another-cluster-secret-012345", challenge)


def test_a_region_is_announced_with_its_size():
    announced = doorbell.announcement("splitmoe-12-ab", 1 << 20)
    assert doorbell.parse_announcement(announced) == ("splitmoe-12-ab", 1 << 20)
    with pytest.raises(ValueError, match="without a name"):
        doorbell.parse_announcement(announced[:doorbell.REGION_SIZE.size])
