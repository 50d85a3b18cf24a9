"""The routed experts' fast path: `kernels.moe`'s interface for bfloat16 / float16 hidden states.

Each call splits the layer's routed slots by how many tokens each expert got:

* few tokens (decode): the native kernels' `MoELayer` (int8 dot products straight from the GGUF
  blocks, one native call for all those experts); without the native library, or for a type it
  lacks, Q4_0/Q4_1/Q4_K experts run torch's int4 kernel on weights repacked at load
  (`kernels.int4pack`), and other types dequantize per call like prefill.
* many tokens (prefill): each active expert is dequantized once to the compute dtype (natively
  when possible), gate and up in one [2*ffn, D] matrix, one GEMM for both, the activation in
  float32, the down GEMM, and a weighted index_add.

The compute dtype of the prefill GEMMs is `kernels.cpu_features.gemm_dtype()`: bfloat16 where the
CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX), else float32 (emulated bfloat16 GEMMs are
2-3x slower than float32); SPLITMOE_GEMM_DTYPE forces either.
Accumulation and the output sum are float32; the result is returned in `hidden.dtype`.

`ExpertCompute` (below) is where a call chooses: float32 hidden states take the exact reference
path (`kernels.moe.moe_forward`), bfloat16 / float16 ones the fast path, built once per set of
hosted experts. Both services compute through it (the expert service's shard, and the attention
side's in-process, local and hot experts), so the choice lives here, beside the kernels, not in
the file reader (`modelfile.expert_tensors.ExpertShard` builds on it) nor in one service. Rows with
a LoRA adapter (`lora=`) are computed by `kernels.expert_lora`, the other rows as without.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

import torch
from gguf import GGMLQuantizationType as T

from splitmoe.kernels.cpu_features import gemm_dtype
from splitmoe.kernels.int4pack import Int4Expert, can_repack
from splitmoe.kernels.moe import ACTIVATIONS, ExpertFFN, group_by_expert, moe_forward
from splitmoe.kernels.quants import QuantTensor
from splitmoe.kernels.quants import dequantize as ref_dequantize
from splitmoe.kernels.repack_cache import RepackCache, load_or_repack
from splitmoe.kernels.scratch import scratch_buffer
from splitmoe.kernels.torch_threads import configured_threads

try:
    from splitmoe.kernels import native
except ImportError as e:  # the module itself missing: treat as a library that did not build
    native = None
    _NATIVE_IMPORT_ERROR = f"kernels.native not importable: {e}"
else:
    _NATIVE_IMPORT_ERROR = None

if TYPE_CHECKING:  # expert_lora builds on this module: imported where used
    from splitmoe.kernels.expert_lora import AdaptedExperts, LoraRows

log = logging.getLogger("splitmoe.kernels")

# Tokens per expert up to which the decode routes beat dequantize-once + GEMM (per expert).
# Measured on a Qwen3-30B-A3B Q4_K_M layer (gate/up Q4_K, down Q6_K) on 2 Skylake-SP cores
# (AVX-512BW, no VNNI, float32 GEMM): native MoELayer ~0.2 ms/token vs dequantize (~12 ms)
# + GEMM, crossover 130-380 tokens (shared, noisy machine). Where bfloat16 GEMMs are native
# (AMX / AVX512-BF16) the GEMM is several times faster, so prefill takes over much earlier:
# that value is an estimate, not a measurement.
NATIVE_MAX_TOKENS = {torch.float32: 160, torch.bfloat16: 48}
# The 1-, 2- and 3-bit IQ formats look up a grid entry per 8 weights, which the int8 kernel pays again for
# every tile of tokens (16, IQ1_S/IQ1_M 8), so native dequantization + GEMM overtakes it sooner where
# GEMMs run in float32 (about 96-128 tokens): a layer hosting such weights caps its default threshold
# there. With the bfloat16 GEMM the crossover is 56-64 tokens (one AMD EPYC Zen 5 core, AVX-512 VNNI and
# BF16, a 768x2048 matrix; IQ1_S first), past the default above: no cap.
GRID_IQ_TYPES = frozenset(int(t) for t in (T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S))
GRID_IQ_MAX_TOKENS = {torch.float32: 96}
# Experts packed by 16 rows (kernels/csrc/repack.cpp, AVX-512) run the int8 tiles at twice the in-place
# rate, linear in the tokens: a layer whose experts are all packed keeps the native route up to where
# native dequantization + the bfloat16 GEMM catches up. Measured on 2 AMD EPYC Zen 5 cores (AVX-512
# VNNI and BF16), a 768x2048 matrix, native against dequantize + GEMM: Q4_K 1.76 / 2.28 ms at 512
# tokens, 4.1 / 4.1 at 1024, 6.7 / 7.4 at 2048; Q6_K 2.18 / 2.86, 3.9 / 4.4, 8.3 / 7.9; MXFP4 and Q8_0
# level at 1024. A prompt of random tokens sends up to ~420 of its 512 tokens to one expert in the
# deeper layers of the 24-layer Qwen3-30B-A3B shape: at 256 those experts took the slower route
# (24 layers' experts 1200 -> 968 ms a prompt, the prefill 210 -> 245 tok/s).
PACKED_MAX_TOKENS = 1024
# Pure-torch fallback: torch's int4 kernel vs dequantizing with kernels.quants (slow) + GEMM.
INT4_MAX_TOKENS = 256


def native_available() -> bool:
    return native is not None and bool(native.AVAILABLE)


def native_unavailable_reason() -> str | None:
    if native is None:
        return _NATIVE_IMPORT_ERROR
    return None if native.AVAILABLE else native.UNAVAILABLE_REASON


def native_supports(ffn: ExpertFFN) -> bool:
    """Whether the native MoELayer can compute this expert."""
    return native_available() and ffn.activation in ACTIVATIONS and all(
        native.supports(w.ggml_type) and len(w.shape) == 2 for w in (ffn.gate, ffn.up, ffn.down))


def sync_native_threads() -> None:
    """The native pool as wide as torch's intra-op pool (which `--threads` sets)."""
    threads = configured_threads()  # not 1 inside a step that narrowed torch (kernels/torch_threads.py)
    if native_available() and native.get_num_threads() != threads:
        native.set_num_threads(threads)


