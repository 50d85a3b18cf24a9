"""The int4 repack of a shard's 4-bit experts (the pure-torch decode route), cached on disk.

Repacking a big model takes minutes; a restart reads the cache instead, memory-mapped (the
packed weights then live in the page cache, like the GGUF they came from). One file per MoE
layer:

    <cache_dir>/int4pack/<model file name>/L<layer>-<key>.pt

`key` hashes everything the packed bytes depend on: the format version below, the model file's
identity (its name and size plus a digest of the layer's tensor names, types, shapes and a
sample of their bytes: cheap, and a re-quantized file of the same size still differs), the
experts repacked, and torch's version and CPU capability (the packed layout is torch's and
depends on both). A different shard or model gets a different file; a file that is unreadable,
truncated or does not hold what its key promises is ignored and rewritten. Files are written to
a temporary name and renamed into place, so readers never see half of one.

With the native kernels available nothing is repacked: they read the GGUF blocks in place.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Mapping

import torch

from splitmoe.kernels.int4pack import GROUP, Int4Expert, Int4Weight, repack_expert
from splitmoe.kernels.moe import ExpertFFN
from splitmoe.kernels.quants import QuantTensor

log = logging.getLogger("splitmoe.kernels")

FORMAT_VERSION = 1
_SAMPLE_BYTES = 4096


def tensor_digest(tensors: Iterable[QuantTensor]) -> str:
    """A cheap content fingerprint: names, types, shapes and 3 x 4 KiB of each tensor's bytes."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{t.name}|{t.ggml_type}|{tuple(t.shape)}|{t.data.nbytes}\n".encode())
        flat = t.data.reshape(-1)
        n = flat.shape[0]
        for start in (0, max(0, n // 2 - _SAMPLE_BYTES // 2), max(0, n - _SAMPLE_BYTES)):
            h.update(flat[start:start + _SAMPLE_BYTES].tobytes())
    return h.hexdigest()


def cache_key(identity: str, layer: int, experts: Iterable[int]) -> str:
    """`identity`: the model file and its layer (see `tensor_digest`); experts: those repacked."""
    cpu = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "?"
    text = (f"int4pack v{FORMAT_VERSION}|torch {torch.__version__}|{cpu}|{identity}|layer {layer}|"
            f"experts {','.join(map(str, sorted(experts)))}")
    return hashlib.sha256(text.encode()).hexdigest()


class RepackCache:
    """Cache files under `directory`: the caller's choice (the services take
    `splitmoe.runtime.settings.repack_cache_dir()`), as the kernels import nothing of ours."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._warned = False

    def path(self, model_name: str, layer: int, key: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in model_name) or "model"
        return self.directory / safe / f"L{layer:03d}-{key[:32]}.pt"

    def load(self, path: Path, key: str, ffns: Mapping[int, ExpertFFN]) -> dict[int, Int4Expert] | None:
        """The repacked experts stored at `path`, memory-mapped; None when absent or not valid."""
        if not path.is_file():
            return None
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            return _unpack_state(state, key, ffns)
        except Exception as e:  # noqa: BLE001 - any unreadable file is a miss
            log.warning("int4 repack cache: ignoring %s (%s: %s); it will be rewritten", path,
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return None

    def store(self, path: Path, key: str, packed: Mapping[int, Int4Expert]) -> bool:
        """Write atomically (temporary file + rename); False (warned once) when the directory is not writable."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    torch.save(_state(key, packed), f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            return True
        except OSError as e:
            if not self._warned:
                log.warning("int4 repack cache: cannot write %s (%s); repacked weights stay in memory "
                            "and the next start repacks again", path.parent, e)
                self._warned = True
            return False


def _state(key: str, packed: Mapping[int, Int4Expert]) -> dict:
    state: dict = {"format": FORMAT_VERSION, "key": key, "experts": sorted(packed)}
    for e, p in packed.items():
        state[f"{e}.gate_up.packed"] = p.gate_up.packed
        state[f"{e}.gate_up.sz"] = p.gate_up.scales_and_zeros
        if p.down is not None:
            state[f"{e}.down.packed"] = p.down.packed
            state[f"{e}.down.sz"] = p.down.scales_and_zeros
    return state


def _unpack_state(state, key: str, ffns: Mapping[int, ExpertFFN]) -> dict[int, Int4Expert]:
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION or state.get("key") != key:
        raise ValueError("format or key differs")
    if state.get("experts") != sorted(ffns):
        raise ValueError("holds other experts")
    out = {}
    for e, ffn in ffns.items():
        f, d = ffn.gate.shape
        gate_up = _weight(state, f"{e}.gate_up", ffn.gate.shape[0] + ffn.up.shape[0], d)
        down = _weight(state, f"{e}.down", *ffn.down.shape) if f"{e}.down.packed" in state else None
        out[e] = Int4Expert(gate_up, down)
    return out


def _weight(state: dict, name: str, n: int, k: int) -> Int4Weight:
    packed, sz = state[f"{name}.packed"], state[f"{name}.sz"]
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (n, k // 2) \
            or sz.dtype != torch.bfloat16 or tuple(sz.shape) != (k // GROUP, n, 2):
        raise ValueError(f"{name}: {packed.dtype} {tuple(packed.shape)} / {sz.dtype} {tuple(sz.shape)}, "
                         f"want uint8 {(n, k // 2)} / bfloat16 {(k // GROUP, n, 2)}")
    return Int4Weight(packed, sz)


def load_or_repack(layers: Mapping[int, Mapping[int, ExpertFFN]], identities: Mapping[int, str],
                   model_name: str, cache: RepackCache | None, progress: bool | None = None
                   ) -> dict[int, dict[int, Int4Expert]]:
    """Each layer's experts (those given, all repackable) int4-repacked: from `cache` where it
    holds them, else repacked (with a progress bar on stderr: `progress` None means when stderr
    is a terminal) and stored. `identities[layer]`: see `cache_key`."""
    start_s = time.perf_counter()
    result: dict[int, dict[int, Int4Expert]] = {}
    misses: list[tuple[int, Path | None, str]] = []
    for layer, ffns in layers.items():
        if not ffns:
            result[layer] = {}
            continue
        key = cache_key(identities[layer], layer, ffns)
        path = cache.path(model_name, layer, key) if cache is not None else None
        hit = cache.load(path, key, ffns) if cache is not None else None
        if hit is not None:
            result[layer] = hit
        else:
            misses.append((layer, path, key))
    hits = len(result) - sum(1 for f in layers.values() if not f)
    total = sum(len(layers[layer]) for layer, _, _ in misses)
    if misses:
        log.info("int4 repack: %d experts of %d layers to repack, %d layers read from the cache", total, len(misses), hits)
        bar = _progress_bar(total, progress)
        try:
            for layer, path, key in misses:
                packed = {}
                for e, ffn in layers[layer].items():
                    packed[e] = repack_expert(ffn)
                    bar.update(1)
                if cache is not None and cache.store(path, key, packed):
                    # Read back memory-mapped: the page cache holds it, not this process's heap.
                    packed = cache.load(path, key, layers[layer]) or packed
                result[layer] = packed
        finally:
            bar.close()
    num_bytes = sum(p.num_bytes for layer in result.values() for p in layer.values())
    log.info("int4 repack: %d layers ready in %.1f s (%d from the cache, %d repacked), %.2f GiB%s",
             len(result), time.perf_counter() - start_s, hits, len(misses), num_bytes / 2**30,
             f", cache {cache.directory}" if cache is not None else ", no cache")
    return result


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, progress: bool | None):
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="int4 repack", unit="expert", file=sys.stderr, dynamic_ncols=True)
