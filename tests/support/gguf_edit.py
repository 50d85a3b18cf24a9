"""Rewrite a GGUF file with edits, to make the broken files that error tests need."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

TensorEdit = Callable[[str, np.ndarray, GGMLQuantizationType], tuple[np.ndarray, GGMLQuantizationType]]


def rewrite_gguf(src, dst, drop_keys: tuple[str, ...] = (), set_keys: dict[str, Any] | None = None,
                 arch: str | None = None, edit_tensor: TensorEdit | None = None,
                 drop_tensors: tuple[str, ...] = (), rename_tensors: dict[str, str] | None = None,
                 add_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None) -> None:
    """`set_keys` replace keys of the same name (python int: INT32, float: FLOAT32, as gguf-py types them);
    `add_tensors` (name -> stored data, type) are written after the file's own."""
    set_keys, rename_tensors = set_keys or {}, rename_tensors or {}
    r = GGUFReader(src)
    w = GGUFWriter(str(dst), arch or r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in drop_keys or key in set_keys or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for key, value in set_keys.items():
        w.add_key_value(key, value, GGUFValueType.get_type(value))
    for t in r.tensors:
        if t.name in drop_tensors:
            continue
        data, qtype = np.array(t.data), t.tensor_type
        if edit_tensor:
            data, qtype = edit_tensor(t.name, data, qtype)
        w.add_tensor(rename_tensors.get(t.name, t.name), data, raw_dtype=qtype)
    for name, (data, qtype) in (add_tensors or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
