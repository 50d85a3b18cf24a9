"""Linear layers over weights kept as the GGUF stores them: the attention service's fast mode.

A weight is either a dense torch tensor (float32 mode, F32/F16/BF16 tensors, non-CPU devices) or
a `QuantLinear`: the file's blocks (a read-only view of the mmap, no copy) computed on at call
time. `linear(x, w, bias)` dispatches on which:

* few rows (<= SMALL_BATCH_ROWS, decode): the native int8 kernel `kernels.native.matmul`, which
  reads each weight byte once and quantizes the activations to int8 per block as ggml does (the
  attention projections in two int8 terms in steps of one sequence: `single_sequence_step`);
* many rows (prefill): the weight is dequantized in row chunks into a reused per-thread scratch
  buffer and multiplied by torch's GEMM in `kernels.cpu_features.gemm_dtype()`: bfloat16 where
  the CPU computes it natively (AVX512-BF16, AMX), float32 elsewhere (a bfloat16 GEMM without
  hardware support is 2-3x slower than float32). The chunks keep the scratch small; no dense
  copy is ever kept.
* no native kernel for the type (or no native library at all): a dense copy in the model's dtype
  is made once at load, exactly what the bfloat16 mode did before quantized linears existed, so
  falling back never costs more memory or time than that.

A quantized linear returns float32 (the native kernel's output): callers round where they store.
`QuantEmbedding` is the token embedding's counterpart: only the looked-up rows are dequantized.
"""
from __future__ import annotations

import logging
import threading

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from splitmoe.kernels.cpu_features import gemm_dtype
from splitmoe.kernels.quants import QuantTensor, dequantize
from splitmoe.kernels.scratch import scratch_buffer

log = logging.getLogger("splitmoe.kernels")

# Up to this many rows go through the native int8 kernel, more through dequantize + GEMM.
# Measured on the benchmark model's Q4_K projections (Skylake-SP, AVX-512BW without VNNI, one
# thread): the int8 kernel costs ~0.4 ms per row of a 4096x2048 weight beyond the first few,
# dequantize + float32 GEMM ~12 ms + 0.3 ms per row, so the int8 kernel stays faster up to
# ~64-96 rows here (more with VNNI). The threshold is lower on purpose: rows past a decode batch
# are prompt tokens, and the GEMM route computes them on the exact weights without rounding the
# activations to int8 (whose ~1% per-product error flips near-tied expert choices: see
# tests/attention_service/model/test_fixtures.py). 17-64-row decode batches pay up to ~1.5x for that.
SMALL_BATCH_ROWS = 16
# Elements dequantized per chunk on the GEMM route (a reused scratch per thread, 32 MiB in bfloat16).
# A weight of up to this many values is one GEMM, a layer's q, k and v together one as well
# (`LinearGroup`): with 2M values a chunk, a 512-token prompt's projections paid ~0.7 ms a weight for
# the split (the chunks' GEMMs and their strided copies out), 5-7% of each, on 2 Zen 5 cores.
CHUNK_ELEMS = 1 << 24

DENSE_TYPES = frozenset({int(T.F32), int(T.F16), int(T.BF16)})

_UNSET = object()
_native_module = _UNSET


class _Step(threading.local):
    single = False


_step = _Step()


def single_sequence_step(single: bool) -> None:
    """Tell this thread's quantized linears whether the step they compute has one sequence (a decode
    token, or a stream's speculative verification rows): then the attention projections' int8 rows
    take two terms, as the native attention front does for such steps, so a verification row computes
    as a decode step and both as close to the exact weights as the prompt path. Steps of several
    sequences keep one term: batched decode pays the second term most (+25% at 4 rows, +60% at 16)."""
    _step.single = single
_warned_types: set[int] = set()


def native():
    """kernels.native when its library loaded, else None (imported on first use, never raising)."""
    global _native_module
    if _native_module is _UNSET:
        try:
            from splitmoe.kernels import native as module
        except Exception as e:  # noqa: BLE001 - a broken native module must not stop serving
            log.warning("kernels.native cannot be imported, using the torch fallback: %s", e)
            module = None
        _native_module = module if module is not None and module.AVAILABLE else None
    return _native_module


