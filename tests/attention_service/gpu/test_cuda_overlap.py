"""Two micro-batches on a GPU: one half's hop copies run beside the other half's attention.

The profiler's CUDA timeline (kernels and copies with their streams) is the evidence: a copy on
the hop stream (gpu/hop_copies.py) whose interval overlaps a kernel on the compute stream.
"""
import json

import pytest
import torch

from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.demo_model import DemoShape, write_demo_model

pytestmark = pytest.mark.cuda
# Wide enough that one half's attention over a 2048-token prompt outlasts launching the other's.
WIDE = DemoShape(hidden_size=2048, num_heads=16, num_kv_heads=4, head_dim=128, expert_ffn=256, context_tokens=8192)


def timeline(tmp_path, run) -> tuple[list[dict], list[dict]]:
    """(copies, kernels) of the CUDA trace of `run()`: chrome-trace events with ts, dur and tid (the stream)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    return [e for e in events if e.get("cat") == "gpu_memcpy"], [e for e in events if e.get("cat") == "kernel"]


def overlaps(a: dict, b: dict) -> bool:
    return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]


def test_cuda_hop_copies_overlap_the_other_halfs_attention(tmp_path):
    path = tmp_path / "wide.gguf"
    write_demo_model(path, WIDE)
    runner = ModelRunner.from_gguf(path, RunnerOptions(dtype=torch.bfloat16, device=torch.device("cuda"),
                                                       kv_cache_tokens=8192, micro_batches=2))
    vocab = runner.cfg.vocab_size
    warm = [Sequence(10, [3, 4, 5]), Sequence(11, [6, 7])]
    runner.step(warm)  # cuBLAS handles, SDPA kernels: outside the timeline
    prompts = [Sequence(i, [(7 * j + i) % (vocab - 3) + 3 for j in range(2048)]) for i in range(2)]
    copies, kernels = timeline(tmp_path, lambda: runner.step(prompts))
    assert copies and kernels
    side = {c["tid"] for c in copies} - {k["tid"] for k in kernels}
    assert side, "the hop copies run on a stream of their own"
    assert any(overlaps(c, k) for c in copies if c["tid"] in side for k in kernels), \
        "no hop copy ran beside a kernel of the other micro-batch"
