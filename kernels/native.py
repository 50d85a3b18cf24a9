"""Native CPU kernels for quantized matmuls, dequantization and MoE expert FFNs.

A plain C++ shared library (kernels/csrc, built by setup.py as kernels/_native*.so) loaded with
ctypes, which releases the GIL for the duration of every call. It reads the weights straight
from their GGUF blocks (read-only views of the mmap) or, where the ISA has the faster tiles for
them, from copies packed by 16 rows at load (`KernelWeight`, csrc/repack.cpp), and quantizes the
activations to int8 per block of 32 values, as ggml does, for integer dot products. The instruction set is chosen at run time: AVX-512 VNNI, AVX-512BW, AVX2 or portable
scalar code (`isa()`); SPLITMOE_KERNELS_ISA=avx2 (or scalar, ...) lowers it for a process.

If the library is missing (no compiler at install time) or cannot be loaded, AVAILABLE is False,
UNAVAILABLE_REASON says why, one warning is logged, and callers use the pure-torch kernels
(kernels.quants, kernels.moe).

The native thread pool is process-wide, sized by set_num_threads() (default: torch's).
Calls from several Python threads at once are safe: a call that finds the pool busy runs on its
own thread alone.
"""
from __future__ import annotations

import ctypes
import glob
import logging
import math
import os
import sys
from typing import Mapping, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from splitmoe.kernels import kernel_settings as settings
from splitmoe.kernels import tuning
from splitmoe.kernels.quants import QuantTensor
from splitmoe.kernels.torch_threads import configured_threads

log = logging.getLogger("splitmoe.kernels")

AVAILABLE: bool = False
UNAVAILABLE_REASON: str | None = None

_lib: ctypes.CDLL | None = None
_FLOAT_TYPES = {int(T.F32): (1, 4), int(T.F16): (1, 2), int(T.BF16): (1, 2)}
_SIZES = {int(t): tuple(v) for t, v in GGML_QUANT_SIZES.items()} | _FLOAT_TYPES  # type -> (elems, bytes)
_native_types: frozenset[int] = frozenset()
_ACTIVATIONS = {"silu": 0, "swiglu_oai": 1}
# smk_hop_serve's callback for the messages it does not serve itself: (context, message, length) -> 0 to go on
HOP_FALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint8), ctypes.c_int)


def _find_library() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_native*.so")) + glob.glob(os.path.join(here, "_native*.dylib")))
    return found[0] if found else None


def _load() -> None:
    global _lib, AVAILABLE, UNAVAILABLE_REASON
    path = _find_library()
    if path is None:
        UNAVAILABLE_REASON = ("kernels/_native*.so was not built (no C++ compiler when the package was "
                              "installed? reinstall with g++ available)")
    else:
        try:
            lib = ctypes.CDLL(path)
            _declare(lib)
            lib.smk_isa()  # detects the CPU
        except (OSError, AttributeError) as e:
            UNAVAILABLE_REASON = f"cannot load {path}: {e}"
        else:
            global _native_types
            _lib = lib
            AVAILABLE = True
            _native_types = frozenset(t for t in range(64) if lib.smk_supports(t))
            _lib.smk_set_num_threads(max(1, configured_threads()))
            _lib.smk_set_awake_ms(settings.awake_ms())
            return
    log.warning("native kernels unavailable, using the pure-torch fallback: %s", UNAVAILABLE_REASON)


class _Expert(ctypes.Structure):
    _fields_ = [
        ("gate", ctypes.c_void_p), ("up", ctypes.c_void_p), ("down", ctypes.c_void_p),
        ("gate_stride", ctypes.c_int64), ("up_stride", ctypes.c_int64), ("down_stride", ctypes.c_int64),
        ("gate_type", ctypes.c_int32), ("up_type", ctypes.c_int32), ("down_type", ctypes.c_int32),
        ("activation", ctypes.c_int32),
        ("gate_bias", ctypes.c_void_p), ("up_bias", ctypes.c_void_p), ("down_bias", ctypes.c_void_p),
    ]


