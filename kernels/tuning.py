"""Kernels that suit the CPU they run on: a short calibration at load, kept per CPU model.

Feature flags say which instructions a CPU has, not which of our kernels runs fastest on it: Zen 4
executes 512-bit work as two 256-bit halves, Zen 5 at full width, Skylake-SP has AVX-512 without
VNNI, and whether packing a type's weights by 16 rows pays differs with them. So the first time a
process prepares a weight of some type, every distinct kernel this CPU can run for that type (the
ISA's own, packed and in place, and each lower ISA's where its code differs) multiplies the
weight's own first rows, at one token and at 16, on one thread, with the rows in cache: the
kernels read the same bytes, so what tells them apart is their compute. The ISA's own kernel is kept
unless another is faster by more than TIE_MARGIN (measurement noise must not flip a choice); the
choice then holds for every weight of that type in the process (`smk_set_type_choice`).

The choices are kept in `settings.kernel_tuning_path()`, keyed by CPU model, instruction set and
library build, so the next process on the same kind of machine reads them instead of measuring
(the attention side and its expert services then agree too). SPLITMOE_KERNELS_TUNE=0 turns the
calibration off; a forced SPLITMOE_KERNELS_ISA, or `native._set_isa`, means that ISA's own kernels.
`python -m splitmoe.kernels.cpu_features` prints what this machine chose.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from splitmoe.kernels import kernel_settings as settings
from splitmoe.kernels.quants import QuantTensor

log = logging.getLogger("splitmoe.kernels")

TIE_MARGIN = 0.05          # another kernel must be this much faster than the ISA's own to be chosen
CALIBRATION_ROWS = 1024    # of the weight's rows (repeated where it has fewer): ~1.2-1.7 MB at k = 2048, in L2/L3;
# fewer would leave the measure to the ~4 µs every call costs besides the kernel
TOKENS = (1, 16)           # a decode step's one row, and a batch of streams
ROUNDS = 5                 # each kernel timed this many times, interleaved with the others; the fastest counts
MIN_ROUND_S = 0.002
# From the widest down; scalar code is never a candidate (every SIMD path beats it).
ISAS = ("avx512vnni", "avx512bw", "avx2")


@dataclass(frozen=True, slots=True)
class Candidate:
    isa: str
    pack: bool

    @property
    def label(self) -> str:
        return f"{self.isa} {'packed' if self.pack else 'in place'}"


@dataclass(slots=True)
class Choice:
    type_name: str
    isa: str
    pack: bool
    source: str                        # "measured", "cache", or "one kernel" (nothing to choose)
    us: dict[str, list[float]] = field(default_factory=dict)  # per candidate: µs per call at each of TOKENS

    @property
    def label(self) -> str:
        return Candidate(self.isa, self.pack).label


_lock = threading.Lock()
_choices: dict[int, Choice] = {}
_off = False  # set by `disable` (an ISA forced at run time)


def disable() -> None:
    """From now on every type runs the ISA's own kernels (native._set_isa: tests compare ISAs)."""
    global _off
    with _lock:
        _off = True
        _choices.clear()


def reset() -> None:
    """Forget this process's choices (every type back to the ISA's own kernels) and tune again from
    the next weight on: for tests, and after SPLITMOE_KERNELS_TUNE or the cache changed."""
    from splitmoe.kernels import native

    global _off
    with _lock:
        for t in _choices:
            native._lib.smk_set_type_choice(t, b"", 1)
        _choices.clear()
        _off = False


def choices() -> dict[str, Choice]:
    """This process's choices so far, by type name."""
    return {c.type_name: c for c in _choices.values()}


def cached_choices() -> dict[str, str]:
    """What the cache holds for this machine: {type name: kernel label}."""
    records = _read().get(machine_key(), {})
    return {r["type_name"]: Candidate(r["isa"], bool(r["pack"])).label for r in records.values()
            if isinstance(r, dict) and {"type_name", "isa", "pack"} <= r.keys()}


def ensure(w: QuantTensor) -> None:
    """Make (or read) the choice for w's type before the first weight of that type is prepared."""
    t = int(w.ggml_type)
    if t in _choices or _off or not settings.kernel_tuning_enabled():
        return
    with _lock:
        if t in _choices or _off:
            return
        choice = _from_cache(t) or _measure(w)
        _set(t, choice.isa, choice.pack)
        _choices[t] = choice
    if choice.source == "measured":
        log.info("kernels for %s: %s (%s)", choice.type_name, choice.label,
                 ", ".join(f"{k} {v[0]:.1f}/{v[1]:.1f} µs" for k, v in choice.us.items()))
        _store(t, choice)


def candidates(ggml_type: int) -> list[Candidate]:
    """The distinct kernels this CPU can run for the type, the ISA's own first (packed where it packs)."""
    from splitmoe.kernels import native

    lib, base = native._lib, native.isa()
    if base not in ISAS:
        return []
    found: list[Candidate] = []
    seen: set[int] = set()
    for isa in ISAS[ISAS.index(base):]:
        for pack in (True, False):
            address = lib.smk_isa_kernel(isa.encode(), ggml_type, int(pack))
            if address and address not in seen:
                seen.add(address)
                found.append(Candidate(isa, pack))
    return found


