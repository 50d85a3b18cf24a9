"""How the KV cache stores its values: `--kv-cache-dtype` (vLLM's names; q8_0 as llama.cpp's).

- `bfloat16`, `float32`: as computed (`auto` is the model's dtype: the exact mode's float32, the
  fast mode's bfloat16).
- `fp8_e4m3`, `fp8_e5m2`: one byte a value, with vLLM's default per-tensor scale of 1.0 (no
  calibration data exists for a GGUF file): values are clamped to the format's range (448 and
  57344) rather than becoming NaN, and rounded to 3 or 2 mantissa bits. K, V and MLA's normed
  latent are of order 1-10, where e4m3 keeps ~2 significant decimal digits.
- `q8_0`: llama.cpp's block format along each row: 32 values as int8 with one float16 scale
  (amax / 127), 34 bytes per 32 values; a row must be whole blocks, as llama.cpp requires.

A format quantizes what is written. The native attention (kernels/decode_attention.py) reads every
format where it is stored (`native`), converting in registers; the torch path dequantizes only what
a step reads (a sequence's context slots), never the whole pool. The pools keep the cache's layout (slots second to last); a q8_0
entry has a second pool of scales, [..., slots, row / 32].
"""
from __future__ import annotations

import abc

import torch

from splitmoe.kernels.decode_attention import KVPool

KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8_e4m3", "fp8_e5m2", "q8_0")
Q8_0_BLOCK = 32
_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_DENSE = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class KVFormat(abc.ABC):
    name: str
    bytes_per_value: float

    def stores_as(self, dtype: torch.dtype) -> bool:
        """Whether values are stored exactly as computed in `dtype`: then kernels that address the
        pools themselves (native and paged attention) can read them."""
        return False

    @abc.abstractmethod
    def native(self, pools: tuple[torch.Tensor, ...]) -> KVPool:
        """One entry's pools as the native attention reads them in place."""

    @abc.abstractmethod
    def allocate(self, shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
        """The pools of one entry of one layer, `shape` with the slot axis in place, zeroed."""

    @abc.abstractmethod
    def write(self, pools: tuple[torch.Tensor, ...], dim: int, slots: torch.Tensor, value: torch.Tensor) -> None:
        """`value` (the pool's layout, its slot axis `dim` of len(slots)) into `slots`."""

    @abc.abstractmethod
    def read(self, pools: tuple[torch.Tensor, ...], dim: int, slots: torch.Tensor, start: int | None,
             dtype: torch.dtype) -> torch.Tensor:
        """The values at `slots` in `dtype` (`start`: they are the run start.. of consecutive slots)."""


def _take(pool: torch.Tensor, dim: int, slots: torch.Tensor, start: int | None) -> torch.Tensor:
    return pool.index_select(dim, slots) if start is None else pool.narrow(dim, start, slots.numel())


class DenseFormat(KVFormat):
    """As computed: reads are views of the pool where the slots run consecutively."""

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.name, self.bytes_per_value = dtype, str(dtype).removeprefix("torch."), dtype.itemsize

    def stores_as(self, dtype):
        return dtype == self.dtype

    def allocate(self, shape, device):
        return (torch.zeros(shape, dtype=self.dtype, device=device),)

    def native(self, pools):
        return KVPool(pools[0])

    def write(self, pools, dim, slots, value):
        pools[0].index_copy_(dim, slots, value.to(self.dtype))

    def read(self, pools, dim, slots, start, dtype):
        return _take(pools[0], dim, slots, start).to(dtype)


class FP8Format(KVFormat):
    bytes_per_value = 1

    def __init__(self, name: str):
        self.name, self.dtype = name, _FP8[name]
        self.max_value = torch.finfo(self.dtype).max

    def allocate(self, shape, device):
        # stored as bytes: index_copy_ and index_select need no float8 kernels that way
        return (torch.zeros(shape, dtype=torch.uint8, device=device),)

    def native(self, pools):
        return KVPool(pools[0].view(self.dtype))

    def write(self, pools, dim, slots, value):
        fp8 = value.float().clamp(-self.max_value, self.max_value).to(self.dtype)
        pools[0].index_copy_(dim, slots, fp8.view(torch.uint8))

    def read(self, pools, dim, slots, start, dtype):
        return _take(pools[0], dim, slots, start).view(self.dtype).to(dtype)


class Q8_0Format(KVFormat):
    name = "q8_0"
    bytes_per_value = 1 + 2 / Q8_0_BLOCK

    def allocate(self, shape, device):
        *lead, row = shape
        return (torch.zeros(shape, dtype=torch.int8, device=device),
                torch.zeros((*lead, row // Q8_0_BLOCK), dtype=torch.float16, device=device))

    def native(self, pools):
        return KVPool(pools[0], pools[1])

    def write(self, pools, dim, slots, value):
        q, scales = quantize_q8_0(value)
        pools[0].index_copy_(dim, slots, q)
        pools[1].index_copy_(dim, slots, scales)

    def read(self, pools, dim, slots, start, dtype):
        q, scales = _take(pools[0], dim, slots, start), _take(pools[1], dim, slots, start)
        return dequantize_q8_0(q, scales).to(dtype)


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float16 scales [..., row / 32]) of x [..., row], as llama.cpp's quantize_row_q8_0:
    d = amax / 127 per block of 32, q = round(x / d)."""
    blocks = x.float().unflatten(-1, (-1, Q8_0_BLOCK))
    d = blocks.abs().amax(dim=-1) / 127.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None]).clamp(-127, 127).to(torch.int8)
    return q.flatten(-2), d.to(torch.float16)


def dequantize_q8_0(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values of `quantize_q8_0`'s output (the float16 scale, as llama.cpp multiplies)."""
    return (q.float().unflatten(-1, (-1, Q8_0_BLOCK)) * scales.float()[..., None]).flatten(-2)


def kv_format(kv_cache_dtype: str, compute_dtype: torch.dtype) -> KVFormat:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r}: want one of {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "auto":
        return DenseFormat(compute_dtype)
    if kv_cache_dtype in _DENSE:
        return DenseFormat(_DENSE[kv_cache_dtype])
    if kv_cache_dtype in _FP8:
        return FP8Format(kv_cache_dtype)
    return Q8_0Format()


def check_rows(fmt: KVFormat, entry_shapes: dict[str, tuple[int, ...]]) -> None:
    """q8_0 stores whole blocks of 32 along each entry's row, as llama.cpp does."""
    if isinstance(fmt, Q8_0Format):
        for name, shape in entry_shapes.items():
            if shape[-1] % Q8_0_BLOCK:
                raise ValueError(f"--kv-cache-dtype q8_0: the cache's '{name}' rows hold {shape[-1]} values, not "
                                 f"whole blocks of {Q8_0_BLOCK} (llama.cpp's q8_0 needs them too); use fp8_e4m3")
