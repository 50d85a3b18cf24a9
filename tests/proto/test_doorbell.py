"""proto/doorbell.py: the fast path's slot layout and addresses, the same on both sides."""
import pytest
import torch

from proto import doorbell
from proto.shm import ALIGN_BYTES, tensor_nbytes


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
