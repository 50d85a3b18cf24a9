"""gpu/graphs.py: the buckets a decode step is padded to, and (on CUDA) capture and replay."""
import pytest
import torch

from splitmoe.attention_service.gpu.graphs import (
    BATCH_BUCKETS,
    MIN_CONTEXT_BUCKET_TOKENS,
    batch_bucket,
    context_bucket,
)


def test_rows_pad_to_the_next_power_of_two_up_to_64():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64)] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 64, 64]
    assert batch_bucket(65) is None  # larger steps run unpadded, eagerly
    assert batch_bucket(3, (2, 6)) == 6
    assert BATCH_BUCKETS[-1] == 64


def test_contexts_pad_to_a_power_of_two_from_256_within_the_cache():
    assert MIN_CONTEXT_BUCKET_TOKENS == 256
    assert [context_bucket(n, 4096) for n in (1, 255, 256, 257, 1000, 2048, 2049, 4096)] == \
        [256, 256, 256, 512, 1024, 2048, 4096, 4096]
    assert context_bucket(3000, 3000) == 3000  # never wider than the cache's slots
    assert context_bucket(100, 160) == 160
    assert context_bucket(4097, 4096) is None and context_bucket(0, 4096) is None


@pytest.mark.cuda
def test_cuda_segment_is_captured_once_and_replays_new_inputs():
    from splitmoe.attention_service.gpu.graphs import SegmentGraphs

    graphs = SegmentGraphs(torch.device("cuda"))
    a = torch.randn(64, 64, device="cuda")
    out = torch.empty_like(a)
    runs = []

    def segment():
        runs.append(1)
        out.copy_(torch.relu(a @ a) + 1)

    graphs.run("k", segment)
    captured = len(runs)  # the warm-ups ran it, the capture recorded it
    torch.testing.assert_close(out, torch.relu(a @ a) + 1)
    a.copy_(torch.randn(64, 64, device="cuda"))
    graphs.run("k", segment)
    assert len(runs) == captured and len(graphs) == 1  # replayed, not run from Python
    torch.testing.assert_close(out, torch.relu(a @ a) + 1)
    assert graphs.num_bytes >= 0 and graphs.capture_s > 0
