"""A copy of a GGUF model whose routers send most tokens to a few experts per layer: the skewed
workload that placement by load is measured on (`python -m splitmoe.bench.skewed_model SRC DST`).

Every token's embedding gets a constant in dimension 0, so the residual stream, and after the
FFN norm the router's input, keep a component of one sign; each MoE layer's router then raises its hot
experts' logits by about `strength` (router logits are of order one), a different few per layer. The rest of the file is copied as it is (the embedding becomes F32).
"""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

_ROUTER = re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight")


def hot_experts(num_layers: int, num_experts: int, per_layer: int, seed: int = 0) -> dict[int, list[int]]:
    rng = np.random.default_rng(seed)
    return {layer: sorted(rng.choice(num_experts, per_layer, replace=False).tolist()) for layer in range(num_layers)}


def write_skewed(src: str | os.PathLike, dst: str | os.PathLike, per_layer: int = 2, strength: float = 3.0,
                 constant: float = 4.0, seed: int = 0) -> dict[int, list[int]]:
    """Write the skewed copy; returns the hot experts of each layer."""
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    tensors = {t.name: t for t in r.tensors}
    num_layers = 1 + max(int(m.group(1)) for name in tensors if (m := _ROUTER.fullmatch(name)))
    num_experts = int(r.fields[f"{arch}.expert_count"].contents())
    hot = hot_experts(num_layers, num_experts, per_layer, seed)
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    w = GGUFWriter(str(tmp), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in r.tensors:
        data, qtype = np.array(t.data), t.tensor_type
        if t.name == "token_embd.weight":
            data = dequantize(data, qtype).astype(np.float32)
            data[:, 0] = constant
            qtype = GGMLQuantizationType.F32
        elif m := _ROUTER.fullmatch(t.name):
            layer = int(m.group(1))
            norm = np.array(tensors[f"blk.{layer}.ffn_norm.weight"].data, dtype=np.float32)
            data = data.astype(np.float32)
            # h[0] = norm[0] * x[0] / rms(x), with x[0] about `constant` and rms(x) about 1: the hot
            # experts' logits rise by about `strength` (router logits are of order 1)
            data[hot[layer], 0] += strength / (constant * (norm[0] if abs(norm[0]) > 1e-3 else 1e-3))
        w.add_tensor(t.name, data, raw_dtype=qtype)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tmp.replace(dst)
    finally:
        tmp.unlink(missing_ok=True)
    return hot


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--hot-per-layer", type=int, default=2)
    p.add_argument("--strength", type=float, default=3.0)
    args = p.parse_args()
    print(write_skewed(args.src, args.dst, args.hot_per_layer, args.strength))


if __name__ == "__main__":
    main()