def is_block_quantized(ggml_type: int) -> bool:
    return int(ggml_type) not in DENSE_TYPES


def _scratch_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The many-rows route's dequantized weights (up to a chunk, or a q/k/v group): no size limit."""
    return scratch_buffer(f"linear {dtype}", (numel,), dtype, max_bytes=None)


class QuantLinear:
    """A 2-D [out_features, in_features] weight kept quantized, with its routes (module doc)."""

    def __init__(self, qt: QuantTensor, dtype: torch.dtype = torch.bfloat16, residual: bool = False):
        """residual: the attention projections, whose activation rounding moves routing near-ties
        downstream: in a step of one sequence (`single_sequence_step`) their rows go to the int8 kernel
        in two terms (`native.WeightMatmul`'s residual)."""
        if len(qt.shape) != 2:
            raise ValueError(f"tensor {qt.name!r}: a linear weight must be 2-D, not {list(qt.shape)}")
        if not is_block_quantized(qt.ggml_type):
            raise ValueError(f"tensor {qt.name!r}: {qt.type_name} is dense, load it as a tensor")
        self.qt = qt
        self.shape = torch.Size(qt.shape)
        self.dtype = dtype  # the model's; what a fallback dense copy is stored in
        self.device = torch.device("cpu")
        nat = native()
        self._native = nat if nat is not None and nat.supports(qt.ggml_type) else None
        self._native_dequantize = self._native is not None and _can_dequantize(nat, qt)
        # the int8 kernels' view of the weight: packed by 16 rows where this CPU has the faster tiles
        # for that (one copy, shared by this linear, its fused group and the native decode layer)
        self.kernel = nat.kernel_weight(qt, pack=True) if self._native is not None else None
        self.residual = residual
        self._matmul = nat.WeightMatmul(self.kernel) if self._native is not None else None
        self._chunks = self._row_chunks() if self._native is not None else []
        # Only when no native kernel covers this type: the dense copy the fallback computes with.
        self.dense = None
        if self._native is None:
            if nat is not None and qt.ggml_type not in _warned_types:
                _warned_types.add(qt.ggml_type)
                log.warning("no native matmul for %s: its weights (%s, ...) are kept as dense %s copies",
                            qt.type_name, qt.name, str(dtype).removeprefix("torch."))
            self.dense = dequantize(qt).to(dtype)

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def route(self) -> str:
        """"native" (int8 kernel for few rows, dequantize + GEMM for many) or "dense" (fallback)."""
        return "dense" if self.dense is not None else "native"

    @property
    def nbytes(self) -> int:
        return self.qt.num_bytes if self.dense is None else self.dense.numel() * self.dense.element_size()

    def __repr__(self) -> str:
        return f"QuantLinear({self.qt.name!r}, {self.qt.type_name}, {list(self.shape)}, route={self.route})"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in_features] (any float dtype) -> float32 [..., out_features]."""
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        m = x2.shape[0]
        if self.dense is not None:
            y = F.linear(x2.to(self.dense.dtype), self.dense).float()
        elif m <= SMALL_BATCH_ROWS:
            if x2.dtype != torch.float32 or not x2.is_contiguous():
                x2 = x2.float().contiguous()
            y = self._matmul(x2, residual=self.residual and _step.single)
        else:
            y = self._dequantize_gemm(x2)
        if bias is not None:
            y += bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.shape[0])

    def _dequantize_gemm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = gemm_dtype()
        x = x.to(dtype)
        k = self.shape[1]
        if len(self._chunks) == 1:
            return _stacked_gemm(x, (self,), dtype)
        out = torch.empty(x.shape[0], self.shape[0], dtype=torch.float32)
        for start, end, part in self._chunks:
            w = _scratch_buffer((end - start) * k, dtype).view(end - start, k)
            if self._native_dequantize:
                self._native.dequantize(part, dtype=dtype, out=w)
            else:
                w.copy_(dequantize(part))
            out[:, start:end] = torch.mm(x, w.t())
        return out

    def dequantize_into(self, w: torch.Tensor, dtype: torch.dtype) -> None:
        """The whole weight's values into w ([out_features, in_features] of `dtype`)."""
        if self._native_dequantize:
            self._native.dequantize(self.qt, dtype=dtype, out=w)
        else:
            w.copy_(dequantize(self.qt))

    def _row_chunks(self) -> list[tuple[int, int, QuantTensor]]:
        """(first row, end row, those rows as a QuantTensor view) of at most CHUNK_ELEMS values each."""
        n, k = self.shape
        rows = max(1, CHUNK_ELEMS // k)
        q = self.qt
        bounds = [(a, min(n, a + rows)) for a in range(0, n, rows)]
        return [(a, b, QuantTensor(q.name, q.ggml_type, (b - a, k), q.data[a:b])) for a, b in bounds]


def _can_dequantize(nat, qt: QuantTensor) -> bool:
    try:
        nat.dequantize(qt, rows=torch.zeros(1, dtype=torch.long))
    except ValueError:
        return False
    return True


def _quantized(self, qt: QuantTensor, dtype: torch.dtype, rank: int, what: str) -> None:
    """The attributes QuantHeads and QuantEmbedding share, after checking qt's rank."""
    if len(qt.shape) != rank:
        raise ValueError(f"tensor {qt.name!r}: {what} must be {rank}-D, not {list(qt.shape)}")
    self.qt = qt
    self.shape = torch.Size(qt.shape)
    self.dtype = dtype
    self.device = torch.device("cpu")


class QuantHeads:
    """A stack of per-head maps [H, rows, k] (MLA's attn_k_b and attn_v_b), each head applied to its own
    slice of x [T, H, k] -> float32 [T, H, rows]. Few rows (decode) take the native int8 kernel (each head
    packed by 16 rows where the ISA packs the type), every head in the native pool: torch's batched
    product over the dense bfloat16 copy read twice the bytes on one thread (2.1 ms a layer for the
    DeepSeek-V3 shape's two maps, against 0.57). Many rows (prompts) compute on the dense copy, the exact
    weights, as QuantLinear's GEMM route does."""

    def __init__(self, qt: QuantTensor, dtype: torch.dtype = torch.bfloat16):
        _quantized(self, qt, dtype, 3, "per-head maps")
        nat = native()
        self._native = nat.HeadsMatmul(qt) if nat is not None and nat.supports(qt.ggml_type) else None
        self.dense = dequantize(qt).to(dtype)

    def __repr__(self) -> str:
        return f"QuantHeads({self.qt.name!r}, {self.qt.type_name}, {list(self.shape)})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._native is not None and x.shape[0] <= SMALL_BATCH_ROWS:
            return self._native(x)
        return torch.einsum("thk,hrk->thr", x.to(self.dtype), self.dense).float()


class QuantEmbedding:
    """A token embedding [vocab, hidden] kept quantized: `emb[ids]` dequantizes only those rows.

    `dtype` is the model's compute dtype (what the transformer runs its activations in); rows come
    back float32, the exact dequantized values.
    """

    def __init__(self, qt: QuantTensor, dtype: torch.dtype = torch.bfloat16):
        _quantized(self, qt, dtype, 2, "an embedding")
        nat = native()
        self._native = None
        if nat is not None:
            try:
                self._native = nat.RowLookup(qt)
            except ValueError:  # a type the native dequantization lacks: the torch path
                pass

    def __repr__(self) -> str:
        return f"QuantEmbedding({self.qt.name!r}, {self.qt.type_name}, {list(self.shape)})"

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long)
        flat = ids.reshape(-1).cpu().contiguous()
        if flat.numel() <= 64:  # a decode step's few ids, checked in Python: two reductions cost more than the row
            values = flat.tolist()
            low, high = (min(values), max(values)) if values else (0, 0)
        else:
            low, high = int(flat.min()), int(flat.max())
        if low < 0 or high >= self.shape[0]:
            raise IndexError(f"token id out of range for {self.qt.name!r} with {self.shape[0]} rows")
        if self._native is not None:
            rows = self._native(flat)
        else:
            q = self.qt
            picked = q.data[flat.numpy()]  # copies just those rows' blocks
            rows = dequantize(QuantTensor(q.name, q.ggml_type, (flat.numel(), self.shape[1]), picked))
        return rows.view(*ids.shape, self.shape[1])