def _declare(lib: ctypes.CDLL) -> None:
    P, I, Z, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int64  # noqa: E741 (C-style type letters)
    for name, res, args in [
        ("smk_isa", ctypes.c_char_p, []),
        ("smk_best_isa", ctypes.c_char_p, []),
        ("smk_set_isa", I, [ctypes.c_char_p]),
        ("smk_set_type_choice", I, [I, ctypes.c_char_p, I]),
        ("smk_set_vbmi", I, [I]),
        ("smk_isa_kernel", P, [ctypes.c_char_p, I, I]),
        ("smk_set_num_threads", None, [I]),
        ("smk_get_num_threads", I, []),
        ("smk_park", None, []),
        ("smk_set_awake_ms", None, [I]),
        ("smk_get_awake_ms", I, []),
        ("smk_pin_workers", None, [P, I]),
        ("smk_supports", I, [I]),
        ("smk_can_dequantize", I, [I]),
        ("smk_matmul_multi", I, [I, P, P, P, P, I, P, Z, I, P, Z]),
        ("smk_matmul_multi_residual", I, [I, P, P, P, P, I, P, Z, I, P, Z]),
        ("smk_matmul_heads", I, [I, P, Z, Z, I, I, P, I, I, P]),
        ("smk_dequantize", I, [I, P, Z, I, I, P, I, I, P]),
        ("smk_moe_forward", I, [P, P, I, I, I, P, I, I, P, P, P]),
        ("smk_attn_front", I, [P, P, P, P, P, P]),
        ("smk_route", I, [P, P, I, P, P]),
        ("smk_decode_moe_layer", I, [P, P, I, P, P, P, P]),
        ("smk_decode_remote_layer", I, [P, P, I, I, P, P, P, P, P, P, P, P, I]),
        ("smk_hop_server_new", P, [P, I, I, P]),
        ("smk_hop_server_free", None, [P]),
        ("smk_hop_server_set_layers", None, [P, P, I]),
        ("smk_hop_conn_new", P, [P, I]),
        ("smk_hop_conn_free", None, [P]),
        ("smk_hop_conn_set_region", None, [P, I, P, Z]),
        ("smk_hop_conn_computing", I, [P]),
        ("smk_hop_serve", I, [P, HOP_FALLBACK, P]),
        ("smk_packed_size", L, [I, L, L]),
        ("smk_packed_fast", I, [I]),
        ("smk_repack", I, [I, P, Z, L, L, P]),
        ("smk_attention", I, [P, I, I, I, I, I, P, L, L, P, L, L, I, P, L, L, P, L, L, P, P, I, P, ctypes.c_float, I,
                              P, P]),
        ("smk_kv_quantize", I, [I, P, L, I, P, P]),
        ("smk_rms_norm", I, [P, L, L, L, L, I, P, ctypes.c_float, P]),
        ("smk_rope", I, [P, L, L, L, L, I, I, I, P, P, P]),
    ]:
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


def isa() -> str:
    """The instruction set the kernels use: "avx512vnni" | "avx512bw" | "avx2" | "scalar"."""
    _need()
    return _lib.smk_isa().decode()


def _set_isa(name: str) -> None:
    """Lower the instruction set for this process (tests and benchmarks compare code paths): its own
    kernels for every type from then on, no calibration (kernels.tuning)."""
    _need()
    tuning.disable()
    if _lib.smk_set_isa(name.encode()) != 0:
        raise ValueError(f"ISA {name!r} is unknown or not supported by this CPU (best: {_best_isa()})")


def _set_vbmi(on: bool) -> bool:
    """The VBMI grid decoder (IQ3_XXS, csrc/dot_avx512vbmi.cpp) in the VNNI kernels, or the per-row
    lookups (tests and benchmarks compare them); False where this CPU has no VBMI kernel."""
    _need()
    return _lib.smk_set_vbmi(int(on)) == 0


def _best_isa() -> str:
    _need()
    return _lib.smk_best_isa().decode()


def set_num_threads(n: int) -> None:
    """The native pool's size, process-wide (1: the calling thread does all the work)."""
    _need()
    if int(n) < 1:
        raise ValueError(f"set_num_threads: want n >= 1, got {n}")
    _lib.smk_set_num_threads(int(n))


def get_num_threads() -> int:
    _need()
    return int(_lib.smk_get_num_threads())


def get_awake_ms() -> int:
    """How long after its last job the pool keeps its CPUs from halting (csrc/runtime.cpp `Awake`;
    SPLITMOE_AWAKE_MS, 0 once the process parked)."""
    _need()
    return int(_lib.smk_get_awake_ms())


def park() -> None:
    """Idle pool workers sleep now instead of spinning for the next job: call it when this process
    hands the cores to another (the attention side waiting for its expert services, an expert
    service that has answered). No-op without the native library."""
    if AVAILABLE:
        _lib.smk_park()


_caller_cpu: int | None = None


