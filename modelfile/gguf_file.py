"""One GGUF file, opened memory-mapped and checked: metadata and tensor lookup.

GGUF files are untrusted input. Every failure here is a `GGUFError` whose message is one line
naming the file and the key or tensor at fault, so an operator can act on it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType, GGUFReader

from kernels.quants import QuantTensor, check_supported


class GGUFError(ValueError):
    """A malformed, truncated or unsupported GGUF file."""


_MISSING = object()


class GGUFFile:
    """Metadata as plain python values, tensors as `QuantTensor` views of the mmap."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._reader = _open_reader(self.path)
        self.metadata: dict[str, Any] = _read_metadata(self._reader, self.path)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.arch: str = self.require("general.architecture")

    # ---- metadata ------------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        value = self.metadata.get(key, _MISSING)
        if value is _MISSING:
            raise GGUFError(f"{self.path.name}: missing metadata key {key!r}")
        return value

    def arch_get(self, key: str, default: Any = None) -> Any:
        """`<arch>.<key>`, the llama.cpp convention for hyper-parameters."""
        return self.get(f"{self.arch}.{key}", default)

    def arch_require(self, key: str) -> Any:
        return self.require(f"{self.arch}.{key}")

    @property
    def file_id(self) -> str:
        """The identity two services compare before trusting each other's expert ids.

        Name and size, not mtime: a copy of the same file on another host must match.
        """
        return f"{self.path.name}:{self.path.stat().st_size}"

    # ---- tensors -------------------------------------------------------------------------------

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> QuantTensor:
        info = self._tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path.name}: missing tensor {name!r}")
        shape = tuple(int(d) for d in reversed(info.shape))
        qt = QuantTensor(name, int(info.tensor_type), shape, info.data)
        try:
            check_supported(qt)
        except ValueError as e:
            raise GGUFError(f"{self.path.name}: {e}") from None
        return qt


def _open_reader(path: Path) -> GGUFReader:
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # gguf-py raises ValueError/IndexError/struct errors on bad bytes
        raise GGUFError(f"{path.name}: not a readable GGUF file, corrupt or truncated ({_one_line(e)})") from None
    _check_tensor_bounds(reader, path)
    return reader


def _check_tensor_bounds(reader: GGUFReader, path: Path) -> None:
    """A truncated file must fail at open, not when a page fault hits a missing tensor."""
    file_bytes = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > file_bytes:
            raise GGUFError(
                f"{path.name}: tensor {t.name!r} runs past the end of the file "
                f"(needs {t.data_offset + t.n_bytes} bytes, file has {file_bytes}): truncated?")
        try:
            GGMLQuantizationType(int(t.tensor_type))
        except ValueError:
            raise GGUFError(f"{path.name}: tensor {t.name!r} has unknown GGML type {int(t.tensor_type)}") from None


def _read_metadata(reader: GGUFReader, path: Path) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception as e:
            raise GGUFError(f"{path.name}: metadata key {key!r} is malformed ({_one_line(e)})") from None
    return meta


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
