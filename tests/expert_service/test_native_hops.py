"""The C++ hop loop (expert_service/csrc/hop_server.cpp) behind a real doorbell: a DoorbellServer over the
demo model's shard in this process, a ShmLink client, real shared-memory slots.

Decode-sized bfloat16 hops are the loop's own; float32 hops, hops over the native token limit, an
unhosted layer and region announcements go to Python. Either way the answer is bit for bit what
the shard computes in-process, and the service's counters add up.
"""
from __future__ import annotations

import secrets
import time

import pytest
import torch

from splitmoe.attention_service.expert_backends.shm_link import ShmLink
from splitmoe.expert_service.doorbell import DoorbellServer
from splitmoe.expert_service.hops import HopHandler
from splitmoe.expert_service.shard import HostedShard
from splitmoe.kernels import native
from splitmoe.kernels.cpu_features import gemm_dtype
from splitmoe.kernels.expert_kernels import NATIVE_MAX_TOKENS, PACKED_MAX_TOKENS
from splitmoe.modelfile.expert_tensors import ExpertShard
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.proto.shm import SHM_DIR

pytestmark = [pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm"),
              pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels: {native.UNAVAILABLE_REASON}")]
HIDDEN = 64


@pytest.fixture
def served(demo_gguf):
    token = secrets.token_urlsafe(32)
    hosted = HostedShard(GGUFFile(demo_gguf), experts=range(4))
    server = DoorbellServer(HopHandler(hosted), token)
    server.start()
    link = ShmLink(server.address, token, 1 << 16, 5.0, 10.0, lambda *_: None)
    try:
        yield hosted, link
    finally:
        link.close()
        server.close_connections()


def hop(link, layer, hidden, ids, weights):
    ticket, _ = link.submit(layer, hidden, None, ids, weights)
    reply = link.wait(ticket, time.perf_counter() + 10, 10.0)
    return reply, (None if reply.output is None else reply.output.clone())


def routing(num_tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(num_tokens)])
    ids[0, 1] = -1  # a dropped slot
    return hidden, ids.to(torch.int32), torch.rand(num_tokens, 2, generator=gen)


def expected(g, experts, layer, hidden, ids, weights):
    """The shard's answer computed in this process (a shard of its own: the service's counts stay)."""
    return ExpertShard(g, experts=experts).forward(layer, hidden, ids.long(), weights)


def test_decode_hops_are_served_natively_and_equal_the_shard(served):
    hosted, link = served
    sent = torch.zeros(8, dtype=torch.int64)
    for n, seed in ((1, 1), (1, 2), (5, 3), (16, 4)):
        hidden, ids, weights = routing(n, seed)
        reply, out = hop(link, 1, hidden.bfloat16(), ids, weights)
        assert not reply.error and reply.compute_s > 0
        assert torch.equal(out, expected(hosted.g, range(4), 1, hidden.bfloat16(), ids, weights))
        sent += torch.bincount(ids[ids >= 0].long(), minlength=8)
    # the first hop announced its slot's region, which Python maps; the loop served the others
    assert int(hosted.native_hops.totals[0]) == 3
    assert hosted.totals().num_requests == 4
    counts = hosted.token_counts()
    assert {e: counts[k] for k in counts if k.layer == 1 for e in [k.expert]} == {e: int(sent[e]) for e in range(4)}


def test_what_the_loop_does_not_serve_goes_to_python(served):
    hosted, link = served
    hidden, ids, weights = routing(3, 5)
    hop(link, 0, hidden.bfloat16(), ids, weights)  # maps the slot
    served_natively = int(hosted.native_hops.totals[0])
    reply, out = hop(link, 0, hidden, ids, weights)  # float32: the exact path, in Python
    assert torch.equal(out, expected(hosted.g, range(4), 0, hidden, ids, weights))
    # over the native layer's limit, its experts packed or not: prefill's route
    big = max(NATIVE_MAX_TOKENS[gemm_dtype()], PACKED_MAX_TOKENS) + 1
    hidden, ids, weights = routing(big, 6)
    reply, out = hop(link, 0, hidden.bfloat16(), ids, weights)
    assert not reply.error and torch.equal(out, expected(hosted.g, range(4), 0, hidden.bfloat16(), ids, weights))
    reply, _ = hop(link, 7, hidden.bfloat16()[:2], ids[:2], weights[:2])  # no such layer: an error, in band
    assert "layer 7" in reply.error
    assert int(hosted.native_hops.totals[0]) == served_natively
    reply, out = hop(link, 0, hidden.bfloat16()[:2], ids[:2], weights[:2])  # and the loop goes on
    assert not reply.error and int(hosted.native_hops.totals[0]) == served_natively + 1


def test_a_new_shard_is_served_from_the_next_hop(served):
    hosted, link = served
    hidden, ids, weights = routing(4, 7)
    _, before = hop(link, 1, hidden.bfloat16(), ids, weights)
    hosted.load(hosted.moe_layers, range(4, 8))  # LoadShard: the other half of the experts
    reply, after = hop(link, 1, hidden.bfloat16(), ids, weights)
    assert not reply.error and not torch.equal(before, after)
    assert torch.equal(after, expected(hosted.g, range(4, 8), 1, hidden.bfloat16(), ids, weights))