def pin_compute(cpus: Sequence[int]) -> None:
    """This process's compute threads one to a CPU: the native pool's worker i on cpus[i], and every
    thread that calls into the pool (the attention engine, an expert service's hop loop) on cpus[0],
    once it calls `pin_caller`. For processes that share cores and take turns (see smk_pin_workers)."""
    global _caller_cpu
    cpus = [int(c) for c in cpus]
    if not cpus:
        return
    _caller_cpu = cpus[0]
    if AVAILABLE:
        _lib.smk_pin_workers((ctypes.c_int * len(cpus))(*cpus), len(cpus))


def pin_caller() -> None:
    """Pin the calling thread to the compute plan's first CPU (a no-op without `pin_compute`).

    OpenMP's threads for this thread's torch ops are made at its first parallel region and take
    its affinity then: one is run first, unpinned, so that they stay free to use every core (a
    prompt's GEMMs would otherwise share one)."""
    if _caller_cpu is None or not hasattr(os, "sched_setaffinity"):
        return
    torch.ones(1 << 20).sum()  # the OpenMP team of this thread, made now with its affinity as it is
    try:
        os.sched_setaffinity(0, {_caller_cpu})  # 0: this thread
    except OSError:  # not an allowed CPU: stays as it is
        pass


def supports(ggml_type: int) -> bool:
    """Whether `matmul` (and MoELayer) have a native kernel for this GGML type."""
    return int(ggml_type) in _native_types


def _need() -> None:
    if not AVAILABLE:
        raise RuntimeError(f"native kernels unavailable: {UNAVAILABLE_REASON}")


def _type_name(t: int) -> str:
    try:
        return T(t).name
    except ValueError:
        return f"type {t}"


def _rows(w: QuantTensor, what: str) -> tuple[np.ndarray, int, int, int]:
    """w's storage as C-contiguous uint8 [n, row_bytes] (a view when it already is), n, k, row bytes."""
    if not isinstance(w, QuantTensor):
        raise ValueError(f"{what}: want a QuantTensor, got {type(w).__name__}")
    if len(w.shape) < 1 or any(d < 0 for d in w.shape):
        raise ValueError(f"{what}: tensor {w.name!r} has shape {w.shape}")
    t = int(w.ggml_type)
    try:
        elems, nbytes = _SIZES[t]
    except KeyError:
        raise ValueError(f"{what}: tensor {w.name!r}: unsupported quant type {_type_name(t)}") from None
    k = int(w.shape[-1])
    n = math.prod(w.shape[:-1])
    if k == 0 or k % elems:
        raise ValueError(f"{what}: tensor {w.name!r}: row length {k} is not a multiple of "
                         f"{_type_name(t)}'s block of {elems}")
    row_bytes = k // elems * nbytes
    data = w.data
    if not isinstance(data, np.ndarray) or data.nbytes != n * row_bytes:
        raise ValueError(f"{what}: tensor {w.name!r}: {getattr(data, 'nbytes', '?')} bytes of "
                         f"{_type_name(t)} do not hold shape {w.shape}")
    if not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    return data, n, k, row_bytes


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


_PACKED_BIT = 0x100  # smk.h kPackedBit: the type field of a weight packed by 16 rows


def repack_enabled() -> bool:
    """Whether weights are packed at load for this ISA's fast kernels (SPLITMOE_KERNELS_REPACK=0: read
    every weight in place from the GGUF, as llama.cpp's --no-repack does)."""
    return os.environ.get("SPLITMOE_KERNELS_REPACK", "1") != "0"


def _packed(w: QuantTensor, data: np.ndarray, n: int, k: int, row_bytes: int) -> tuple[np.ndarray, int, int] | None:
    """w packed by 16 rows (kernels/csrc/repack.cpp) as (buffer, group stride, type field), or None
    where packing does not pay (no SIMD kernel for the type on this ISA) or does not apply (rows
    not a multiple of 16). The buffer is this process's own memory, the GGUF's size give or take 3%."""
    t = int(w.ggml_type)
    if not repack_enabled() or not _lib.smk_packed_fast(t):
        return None
    size = int(_lib.smk_packed_size(t, n, k))
    if size <= 0:
        return None
    raw = np.empty(size + 64, dtype=np.uint8)
    buf = raw[(-_ptr(raw)) % 64:][:size]  # 64-byte aligned: the kernels load whole cache lines
    if _lib.smk_repack(t, _ptr(data), row_bytes, n, k, _ptr(buf)) != 0:
        raise ValueError(f"repack: native kernel refused tensor {w.name!r}")
    return buf, size // (n // 16), t | _PACKED_BIT


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADV_DONTNEED = 4  # Linux