LinearWeight = torch.Tensor | QuantLinear  # what `linear` takes: a dense tensor or the file's blocks


class LinearGroup:
    """Several linears of the same input (a layer's q, k and v; an FFN's gate and up).

    Few rows against weights the native kernel covers are one call: the activations quantized once
    and every weight's rows in one work list, results side by side in one buffer (returned as
    views). Otherwise each linear takes its own route, exactly as `linear` alone would.
    """

    def __init__(self, *weights: LinearWeight):
        self.weights = weights
        nat = native()
        fusable = len(weights) > 1 and all(isinstance(w, QuantLinear) and w.route == "native" for w in weights) \
            and len({w.in_features for w in weights}) == 1
        self._residual = fusable and all(w.residual for w in weights)
        self._fused = nat.WeightMatmul(*(w.kernel for w in weights)) if fusable else None
        # Many rows: one dequantized [sum of rows, in] matrix and one GEMM where it fits a chunk
        self._one_gemm = fusable and sum(w.out_features for w in weights) * weights[0].in_features <= CHUNK_ELEMS

    def __call__(self, x: torch.Tensor, biases: tuple[torch.Tensor | None, ...] | None = None) -> tuple[torch.Tensor, ...]:
        biases = biases or (None,) * len(self.weights)
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if self._fused is None or (x2.shape[0] > SMALL_BATCH_ROWS and not self._one_gemm):
            return tuple(linear(x, w, b) for w, b in zip(self.weights, biases))
        if x2.shape[0] > SMALL_BATCH_ROWS:
            parts = self._dequantize_gemm(x2)
        else:
            if x2.dtype != torch.float32 or not x2.is_contiguous():
                x2 = x2.float().contiguous()
            parts = self._fused(x2, residual=self._residual and _step.single).split(self._fused.sizes, dim=1)
        out = []
        for part, b in zip(parts, biases):
            if b is not None:
                part += b
            out.append(part if x.dim() == 2 else part.reshape(*x.shape[:-1], part.shape[1]))
        return tuple(out)

    def _dequantize_gemm(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The many-rows route of every weight at once: their values stacked, one GEMM (as each alone)."""
        return _stacked_gemm(x, self.weights, gemm_dtype()).split(self._fused.sizes, dim=1)


def _stacked_gemm(x: torch.Tensor, linears: tuple[QuantLinear, ...], dtype: torch.dtype) -> torch.Tensor:
    """float32 [m, sum of their rows]: the linears' values dequantized one under the other into the
    scratch buffer, one GEMM in `dtype` (the many-rows route of a weight that fits a chunk, or of a group)."""
    k = linears[0].in_features
    w = _scratch_buffer(sum(lin.out_features for lin in linears) * k, dtype).view(-1, k)
    start = 0
    for lin in linears:
        lin.dequantize_into(w[start:start + lin.out_features], dtype)
        start += lin.out_features
    return torch.mm(x.to(dtype), w.t()).float()


def linear(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight.T (+ bias): torch for a dense weight (in its dtype), else QuantLinear's
    routes (float32 out)."""
    if isinstance(weight, torch.Tensor):
        if x.dtype != weight.dtype:
            x = x.to(weight.dtype)
        if bias is not None and bias.dtype != weight.dtype:
            bias = bias.to(weight.dtype)
        return F.linear(x, weight, bias)
    return weight(x, bias)
