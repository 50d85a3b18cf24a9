"""Micro-batches (MegaScale-Infer's ping-pong): a step cut in two by sequence and pipelined layer by
layer, attention of one half while the experts of the other are computed, gives the unsplit logits.

Bit-equality holds where the matrix products are batch-invariant. CPU (and GPU) GEMMs are not: a
row's result depends on how many rows are multiplied with it (blocking, gemv vs gemm), so the
bit-equal test runs the products one row at a time (`RowByRow`), which proves the pipeline adds,
reorders and mixes nothing; with the production kernels the test asks for float32 closeness.
"""
import itertools
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from splitmoe.attention_service.expert_backends.backend import InProcessExperts
from splitmoe.attention_service.model.batch import SeqSlice, StepBatch
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.attention_service.settings import AttentionSettings
from splitmoe.demo_model import DemoShape, write_demo_model
from splitmoe.modelfile.gguf_file import GGUFFile

PROMPTS = [[5, 17, 30, 42, 7, 99], [250, 3, 11], [64, 128, 200, 271, 0, 1, 2, 9, 40], [33, 34],
           [7, 7, 7, 7, 7], [100, 101, 102]]
_ROW_FUNCS = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm}


class RowByRow(TorchFunctionMode):
    """Matrix products one row at a time: every row's result is independent of the batch size."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if func in _ROW_FUNCS and isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-2] > 1:
            return torch.cat([func(x[..., i:i + 1, :], *args[1:], **kwargs) for i in range(x.shape[-2])], dim=-2)
        return func(*args, **kwargs)


class _Handle:
    def __init__(self, future, log, key):
        self._future, self._log, self._key = future, log, key

    def wait(self):
        self._log.append(("wait", *self._key))
        return self._future.result()


class ThreadedExperts:
    """In-process experts computed on another thread: `submit` returns before they finish, as
    RemoteExperts' does; the log shows how the calls interleave."""

    def __init__(self, g: GGUFFile, row_by_row: bool):
        self.inner, self.row_by_row = InProcessExperts(g), row_by_row
        self.pool = ThreadPoolExecutor(1)
        self.log: list[tuple] = []

    def forward(self, layer, hidden, expert_ids, expert_weights):
        return self.submit(layer, hidden, expert_ids, expert_weights).wait()

    def submit(self, layer, hidden, expert_ids, expert_weights):
        key = (layer, hidden.shape[0])
        self.log.append(("submit", *key))
        return _Handle(self.pool.submit(self._compute, layer, hidden, expert_ids, expert_weights), self.log, key)

    def _compute(self, *call):
        with torch.inference_mode():  # modes and inference mode are per thread
            if self.row_by_row:
                with RowByRow():
                    return self.inner.forward(*call)
            return self.inner.forward(*call)

    def close(self):
        self.pool.shutdown()


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory):
    """The demo model with float32 tensors: no quantized kernels, every product a torch one."""
    path = tmp_path_factory.mktemp("f32") / "demo-f32.gguf"
    write_demo_model(path, DemoShape(quant="f32"))
    return path


def run_steps(path, experts, micro_batches, num_decodes=3):
    """A prefill of every prompt in one step, then decode steps of all sequences; every step's logits."""
    options = RunnerOptions(device=torch.device("cpu"), kv_cache_tokens=256, kv_block_tokens=4,
                            micro_batches=micro_batches)
    runner = ModelRunner.from_gguf(path, options, experts=experts)
    assert runner.model.micro_batches == micro_batches
    seqs = [Sequence(i, list(p), num_experts_per_token=1 if i == 3 else 0) for i, p in enumerate(PROMPTS)]
    out = [runner.step(seqs, all_logits=True)]
    last = out[0][torch.tensor(list(itertools.accumulate(map(len, PROMPTS)))) - 1]
    for _ in range(num_decodes):
        for s, logits in zip(seqs, last):
            s.token_ids.append(int(logits.argmax()))
        last = runner.step(seqs)
        out.append(last)
    return out


def test_pipelined_step_is_bit_equal_to_the_unsplit_step(f32_model):
    g = GGUFFile(f32_model)
    with RowByRow():
        unsplit = run_steps(f32_model, InProcessExperts(g), micro_batches=1)
        experts = ThreadedExperts(g, row_by_row=True)
        try:
            pipelined = run_steps(f32_model, experts, micro_batches=2)
        finally:
            experts.close()
    for a, b in zip(unsplit, pipelined):
        assert torch.equal(a, b)
    # Per layer: both halves' experts submitted before the first half's are waited for.
    first_step = experts.log[:8]
    assert [e[0] for e in first_step] == ["submit", "submit", "wait", "submit", "wait", "submit", "wait", "wait"]
    assert [e[1] for e in first_step] == [0, 0, 0, 1, 0, 1, 1, 1]