def dequantize(w: QuantTensor, dtype: torch.dtype, out: torch.Tensor | None = None,
               use_native: bool = True) -> torch.Tensor:
    """w's values in `dtype` (float32 or bfloat16), natively when the library can."""
    if use_native and native_available() and dtype in (torch.float32, torch.bfloat16):
        try:
            return native.dequantize(w, dtype, out=out)
        except ValueError:  # a type it lacks: the torch reference below
            pass
    values = ref_dequantize(w).to(dtype)
    if out is None:
        return values
    return out.copy_(values)


class FastMoELayer:
    """One MoE layer's hosted experts on the fast path (see the module docstring).

    `int4`: repacked experts for the torch decode route (only used where native cannot run
    the expert). `use_native=False` forces the pure-torch routes (tests, benchmarks).
    """

    def __init__(self, ffns: Mapping[int, ExpertFFN], num_experts: int, *,
                 int4: Mapping[int, Int4Expert] | None = None, use_native: bool = True,
                 native_max_tokens: int | None = None, int4_max_tokens: int = INT4_MAX_TOKENS,
                 compute_dtype: torch.dtype | None = None):
        self.num_experts = int(num_experts)
        self.ffns = dict(ffns)
        bad = [e for e in self.ffns if not 0 <= e < self.num_experts]
        if bad:
            raise ValueError(f"expert ids {bad} outside [0, {self.num_experts})")
        self.compute_dtype = compute_dtype or gemm_dtype()
        explicit_max = native_max_tokens is not None
        if native_max_tokens is None:
            native_max_tokens = NATIVE_MAX_TOKENS.get(self.compute_dtype, NATIVE_MAX_TOKENS[torch.float32])
            if any(int(w.ggml_type) in GRID_IQ_TYPES for f in self.ffns.values() for w in (f.gate, f.up, f.down)):
                native_max_tokens = min(native_max_tokens, GRID_IQ_MAX_TOKENS.get(self.compute_dtype, native_max_tokens))
        self.int4_max_tokens = int4_max_tokens
        native_experts = {e: f for e, f in self.ffns.items() if use_native and native_supports(f)}
        self._native = native.MoELayer(native_experts, self.num_experts) if native_experts else None
        if not explicit_max and self._native is not None and self._native.all_packed:
            native_max_tokens = max(native_max_tokens, PACKED_MAX_TOKENS)
        self.native_max_tokens = native_max_tokens
        self._native_dequantize = use_native and native_available()
        self.int4 = {e: w for e, w in (int4 or {}).items() if e in self.ffns and e not in native_experts}
        # Per expert id: 0 not hosted, 1 native, 2 int4, 3 dense only.
        route = torch.zeros(self.num_experts + 1, dtype=torch.int8)  # the extra last entry: id -1
        for e in self.ffns:
            route[e] = 1 if e in native_experts else 2 if e in self.int4 else 3
        self._route = route
        self._all_native = self._native is not None and len(native_experts) == len(self.ffns)
        self._biases = {e: _fused_biases(f) for e, f in self.ffns.items()}

    @property
    def native_experts(self) -> int:
        return int((self._route == 1).sum())

    def native_layer(self) -> "native.MoELayer | None":
        """The native layer when every hosted expert has a native kernel, else None: what a native
        caller may run for calls of at most `native_max_tokens` tokens, as `forward` does."""
        return self._native if self._all_native else None

    def forward(self, hidden: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        """The weighted sum over hosted experts, [T, D] in hidden.dtype; other ids add nothing."""
        num_tokens, top_k = expert_ids.shape
        out = torch.zeros(hidden.shape, dtype=torch.float32)
        if num_tokens == 0 or top_k == 0 or not self.ffns:
            return out.to(hidden.dtype)
        if self._all_native and num_tokens <= self.native_max_tokens:
            # Decode: no expert can have more slots than there are tokens (a token's top-k ids
            # are distinct), so every slot is the native call's; it skips ids it does not host.
            # The routing below costs ~0.5 ms of small torch ops per call, a sixth of a layer.
            self._native.forward(hidden.float(), expert_ids, expert_weights.float(), out=out)
            return out.to(hidden.dtype)
        flat = expert_ids.reshape(-1).long()
        valid = (flat >= 0) & (flat < self.num_experts)
        flat = torch.where(valid, flat, torch.full_like(flat, -1))
        route = self._route[flat].long()  # -1 indexes the extra "not hosted" entry
        counts = torch.bincount(flat + 1, minlength=self.num_experts + 1)[flat + 1]  # slots of each slot's expert
        # Native slots: one call for every decode-sized native expert.
        native_slot = (route == 1) & (counts <= self.native_max_tokens)
        if bool(native_slot.any()):
            ids = torch.where(native_slot, flat, torch.full_like(flat, -1)).view(num_tokens, top_k)
            self._native.forward(hidden.float().contiguous(), ids, expert_weights.float().contiguous(), out=out)
        torch_slot = (route > 0) & ~native_slot
        if bool(torch_slot.any()):
            self._torch_experts(hidden, torch.where(torch_slot, flat, torch.full_like(flat, -1)),
                                expert_weights, top_k, out)
        return out.to(hidden.dtype)

    __call__ = forward

    def _torch_experts(self, hidden: torch.Tensor, flat: torch.Tensor, expert_weights: torch.Tensor,
                       top_k: int, out: torch.Tensor) -> None:
        present, counts, order = group_by_expert(flat)
        token_of_slot = order // top_k
        slot_weights = expert_weights.reshape(-1).float()[order]
        x_int4 = x_dense = None
        start = 0
        for expert, count in zip(present.tolist(), counts.tolist()):
            end = start + count
            if expert >= 0:
                tokens = token_of_slot[start:end]
                packed = self.int4.get(expert)
                if packed is not None and count <= self.int4_max_tokens:
                    if x_int4 is None:
                        x_int4 = hidden.to(torch.bfloat16)
                    y = self._int4_ffn(x_int4[tokens], expert, packed)
                else:
                    if x_dense is None:
                        x_dense = hidden.to(self.compute_dtype)
                    y = self._dense_ffn(x_dense[tokens], expert)
                out.index_add_(0, tokens, y * slot_weights[start:end, None])
            start = end

    def _int4_ffn(self, x: torch.Tensor, expert: int, packed: Int4Expert) -> torch.Tensor:
        ffn = self.ffns[expert]
        gate_up_bias, down_bias = self._biases[expert]
        a = self._activation(packed.gate_up.matmul(x), ffn, gate_up_bias)
        if packed.down is not None:
            y = packed.down.matmul(a).float()
        else:
            y = (a.to(self.compute_dtype) @ self._dequantize(ffn.down, "down").T).float()
        return y if down_bias is None else y + down_bias

    def _dense_ffn(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        ffn = self.ffns[expert]
        gate_up_bias, down_bias = self._biases[expert]
        f = ffn.gate.shape[0]
        w = scratch_buffer("gate_up", (2 * f, ffn.gate.shape[1]), self.compute_dtype)
        self._dequantize(ffn.gate, out=w[:f])
        self._dequantize(ffn.up, out=w[f:])
        a = self._activation(x @ w.T, ffn, gate_up_bias)
        y = (a.to(self.compute_dtype) @ self._dequantize(ffn.down, "down").T).float()
        return y if down_bias is None else y + down_bias

    def _dequantize(self, w: QuantTensor, scratch: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = scratch_buffer(scratch, w.shape, self.compute_dtype)
        return dequantize(w, self.compute_dtype, out=out, use_native=self._native_dequantize)

    @staticmethod
    def _activation(h: torch.Tensor, ffn: ExpertFFN, gate_up_bias: torch.Tensor | None) -> torch.Tensor:
        """act(gate, up) in float32 from the fused [n, 2*ffn] product."""
        h = h.float()
        if gate_up_bias is not None:
            h = h + gate_up_bias
        f = h.shape[1] // 2
        return ACTIVATIONS[ffn.activation](h[:, :f], h[:, f:])


def _fused_biases(ffn: ExpertFFN) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(gate and up biases as one float32 [2*ffn], or None; down bias float32, or None)."""
    f = ffn.gate.shape[0]
    gate_up = None
    if ffn.gate_bias is not None or ffn.up_bias is not None:
        zeros = torch.zeros(f, dtype=torch.float32)
        gate_up = torch.cat([zeros if b is None else b.float().reshape(f) for b in (ffn.gate_bias, ffn.up_bias)])
    down = None if ffn.down_bias is None else ffn.down_bias.float().contiguous()
    return gate_up, down


# ---- the choice per call: reference or fast path -------------------------------------------------

FAST_DTYPES = (torch.bfloat16, torch.float16)
# (layer, its experts to repack) -> the identity of their bytes in the repack cache (the file's to say)
RepackIdentity = Callable[[int, Iterable[int]], str]


class ExpertCompute:
    """The expert FFN over hosted (layer, expert) pairs: exact float32, or the fast path.

    `ffns`: layer -> expert -> its `ExpertFFN` (views of a file: nothing read until used);
    `repack_identity` and `model_name` key the int4 repack cache, used only without native kernels.
    """

    def __init__(self, ffns: Mapping[int, Mapping[int, ExpertFFN]], num_experts: int,
                 repack_identity: RepackIdentity, model_name: str, repack_cache: RepackCache | None = None):
        self._ffns = ffns
        self.num_experts = num_experts
        self._repack_identity, self._model_name, self.repack_cache = repack_identity, model_name, repack_cache
        self._fast: dict[int, FastMoELayer] | None = None
        self._fast_lock = threading.Lock()
        self._adapted: dict[int, AdaptedExperts] = {}  # per layer, made at its first adapted row

    def prepare_fast(self, progress: bool | None = None) -> dict[int, FastMoELayer]:
        """Build the fast path of every hosted layer now (once; later calls return it).

        `progress`: the int4 repack's progress bar on stderr (None: when stderr is a terminal).
        """
        fast = self._fast
        if fast is None:
            with self._fast_lock:
                if self._fast is None:
                    self._fast = build_fast_layers(self._ffns, self.num_experts, self._repack_identity,
                                                   self._model_name, cache=self.repack_cache, progress=progress)
                fast = self._fast
        return fast

    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                lora: LoraRows | None = None) -> torch.Tensor:
        """The hosted experts' part of the layer's expert sum; ids not hosted here add nothing.

        bfloat16/float16 `hidden` take the fast path, any other dtype the exact float32 reference.
        `lora`: (an adapter's tensors for this layer, the int64 rows of `hidden` that use it) per adapter;
        those rows get their adapter's deltas (kernels/expert_lora.py), the others are computed as without.
        """
        ffns = self._ffns.get(layer)
        if ffns is None:
            raise KeyError(f"layer {layer} is not in this shard ({format_ranges('layers', self._ffns)})")
        if lora:
            return self._forward_lora(layer, hidden, expert_ids, expert_weights, lora)
        if hidden.dtype in FAST_DTYPES:
            return self.prepare_fast()[layer].forward(hidden, expert_ids, expert_weights)
        return moe_forward(hidden, expert_ids, expert_weights, ffns)

    def _forward_lora(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                      expert_weights: torch.Tensor, lora: LoraRows) -> torch.Tensor:
        """The base path for the whole batch when any row uses the base (so those rows are bit-identical
        to a call without adapters), the adapted rows' answers then replaced by `AdaptedExperts`'."""
        from splitmoe.kernels.expert_lora import check_rows  # it builds on this module's routes

        groups = check_rows(lora, hidden.shape[0])
        if not groups:  # every adapter without tensors on this layer
            return self.forward(layer, hidden, expert_ids, expert_weights)
        rows = torch.cat([r for _, r in groups])
        fast = hidden.dtype in FAST_DTYPES
        native_max_tokens = self.prepare_fast()[layer].native_max_tokens if fast else 0  # float32: exact
        if rows.numel() < hidden.shape[0]:
            out = self.forward(layer, hidden, expert_ids, expert_weights)
        else:
            out = torch.zeros_like(hidden)
        adapted = self._adapted_layer(layer).forward(hidden, expert_ids, expert_weights, groups, native_max_tokens)
        out[rows] = adapted.to(out.dtype)
        return out

    def _adapted_layer(self, layer: int) -> AdaptedExperts:
        adapted = self._adapted.get(layer)
        if adapted is None:  # a race builds it twice, harmlessly: it holds views only
            from splitmoe.kernels.expert_lora import AdaptedExperts

            adapted = self._adapted.setdefault(layer, AdaptedExperts(self._ffns[layer], self.num_experts))
        return adapted


def build_fast_layers(ffns_by_layer: Mapping[int, Mapping[int, ExpertFFN]], num_experts: int,
                      repack_identity: RepackIdentity, model_name: str, *, use_native: bool = True,
                      cache: RepackCache | None = None, progress: bool | None = None) -> dict[int, FastMoELayer]:
    """Every layer's `FastMoELayer`: native where the kernels can run the expert, else int4-repacked
    (Q4_0/Q4_1/Q4_K, from/into `cache`; None: no disk cache) or dequantized per call."""
    sync_native_threads()
    use_native = use_native and native_available()
    native_ok = {layer: {e for e, f in ffns.items() if use_native and native_supports(f)}
                 for layer, ffns in ffns_by_layer.items()}
    to_repack = {layer: {e: f for e, f in ffns.items() if e not in native_ok[layer] and can_repack(f)}
                 for layer, ffns in ffns_by_layer.items()}
    int4: dict[int, dict] = {}
    if any(to_repack.values()):
        identities = {layer: repack_identity(layer, fs) for layer, fs in to_repack.items() if fs}
        int4 = load_or_repack({layer: fs for layer, fs in to_repack.items() if fs}, identities, model_name,
                              cache, progress)
    fast = {layer: FastMoELayer(ffns, num_experts, int4=int4.get(layer), use_native=use_native)
            for layer, ffns in ffns_by_layer.items()}
    _log_fast_path(fast, ffns_by_layer, use_native)
    return fast


def _log_fast_path(fast: Mapping[int, FastMoELayer], ffns_by_layer: Mapping[int, Mapping[int, ExpertFFN]],
                   use_native: bool) -> None:
    total = sum(len(f) for f in ffns_by_layer.values())
    if not total:
        return
    n_native = sum(layer.native_experts for layer in fast.values())
    n_int4 = sum(len(layer.int4) for layer in fast.values())
    n_dense = total - n_native - n_int4
    dtype = gemm_dtype()
    if use_native:
        packed = [layer for layer in fast.values() if (nat := layer.native_layer()) is not None and nat.all_packed]
        where = ("packed by 16 rows at load" if len(packed) == len(fast) else "read in place from the GGUF"
                 if not packed else f"packed by 16 rows at load in {len(packed)} of {len(fast)} layers")
        how = (f"native kernels ({native.isa()}, {native.get_num_threads()} threads) on {n_native} experts, "
               f"{where}, up to {max(layer.native_max_tokens for layer in fast.values())} tokens per expert")
    else:
        how = (f"pure torch, native kernels unavailable ({native_unavailable_reason() or 'disabled'}): "
               f"{n_int4} Q4 experts int4-repacked, torch's int4 kernel up to {INT4_MAX_TOKENS} tokens per expert")
    others = f"; {n_dense} experts of other types dequantized per call" if n_dense else ""
    log.info("expert fast path (bfloat16/float16 requests), %d experts in %s: %s%s; more tokens per expert: "
             "dequantize once to %s, gate+up fused GEMM", total, format_ranges("layers", fast), how, others,
             str(dtype).removeprefix("torch."))


def format_ranges(what: str, values: Iterable[int]) -> str:
    """'layers 0-3,7': compact, for one-line messages."""
    values = sorted(values)
    if not values:
        return f"no {what}"
    spans, start = [], values[0]
    for prev, cur in zip(values, [*values[1:], None]):
        if cur is None or cur != prev + 1:
            spans.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = cur
    return f"{what} {','.join(spans)}"