def _unmap_file_pages(a: np.ndarray) -> None:
    """Drop a file-backed view's pages from this process (they stay in the page cache, and come back
    on the next read): after packing, the GGUF's copy is not read again, and counting it twice would
    make the process look twice its size. Only for views of a file mapping: on anonymous memory the
    same call would zero the data."""
    base = a
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    if base is None or not sys.platform.startswith("linux"):
        return
    start = -(-_ptr(a) // _PAGE) * _PAGE
    end = (_ptr(a) + a.nbytes) // _PAGE * _PAGE  # whole pages only: neighbours keep theirs
    if end > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


def _libc() -> ctypes.CDLL:
    global _libc_handle
    if _libc_handle is None:
        _libc_handle = ctypes.CDLL(None, use_errno=True)
        _libc_handle.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc_handle


_libc_handle: ctypes.CDLL | None = None


class KernelWeight:
    """A 2-D weight as the kernels read it: its GGUF rows in place, or a copy packed by 16 rows."""

    __slots__ = ("name", "data", "rows", "k", "stride", "type_field")

    def __init__(self, name: str, data: np.ndarray, rows: int, k: int, stride: int, type_field: int) -> None:
        self.name = name
        self.data = data  # what the kernels point into (kept alive by this object)
        self.rows, self.k = rows, k
        self.stride = stride  # bytes from one row (packed: one group of 16 rows) to the next
        self.type_field = type_field  # the GGML type, with the packed bit for a packed copy

    @property
    def packed(self) -> bool:
        return bool(self.type_field & _PACKED_BIT)

    @property
    def address(self) -> int:
        return _ptr(self.data)


def kernel_weight(w: QuantTensor, pack: bool, what: str = "matmul", release_file: bool = False,
                  tune: bool = True) -> KernelWeight:
    """w for the kernels; `pack`: packed where that pays (see `repack_enabled`), at the cost of this
    process holding the copy; `release_file`: the caller reads w only through the packed copy, so the
    mapped file's pages are released (the attention side's prompts still read its linears' blocks).
    The first weight of each type settles which of the CPU's kernels runs that type (kernels.tuning)."""
    data, n, k, row_bytes = _rows(w, what)
    if tune:
        tuning.ensure(w)
    packed = _packed(w, data, n, k, row_bytes) if pack else None
    if packed is not None:
        if release_file:
            _unmap_file_pages(data)
        buf, stride, tfield = packed
        return KernelWeight(w.name, buf, n, k, stride, tfield)
    return KernelWeight(w.name, data, n, k, row_bytes, int(w.ggml_type))


def _out(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, what: str,
         zeroed: bool = False) -> torch.Tensor:
    """The caller's `out`, checked, or a new tensor (zeroed where the kernel accumulates into it)."""
    if out is None:
        return torch.zeros(shape, dtype=dtype) if zeroed else torch.empty(shape, dtype=dtype)
    _check_out(out, shape, dtype, what)
    return out


def _check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> None:
    if not isinstance(out, torch.Tensor) or out.dtype != dtype or tuple(out.shape) != shape \
            or out.device.type != "cpu" or not out.is_contiguous():
        desc = (f"{tuple(out.shape)} {out.dtype} on {out.device}"
                f"{'' if out.is_contiguous() else ' (not contiguous)'}") if isinstance(out, torch.Tensor) \
            else type(out).__name__
        raise ValueError(f"{what}: out must be a contiguous CPU {dtype} tensor of shape {shape}, got {desc}")


def _check_x(x: torch.Tensor, k: int, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32 or x.dim() != 2 or x.is_cuda or x.device.type != "cpu":
        raise ValueError(f"{what}: x must be a 2-D float32 CPU tensor, got {tuple(x.shape)} {x.dtype} on {x.device}")
    if x.shape[1] != k:
        raise ValueError(f"{what}: x has {x.shape[1]} columns, the weight rows have {k}")
    return x.contiguous()


class WeightMatmul:
    """`matmul` against one weight, or several with the same row length side by side (a layer's q, k
    and v: the activations are quantized once and one work list covers every weight's rows), the
    checks done once: a decode step makes a few hundred calls per weight set, and checking the
    weights each time costs more than a small projection's work."""

    def __init__(self, *ws: QuantTensor | KernelWeight, pack: bool = False) -> None:
        """ws: GGUF tensors, or `KernelWeight`s made once and shared (a layer's q both alone and fused
        with k and v); pack: tensors given as QuantTensor are packed where that pays (see
        `repack_enabled`); otherwise the kernels read their GGUF rows in place."""
        _need()
        if not 1 <= len(ws) <= 16:
            raise ValueError(f"matmul: want 1 to 16 weights, got {len(ws)}")
        kws: list[KernelWeight] = []
        for w in ws:
            if isinstance(w, KernelWeight):
                kws.append(w)
                continue
            if not isinstance(w, QuantTensor) or len(w.shape) != 2:
                raise ValueError(f"matmul: w must be a 2-D QuantTensor, got "
                                 f"{getattr(w, 'shape', type(w).__name__)}")
            if not supports(w.ggml_type):
                raise ValueError(f"matmul: tensor {w.name!r}: no native matmul for {_type_name(int(w.ggml_type))}")
            kws.append(kernel_weight(w, pack))
        if len({w.k for w in kws}) != 1:
            raise ValueError(f"matmul: weights {[w.name for w in kws]} differ in row length")
        self.name = "+".join(w.name for w in kws)
        self._weights = kws  # keeps the mmap views (or packed copies) alive
        self.sizes = tuple(w.rows for w in kws)  # output columns of each weight
        self.n, self.k = sum(self.sizes), kws[0].k
        count = len(kws)
        self._count = count
        self._types = (ctypes.c_int * count)(*(w.type_field for w in kws))
        self._ptrs = (ctypes.c_void_p * count)(*(w.address for w in kws))
        self._strides = (ctypes.c_size_t * count)(*(w.stride for w in kws))
        self._ns = (ctypes.c_int * count)(*self.sizes)
        self.packed = tuple(w.packed for w in kws)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, residual: bool = False) -> torch.Tensor:
        """float32 [m, n]: the weights' outputs side by side, in the order given. residual: the activations
        go in as two int8 terms, each row's blocks and what their rounding left out (csrc/runtime.cpp
        `smk_matmul_multi_residual`): ~1/254 of the plain call's activation error, ~2% dearer at one row,
        +25% at 4 and +60% at 16 (the tiles turn compute-bound)."""
        x = _check_x(x, self.k, "matmul")
        m, n = x.shape[0], self.n
        out = _out(out, (m, n), torch.float32, "matmul")
        if m == 0 or n == 0:
            return out
        fn = _lib.smk_matmul_multi_residual if residual else _lib.smk_matmul_multi
        rc = fn(self._count, self._types, self._ptrs, self._strides, self._ns, self.k,
                x.data_ptr(), self.k, m, out.data_ptr(), n)
        if rc != 0:
            raise ValueError(f"matmul: native kernel refused tensor {self.name!r} (code {rc})")
        return out


class HeadsMatmul:
    """A stack of per-head maps [H, rows, k] (MLA's attn_k_b and attn_v_b), every head against its own
    activations: x [T, H, k] -> float32 [T, H, rows]. The heads' int8 dots run in the native pool, over
    each head packed by 16 rows where this ISA packs the type (as WeightMatmul's weights), else over
    the GGUF blocks in place."""

    def __init__(self, w: QuantTensor) -> None:
        _need()
        if not isinstance(w, QuantTensor) or len(w.shape) != 3:
            raise ValueError(f"heads matmul: w must be a 3-D QuantTensor, got {getattr(w, 'shape', type(w).__name__)}")
        if not supports(w.ggml_type):
            raise ValueError(f"heads matmul: tensor {w.name!r}: no native matmul for {_type_name(int(w.ggml_type))}")
        self.name = w.name
        self.heads, self.rows, self.k = (int(d) for d in w.shape)
        # The stack as one [H * rows, k] weight: packed by 16 rows, a group never spans two heads when
        # rows is a multiple of 16, so head h starts h * rows / 16 groups in (where it is not, nothing packs).
        self._weight = kernel_weight(QuantTensor(w.name, w.ggml_type, (self.heads * self.rows, self.k), w.data),
                                     pack=self.rows % 16 == 0, what="heads matmul")
        self._head_bytes = self._weight.stride * (self.rows // 16 if self.packed else self.rows)

    @property
    def packed(self) -> bool:
        return self._weight.packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[1] != self.heads or x.shape[2] != self.k:
            raise ValueError(f"heads matmul {self.name!r}: x must be [T, {self.heads}, {self.k}], got {list(x.shape)}")
        T = x.shape[0]
        xh = x.transpose(0, 1).to(torch.float32).contiguous()  # head-major: each head's rows together
        out = torch.empty(self.heads, T, self.rows, dtype=torch.float32)
        wt = self._weight
        rc = _lib.smk_matmul_heads(wt.type_field, wt.address, self._head_bytes, wt.stride, self.rows, self.k,
                                   xh.data_ptr(), self.heads, T, out.data_ptr())
        if rc != 0:
            raise ValueError(f"heads matmul: native kernel refused tensor {self.name!r} (code {rc})")
        return out.transpose(0, 1)


def matmul(x: torch.Tensor, w: QuantTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [m, n] = x [m, k] @ dequantize(w [n, k]).T, activations quantized to int8 per 32.

    Meant for small m (decode): each weight row is read once and dotted with every row of x.
    """
    return WeightMatmul(w)(x, out)


def _dequantizable(w: QuantTensor, what: str) -> tuple[np.ndarray, int, int, int]:
    """`_rows` of a tensor the native dequantization reads, else ValueError naming it."""
    data, n, k, row_bytes = _rows(w, what)
    if not _lib.smk_can_dequantize(int(w.ggml_type)):
        raise ValueError(f"{what}: tensor {w.name!r}: unsupported quant type {_type_name(int(w.ggml_type))}")
    return data, n, k, row_bytes


def dequantize(w: QuantTensor, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
               rows: torch.Tensor | None = None) -> torch.Tensor:
    """w's values as float32 (bit-identical to kernels.quants.dequantize) or bfloat16, in w.shape;
    with `rows` (1-D integer indices into a 2-D w's first dim): just those rows, [len(rows), k]."""
    _need()
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantize: dtype must be float32 or bfloat16, got {dtype}")
    data, n, k, row_bytes = _dequantizable(w, "dequantize")
    if rows is not None:
        if len(w.shape) != 2:
            raise ValueError(f"dequantize: rows= needs a 2-D tensor, {w.name!r} has shape {w.shape}")
        if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype.is_floating_point \
                or rows.dtype.is_complex or rows.dtype == torch.bool:
            raise ValueError("dequantize: rows must be a 1-D integer tensor")
        idx = rows.to(device="cpu", dtype=torch.int64).contiguous()
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise ValueError(f"dequantize: rows out of range for {w.name!r} with {n} rows")
        shape: tuple[int, ...] = (idx.numel(), k)
        nrows, rows_ptr = idx.numel(), idx.data_ptr()
    else:
        shape, nrows, rows_ptr = tuple(w.shape), n, None
    out = _out(out, shape, dtype, "dequantize")
    if nrows == 0:
        return out
    rc = _lib.smk_dequantize(int(w.ggml_type), _ptr(data), row_bytes, n, k, rows_ptr, nrows,
                             int(dtype == torch.bfloat16), out.data_ptr())
    if rc != 0:
        raise ValueError(f"dequantize: native kernel refused tensor {w.name!r} (code {rc})")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] float32 (up to 3 dims, the last contiguous: a head-split view of a projection is fine)
    -> a new contiguous float32 tensor, each row x / sqrt(mean(x^2) + eps) * weight, the sum of squares
    in double in a fixed order (csrc/norm.cpp: the same bits on every ISA, as the decode front norms)."""
    _need()
    n = x.shape[-1] if x.dim() else 0
    if x.dtype != torch.float32 or x.device.type != "cpu" or not 1 <= x.dim() <= 3 or n == 0 or x.stride(-1) != 1:
        raise ValueError(f"rms_norm: x must be a 1- to 3-D float32 CPU tensor with contiguous rows, "
                         f"got {tuple(x.shape)} {x.dtype} strides {tuple(x.stride())} on {x.device}")
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or tuple(weight.shape) != (n,) \
            or not weight.is_contiguous() or weight.device.type != "cpu":
        raise ValueError(f"rms_norm: weight must be a contiguous float32 CPU tensor of shape ({n},)")
    x3 = x.reshape(1, 1, n) if x.dim() == 1 else x.unsqueeze(0) if x.dim() == 2 else x
    out = torch.empty(x.shape, dtype=torch.float32)
    rc = _lib.smk_rms_norm(x.data_ptr(), x3.shape[0], x3.shape[1], x3.stride(0), x3.stride(1), n,
                           weight.data_ptr(), float(eps), out.data_ptr())
    if rc != 0:
        raise ValueError(f"rms_norm: native kernel refused shape {tuple(x.shape)} (code {rc})")
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [T, H, D] float32 (rows contiguous; heads and tokens may be strided: a view of a projection),
    rotated over its first `dims` = cos.shape[-1] values per head by the tables cos, sin [T, dims]
    (sin signed: Rope.tables' layout), the rest copied -> a new contiguous float32 [T, H, D] with the
    torch path's bits (csrc/rope.cpp)."""
    _need()
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"rope: x must be a 3-D float32 CPU tensor with contiguous rows, "
                         f"got {tuple(x.shape)} {x.dtype} strides {tuple(x.stride())} on {x.device}")
    T, H, D = x.shape
    dims = cos.shape[-1] if cos.dim() else 0
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or tuple(t.shape) != (T, dims) or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"rope: {name} must be a contiguous float32 CPU tensor [{T}, dims], got {tuple(t.shape)}")
    if not 0 < dims <= D or dims % 2:
        raise ValueError(f"rope: {dims} rotated dims do not fit heads of {D}")
    out = torch.empty(x.shape, dtype=torch.float32)
    rc = _lib.smk_rope(x.data_ptr(), T, H, x.stride(0), x.stride(1), D, dims, int(interleaved), cos.data_ptr(),
                       sin.data_ptr(), out.data_ptr())
    if rc != 0:
        raise ValueError(f"rope: native kernel refused shape {tuple(x.shape)} (code {rc})")
    return out


class RowLookup:
    """Rows of a 2-D quantized tensor dequantized by index (a token embedding's lookup): the tensor is
    checked once here, each lookup is one native call (float32 rows, as `dequantize(w, rows=ids)`).
    A decode step looks up one row a sequence, where `dequantize`'s checks cost more than the row."""

    def __init__(self, w: QuantTensor):
        _need()
        if len(w.shape) != 2:
            raise ValueError(f"row lookup: {w.name!r} must be 2-D, not {list(w.shape)}")
        data, n, k, row_bytes = _dequantizable(w, "row lookup")
        self.name, self.num_rows, self.k = w.name, n, k
        self._keep = data  # the buffer the C side reads
        self._args = (int(w.ggml_type), _ptr(data), row_bytes, n, k)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: a contiguous CPU int64 [N] tensor of rows in range (the caller checked) -> float32 [N, k]."""
        out = torch.empty(ids.numel(), self.k, dtype=torch.float32)
        if ids.numel():
            rc = _lib.smk_dequantize(*self._args, ids.data_ptr(), ids.numel(), 0, out.data_ptr())
            if rc != 0:
                raise ValueError(f"row lookup: native kernel refused tensor {self.name!r} (code {rc})")
        return out


class MoELayer:
    """One MoE layer's hosted experts, prepared once: pointers into the mmap, or copies packed by 16
    rows where this ISA has the faster kernels for them (see `repack_enabled`)."""

    def __init__(self, ffns: Mapping, num_experts: int) -> None:
        """ffns: expert id -> kernels.moe.ExpertFFN (gate/up [ffn, D], down [D, ffn], optional
        float32 biases, activation "silu" | "swiglu_oai"); every expert with the same shape."""
        _need()
        self.num_experts = int(num_experts)
        if self.num_experts < 0:
            raise ValueError(f"MoELayer: num_experts must be >= 0, got {num_experts}")
        self.experts = sorted(int(e) for e in ffns)
        bad = [e for e in self.experts if not 0 <= e < self.num_experts]
        if bad:
            raise ValueError(f"MoELayer: expert ids {bad} outside [0, {self.num_experts})")
        self._keep: list = []  # arrays the C side points into
        self.packed_bytes = 0  # this process's own copies of the weights (the packed ones)
        self.all_packed = bool(self.experts)  # every matrix of every hosted expert packed
        self._table = (_Expert * max(1, len(self.experts)))()
        index = np.full(max(1, self.num_experts), -1, dtype=np.int32)
        self.hidden_size = self.ffn_size = None
        for i, e in enumerate(self.experts):
            self._table[i] = self._prepare(e, ffns[e])
            index[e] = i
        self._index = index
        self._keep.append(index)

    def _prepare(self, e: int, ffn) -> _Expert:
        mats = {}
        for name in ("gate", "up", "down"):
            w = getattr(ffn, name)
            if not isinstance(w, QuantTensor) or len(w.shape) != 2:
                raise ValueError(f"MoELayer: expert {e} {name} must be a 2-D QuantTensor")
            if not supports(w.ggml_type):
                raise ValueError(f"MoELayer: expert {e} {name} ({w.name!r}): no native kernel for "
                                 f"{_type_name(int(w.ggml_type))}")
            mats[name] = kernel_weight(w, True, f"MoELayer expert {e} {name}", release_file=True)
        ffn_size, hidden = ffn.gate.shape
        if ffn.up.shape != (ffn_size, hidden) or ffn.down.shape != (hidden, ffn_size):
            raise ValueError(f"MoELayer: expert {e}: gate {ffn.gate.shape}, up {ffn.up.shape}, down "
                             f"{ffn.down.shape} are not [ffn, D], [ffn, D], [D, ffn]")
        if self.hidden_size is None:
            self.hidden_size, self.ffn_size = hidden, ffn_size
        elif (hidden, ffn_size) != (self.hidden_size, self.ffn_size):
            raise ValueError(f"MoELayer: expert {e} is [{ffn_size}, {hidden}], the others "
                             f"[{self.ffn_size}, {self.hidden_size}]")
        if ffn.activation not in _ACTIVATIONS:
            raise ValueError(f"MoELayer: expert {e}: unknown activation {ffn.activation!r}")
        biases = {}
        for name, size in (("gate_bias", ffn_size), ("up_bias", ffn_size), ("down_bias", hidden)):
            b = getattr(ffn, name)
            if b is None:
                biases[name] = None
                continue
            b = torch.as_tensor(b).detach().to(device="cpu", dtype=torch.float32).contiguous()
            if b.shape != (size,):
                raise ValueError(f"MoELayer: expert {e} {name} has shape {tuple(b.shape)}, want ({size},)")
            self._keep.append(b)
            biases[name] = b.data_ptr()
        g, u, d = mats["gate"], mats["up"], mats["down"]
        self.packed_bytes += sum(m.data.nbytes for m in mats.values() if m.packed)
        self.all_packed = self.all_packed and all(m.packed for m in mats.values())
        self._keep.extend(mats.values())
        return _Expert(g.address, u.address, d.address, g.stride, u.stride, d.stride,
                       g.type_field, u.type_field, d.type_field,
                       _ACTIVATIONS[ffn.activation], biases["gate_bias"], biases["up_bias"], biases["down_bias"])

    def pointers(self) -> tuple[int, int]:
        """(the expert table's address, the expert index's address), for native callers that run this
        layer themselves (expert_service/csrc/hop_server.cpp); valid while this object lives."""
        return ctypes.addressof(self._table), _ptr(self._index)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [T, D]: sum over the slots whose expert is hosted here of weight * FFN(x[t]).
        With `out`, the result is added into it."""
        if self.hidden_size is None:  # no experts hosted: nothing to add
            if not isinstance(x, torch.Tensor) or x.dim() != 2:
                raise ValueError("MoELayer.forward: x must be a 2-D tensor")
            return torch.zeros(x.shape, dtype=torch.float32) if out is None else out
        D = self.hidden_size
        x = _check_x(x, D, "MoELayer.forward")
        T_ = x.shape[0]
        if not isinstance(expert_ids, torch.Tensor) or expert_ids.dim() != 2 or expert_ids.shape[0] != T_ \
                or expert_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"MoELayer.forward: expert_ids must be int32/int64 [T={T_}, K], got "
                             f"{getattr(expert_ids, 'shape', None)} {getattr(expert_ids, 'dtype', None)}")
        K = expert_ids.shape[1]
        if not isinstance(expert_weights, torch.Tensor) or tuple(expert_weights.shape) != (T_, K) \
                or expert_weights.dtype != torch.float32:
            raise ValueError(f"MoELayer.forward: expert_weights must be float32 [{T_}, {K}], got "
                             f"{getattr(expert_weights, 'shape', None)} {getattr(expert_weights, 'dtype', None)}")
        out = _out(out, (T_, D), torch.float32, "MoELayer.forward", zeroed=True)
        if T_ == 0 or K == 0:
            return out
        ids = expert_ids.to(device="cpu", dtype=torch.int32).contiguous()
        wts = expert_weights.cpu().contiguous()
        rc = _lib.smk_moe_forward(ctypes.addressof(self._table), _ptr(self._index), self.num_experts, D,
                                  self.ffn_size, x.data_ptr(), T_, K, ids.data_ptr(), wts.data_ptr(),
                                  out.data_ptr())
        if rc != 0:
            raise ValueError(f"MoELayer.forward: native kernel refused the call (code {rc})")
        return out

    __call__ = forward


_load()