def test_pipelined_step_is_close_with_the_production_kernels(f32_model, demo_gguf):
    for path in (f32_model, demo_gguf):
        assert_pipelined_close(path)


@pytest.mark.parametrize("model", ["dbrx/dbrx-q8_0.gguf",  # LayerNorms and the q/k/v clamp in the pipelined loop
                                   "deepseek/deepseek-q8_0.gguf"])  # a dense layer between MoE ones
def test_pipelined_step_is_close_on_llama_cpp_fixtures(fixtures_dir, model):
    assert_pipelined_close(fixtures_dir / model)


def test_send_ahead_thread_pipelines_to_the_unsplit_logits(demo_gguf, monkeypatch):
    """The GPU's micro-batches: each half's experts started by the backend's send-ahead thread
    (gpu/send_ahead.py) while the engine thread queues the other half. Forced here on the CPU."""
    g = GGUFFile(demo_gguf)
    started = []
    experts = InProcessExperts(g)
    submit_ahead = experts.submit_ahead
    monkeypatch.setattr(experts, "submit_ahead", lambda *call: started.append(call[0]) or submit_ahead(*call))
    monkeypatch.setattr(ModelRunner, "from_gguf", _sending_ahead(ModelRunner.from_gguf))
    try:
        pipelined = run_steps(demo_gguf, experts, micro_batches=2)
    finally:
        experts.close()
    assert started  # every MoE layer call of the pipelined steps went ahead
    for a, b in zip(run_steps(demo_gguf, InProcessExperts(g), micro_batches=1), pipelined):
        assert (a - b).abs().max() <= 1e-4


def _sending_ahead(from_gguf):
    def build(*args, **kwargs):
        runner = from_gguf(*args, **kwargs)
        runner.model.send_ahead = runner.model.micro_batches > 1
        return runner
    return build


def assert_pipelined_close(path):
    g = GGUFFile(path)
    experts = ThreadedExperts(g, row_by_row=False)
    try:
        pipelined = run_steps(path, experts, micro_batches=2)
    finally:
        experts.close()
    for a, b in zip(run_steps(path, InProcessExperts(g), micro_batches=1), pipelined):
        assert (a - b).abs().max() <= 1e-4


def batch(lengths, per_token=None):
    seqs, row = [], 0
    for n in lengths:
        seqs.append(SeqSlice(row, row + n, torch.arange(100 * len(seqs), 100 * len(seqs) + n)))
        row += n
    ids = torch.arange(row)
    return StepBatch(token_ids=ids, positions=ids + 1000, new_slots=ids + 2000, seqs=tuple(seqs),
                     logits_rows=torch.tensor([s.end - 1 for s in seqs]),
                     experts_per_token=None if per_token is None else torch.tensor(per_token))


@pytest.mark.parametrize("lengths, cut", [([1] * 16, 8), ([1, 1, 1], 1), ([5, 1, 1, 1], 1), ([1, 1, 1, 9], 3),
                                          ([4, 4], 1), ([20, 1, 1], 1)])
def test_split_cuts_by_sequence_near_half_the_tokens(lengths, cut):
    b = batch(lengths, per_token=list(range(sum(lengths))))
    (first, rows0), (second, rows1) = b.split(2)
    assert len(first.seqs) == cut and len(second.seqs) == len(lengths) - cut
    assert rows0 == slice(0, first.num_tokens) and rows1 == slice(first.num_tokens, b.num_tokens)
    for part, rows in ((first, rows0), (second, rows1)):
        assert torch.equal(part.token_ids, b.token_ids[rows]) and torch.equal(part.new_slots, b.new_slots[rows])
        assert torch.equal(part.positions, b.positions[rows])
        assert torch.equal(part.experts_per_token, b.experts_per_token[rows])
        assert part.seqs[0].start == 0 and part.seqs[-1].end == part.num_tokens
    assert torch.equal(torch.cat([first.logits_rows, second.logits_rows + first.num_tokens]), b.logits_rows)
    assert b.split(1)[0][0] is b and batch([3]).split(2)[0][1] == slice(0, 3)


def test_micro_batches_setting():
    assert AttentionSettings(model_path="m.gguf").runner.micro_batches == RunnerOptions().micro_batches == 1
    for wrong in (0, 3):
        with pytest.raises(ValueError, match="micro_batches"):
            RunnerOptions(micro_batches=wrong)
    from splitmoe.cli import build_parser

    args = build_parser().parse_args(["serve-attention", "m.gguf", "--micro-batches", "2"])
    assert args.micro_batches == 2
