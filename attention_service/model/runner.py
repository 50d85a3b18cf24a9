"""Owns the loaded model and its KV cache; turns sequences into one forward step.

The one place that knows both the GGUF file and the device: `ModelRunner.from_gguf` builds
config, weights, expert backend and cache; `step` runs the new tokens of several sequences
together and returns their logits.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from splitmoe.attention_service.expert_backends.backend import ExpertBackend, InProcessExperts
from splitmoe.attention_service.gpu.graphs import SegmentGraphs
from splitmoe.attention_service.gpu.memory import DeviceMemory, device_memory, tensor_bytes
from splitmoe.attention_service.model.batch import SeqSlice, StepBatch
from splitmoe.attention_service.model.block_manager import BlockManager
from splitmoe.attention_service.model.kv_cache import KVCache
from splitmoe.attention_service.model.kv_formats import kv_format
from splitmoe.attention_service.model.lora import StepLora
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.attention_service.model.static_decode import DecodeRows, StaticDecode
from splitmoe.attention_service.model.transformer import MoETransformer
from splitmoe.attention_service.model.weights import load_weights
from splitmoe.kernels.expert_kernels import native_available
from splitmoe.kernels.linear import SMALL_BATCH_ROWS
from splitmoe.kernels.torch_threads import one_torch_thread
from splitmoe.modelfile.architectures import arch_spec
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.hparams import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RunnerOptions:
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: default_device())
    kv_cache_tokens: int = 4096
    kv_block_tokens: int = 16
    experts_per_token: int = 0  # 0: the model's own; else every request's default (fewer is faster)
    # 1: a step runs as one batch; 2: a step of several sequences is cut in two by sequence and
    # pipelined, attention of one half overlapping the (remote) experts of the other
    micro_batches: int = 1
    # Reuse the KV of full blocks whose tokens (and everything before them) an earlier request
    # computed (block_pool.py). Safe for every family here: each cache entry (k/v, MLA's latent and
    # rope key) is a function of its position's prefix alone, and sliding-window layers keep every
    # position's entry (the window is a mask when reading), so a block means the same in any sequence.
    prefix_caching: bool = True
    # Decode steps in fixed-shape segments between expert hops (model/static_decode.py): the GPU's
    # decode path. None: on wherever the device is not the CPU (tests also run it on the CPU).
    static_decode: bool | None = None
    # Those segments captured as CUDA graphs and replayed (gpu/graphs.py); only on CUDA.
    cuda_graphs: bool = True
    # How the KV cache stores its values (model/kv_formats.py): auto = as computed (dtype), or
    # bfloat16 / float32 / fp8_e4m3 / fp8_e5m2 / q8_0 (--kv-cache-dtype).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES.values():
            raise ValueError(f"dtype must be float32 or bfloat16, not {self.dtype}")
        if self.micro_batches not in (1, 2):
            raise ValueError(f"micro_batches must be 1 or 2, not {self.micro_batches}")
        kv_format(self.kv_cache_dtype, self.dtype)  # a name it does not know fails here
        if self.kv_cache_tokens < 1 or self.kv_block_tokens < 1:
            raise ValueError("kv_cache_tokens and kv_block_tokens must be >= 1")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: torch sees no CUDA GPU here (torch {torch.__version__}); "
                             "install the torch build for your CUDA, or leave --device out")


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" or "bfloat16": the name the CLI and the logs use."""
    return str(dtype).removeprefix("torch.")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ModelRunner:
    def __init__(self, g: GGUFFile, cfg: ModelConfig, model: MoETransformer, options: RunnerOptions):
        self.gguf, self.cfg, self.model, self.options = g, cfg, model, options
        num_blocks = -(-options.kv_cache_tokens // options.kv_block_tokens)
        fmt = kv_format(options.kv_cache_dtype, options.dtype)
        static = options.static_decode if options.static_decode is not None else options.device.type != "cpu"
        static = static and fmt.stores_as(options.dtype)  # its paged kernels read the cache as computed
        # The static decode's padded rows write their KV into one more block, which no sequence gets.
        self.kv = KVCache(cfg.num_layers, num_blocks + static, options.kv_block_tokens, model.kv_entry_shapes(),
                          options.dtype, options.device, fmt)
        self.blocks = BlockManager(num_blocks, options.kv_block_tokens, options.prefix_caching)
        self.static_decode = self._static_decode(num_blocks) if static else None
        self.weight_bytes = tensor_bytes(model.weights, options.device) if options.device.type != "cpu" else 0
        # Steps of at most this many rows run their matmuls, attention and experts in the native
        # pool (the fast path on the CPU, rows the int8 kernels take): torch only glues, on one
        # thread (kernels/torch_threads.py). 0: never (the exact float32 mode computes with torch).
        native_fast = options.device.type == "cpu" and options.dtype != torch.float32 and native_available()
        self._glue_only_rows = SMALL_BATCH_ROWS if native_fast else 0
        # Called after each step with (sequence, first new position, the new rows' final-normed
        # hidden states [n, D] float32): the MTP drafter's input (engine/mtp.py). None: not kept.
        self.hidden_sink: Callable[[Sequence, int, torch.Tensor], None] | None = None

    @classmethod
    def from_gguf(cls, model: str | os.PathLike | GGUFFile, options: RunnerOptions | None = None,
                  experts: ExpertBackend | None = None) -> "ModelRunner":
        options = options or RunnerOptions()
        g = model if isinstance(model, GGUFFile) else GGUFFile(model)
        spec = arch_spec(g.arch, g.path.name)
        cfg = spec.architecture.config(g)
        if options.experts_per_token:
            check_experts_per_token(options.experts_per_token, cfg)
            cfg = dataclasses.replace(cfg, num_experts_used=options.experts_per_token)
        weights = load_weights(g, spec, cfg, options.dtype, options.device)
        model = MoETransformer(cfg, spec, weights, experts or InProcessExperts(g), options.micro_batches)
        return cls(g, cfg, model, options)

    def step(self, seqs: list[Sequence], num_new_tokens: list[int] | None = None,
             all_logits: bool = False, logits_tokens: list[int] | None = None, commit: bool = True) -> torch.Tensor:
        """Run each sequence's next `num_new_tokens` uncached tokens (default: all of them).

        Returns float32 logits: of every new token if `all_logits`, else of each sequence's last
        `logits_tokens[i]` tokens (default 1), in sequence order. `commit=False`: the caller names
        the filled blocks itself (`commit`), once it has cut rejected draft tokens off.
        """
        if num_new_tokens is None:
            num_new_tokens = [s.num_tokens - s.num_cached_tokens for s in seqs]
        logits = None
        sink = None if all_logits else self.hidden_sink  # scoring a prompt (echo) drafts nothing after it
        self.model.keep_hidden = sink is not None
        if self.static_decode is not None and sink is None and all(n == 1 == s.num_tokens - s.num_cached_tokens
                                                  and s.lora is None for s, n in zip(seqs, num_new_tokens)):
            logits = self._static_step(seqs)
        if logits is None:
            batch = self._build_batch(seqs, num_new_tokens, all_logits, logits_tokens)
            with one_torch_thread() if batch.num_tokens <= self._glue_only_rows else contextlib.nullcontext():
                logits = self.model.forward(batch, self.kv)
            if sink is not None:
                self._hand_hidden(sink, seqs, num_new_tokens)
        for s, n in zip(seqs, num_new_tokens):
            s.num_cached_tokens += n
            if commit:
                self.blocks.commit(s)  # only now: a step that fails must leave no named block behind
        return logits

    def _hand_hidden(self, sink: Callable[[Sequence, int, torch.Tensor], None], seqs: list[Sequence],
                     num_new_tokens: list[int]) -> None:
        hidden, row = self.model.last_hidden, 0
        self.model.last_hidden = None
        for s, n in zip(seqs, num_new_tokens):
            sink(s, s.num_cached_tokens, hidden[row:row + n])
            row += n

    def commit(self, seq: Sequence) -> None:
        """Name the blocks `seq`'s computed tokens filled (after a step run with commit=False)."""
        self.blocks.commit(seq)

    def release(self, seq: Sequence) -> None:
        self.blocks.free(seq.seq_id)

    def device_memory(self) -> DeviceMemory | None:
        """What the attention device holds, by use (gpu/memory.py); None on the CPU."""
        if self.options.device.type == "cpu":
            return None
        gpu_experts_bytes, pinned_bytes = self.model.experts.device_bytes()
        graphs = self.static_decode.graphs if self.static_decode is not None else None
        return device_memory(self.options.device, weights_bytes=self.weight_bytes, kv_cache_bytes=self.kv.reserved_bytes,
                             gpu_experts_bytes=gpu_experts_bytes, graphs_bytes=graphs.num_bytes if graphs else 0,
                             pinned_host_bytes=pinned_bytes)

    def _static_decode(self, num_blocks: int) -> StaticDecode:
        o = self.options
        graphs = SegmentGraphs(o.device) if o.cuda_graphs and o.device.type == "cuda" else None
        return StaticDecode(self.model, self.kv, scratch_slot=num_blocks * o.kv_block_tokens, graphs=graphs,
                            device_layers=self.model.experts.device_layers(),
                            max_context_tokens=num_blocks * o.kv_block_tokens)

    def _static_step(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """A decode step (one new token each) through `static_decode` when it takes it (the
        model's own experts per token, a bucket that fits); None otherwise."""
        if any(s.num_experts_per_token not in (0, self.cfg.num_experts_used) for s in seqs) \
                or not self.static_decode.accepts(len(seqs), max(s.num_tokens for s in seqs)):
            return None
        contexts = []
        for s in seqs:
            self.blocks.reserve(s.seq_id, s.num_tokens)
            contexts.append(self.blocks.slots(s.seq_id, 0, s.num_tokens))
        return self.static_decode.run(DecodeRows([s.token_ids[-1] for s in seqs], contexts))

    def _build_batch(self, seqs: list[Sequence], num_new_tokens: list[int], all_logits: bool,
                     logits_tokens: list[int] | None = None) -> StepBatch:
        ids, positions, new_slots, slices, logits_rows, experts = [], [], [], [], [], []
        row = 0
        for i, (s, n) in enumerate(zip(seqs, num_new_tokens)):
            start, end = s.num_cached_tokens, s.num_cached_tokens + n
            if n <= 0 or end > s.num_tokens:
                raise ValueError(f"sequence {s.seq_id}: cannot run tokens {start}..{end} of {s.num_tokens}")
            self.blocks.reserve(s.seq_id, end)
            context = self.blocks.slots(s.seq_id, 0, end)
            ids.extend(s.token_ids[start:end])
            positions.append(torch.arange(start, end))
            new_slots.append(context[start:])
            slices.append(SeqSlice(row, row + n, context.to(self.options.device)))
            last = n if all_logits else min(logits_tokens[i], n) if logits_tokens else 1
            logits_rows.extend(range(row + n - last, row + n))
            experts.extend([s.num_experts_per_token or self.cfg.num_experts_used] * n)
            row += n
        dev = self.options.device
        return StepBatch(
            token_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.cat(positions).to(dev),
            new_slots=torch.cat(new_slots).to(dev),
            seqs=tuple(slices),
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            experts_per_token=self._experts_per_token(seqs, experts),
            verification=any(n > 1 for n in logits_tokens or ()) and not all_logits,
            lora=StepLora.of_rows([s.lora for s, n in zip(seqs, num_new_tokens) for _ in range(n)]),
        )

    def _experts_per_token(self, seqs: list[Sequence], per_token: list[int]) -> torch.Tensor | None:
        if all(s.num_experts_per_token in (0, self.cfg.num_experts_used) for s in seqs):
            return None
        for s in seqs:
            check_experts_per_token(s.num_experts_per_token or self.cfg.num_experts_used, self.cfg)
        return torch.tensor(per_token, dtype=torch.long, device=self.options.device)


def check_experts_per_token(k: int, cfg: ModelConfig) -> None:
    if not 1 <= k <= cfg.num_experts:
        raise ValueError(f"experts per token must lie in [1, {cfg.num_experts}], got {k}")