def _measure(w: QuantTensor) -> Choice:
    from splitmoe.kernels import native

    t = int(w.ggml_type)
    name = w.type_name
    found = candidates(t)
    if len(found) <= 1:
        own = found[0] if found else Candidate(native.isa(), True)
        return Choice(name, own.isa, own.pack, "one kernel")
    rows = calibration_rows(w)
    threads = native.get_num_threads()
    native.set_num_threads(1)  # one core's compute: the pool's hand-offs would blur small differences
    try:
        matmuls = {}
        for c in found:
            _set(t, c.isa, c.pack)
            kw = native.kernel_weight(rows, c.pack, "kernel calibration", tune=False)
            if kw.packed == c.pack:  # a weight that does not pack (its row length) leaves that kernel out
                matmuls[c] = native.WeightMatmul(kw)
        best_s = {c: [math.inf] * len(TOKENS) for c in matmuls}
        xs = [torch.randn(m, rows.shape[1], generator=torch.Generator().manual_seed(m)) for m in TOKENS]
        for _ in range(ROUNDS):
            for c, mm in matmuls.items():
                _set(t, c.isa, c.pack)
                for i, x in enumerate(xs):
                    best_s[c][i] = min(best_s[c][i], _seconds_per_call(mm, x))
    finally:
        native.set_num_threads(threads)
    own = next(iter(matmuls))
    winner = min(matmuls, key=lambda c: _score(best_s[c]))
    if _score(best_s[winner]) > (1 - TIE_MARGIN) * _score(best_s[own]):
        winner = own
    return Choice(name, winner.isa, winner.pack, "measured",
                  {c.label: [round(s * 1e6, 2) for s in best_s[c]] for c in matmuls})


def _score(seconds: list[float]) -> float:
    """One figure per kernel: the geometric mean over TOKENS (decode and batched count alike)."""
    return math.prod(seconds) ** (1 / len(seconds))


def _seconds_per_call(mm, x: torch.Tensor) -> float:
    out = torch.empty(x.shape[0], mm.n)
    mm(x, out)
    calls, start = 0, time.perf_counter()
    while True:
        mm(x, out)
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= MIN_ROUND_S and calls >= 3:
            return elapsed / calls


def calibration_rows(w: QuantTensor) -> QuantTensor:
    """CALIBRATION_ROWS rows of w as a 2-D tensor: its first rows, repeated where it has fewer."""
    from splitmoe.kernels import native

    data, n, k, row_bytes = native._rows(w, "kernel calibration")
    rows2d = data.reshape(n, row_bytes)[:CALIBRATION_ROWS]
    picked = np.ascontiguousarray(np.resize(rows2d, (CALIBRATION_ROWS, row_bytes)))
    return QuantTensor(f"{w.name} (calibration rows)", w.ggml_type, (CALIBRATION_ROWS, k), picked)


def _set(t: int, isa: str, pack: bool) -> None:
    from splitmoe.kernels import native

    if native._lib.smk_set_type_choice(t, isa.encode(), int(pack)) != 0:
        raise RuntimeError(f"kernel calibration: {isa} cannot run here")


# ---- the cache ------------------------------------------------------------------------------------

@functools.cache
def machine_key() -> str:
    """CPU model | the ISA in use | the library build: choices hold for this triple only."""
    from splitmoe.kernels import native
    from splitmoe.kernels.cpu_features import cpu_model

    return f"{cpu_model()} | {native.isa()} | {_library_digest()}"


@functools.cache
def _library_digest() -> str:
    from splitmoe.kernels import native

    path = native._find_library()
    if path is None:
        return "none"
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _from_cache(t: int) -> Choice | None:
    from splitmoe.kernels import native

    record = _read().get(machine_key(), {}).get(str(t))
    if not isinstance(record, dict):
        return None
    try:
        choice = Choice(str(record["type_name"]), str(record["isa"]), bool(record["pack"]), "cache",
                        {str(k): [float(x) for x in v] for k, v in record.get("us", {}).items()})
    except (KeyError, TypeError, ValueError):
        return None
    if Candidate(choice.isa, choice.pack) not in candidates(t) and native.isa() in ISAS:
        return None  # a record this build cannot honour: measure again
    return choice


def _read() -> dict:
    path = settings.kernel_tuning_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("kernel calibration: ignoring %s (%s); it will be rewritten", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def _store(t: int, choice: Choice) -> None:
    """Add this choice to the file (read again first: another process may have added its own)."""
    path = settings.kernel_tuning_path()
    record = {k: v for k, v in asdict(choice).items() if k != "source"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read()
        data.setdefault(machine_key(), {})[str(t)] = record
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: measure again next time
        log.warning("kernel calibration: cannot write %s (%s)", path, e)
