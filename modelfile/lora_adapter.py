"""LoRA adapters as llama.cpp's `convert_lora_to_gguf.py` writes them, checked against the base model.

The format, as llama.cpp reads it (src/llama-adapter.cpp, llama-graph.cpp `build_lora_mm[_id]`):
* metadata: `general.type` = "adapter", `adapter.type` = "lora", `general.architecture` = the base's,
  `adapter.lora.alpha` (float; absent or 0 means no alpha scaling);
* tensors in pairs `<base tensor name>.lora_a` / `.lora_b`. In torch order (GGUF lists dims reversed)
  `lora_a` is [r, in] and `lora_b` [out, r] for a base matrix [out, in]; for routed experts, stacked
  [E, r, in] / [E, out, r] for a base [E, out, in]. `*_norm.weight` vectors (mergekit adds them) are
  skipped, as llama.cpp skips them; any other tensor is an error;
* the output gains `scale * B @ (A @ x)`, with `scale` = alpha / r per tensor, r being that tensor's
  own rank (`lora_b`'s last dim), or 1 where alpha is 0. peft computes `lora_alpha / r` the same way,
  its `rank_pattern` giving some modules another r under the one alpha.

llama.cpp checks in and out against the base tensor but not the expert count; this loader checks that
too, since the expert services index A and B by expert. What llama.cpp reads in a way this loader
does not apply (the embedding's flipped layout, activated LoRA's invocation tokens) is refused here
rather than loaded and left unapplied. Every refusal is one line naming the file and the key or tensor.
"""
from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from splitmoe.kernels.quants import dequantize
from splitmoe.kernels.repack_cache import tensor_digest
from splitmoe.modelfile.gguf_file import GGUFError, GGUFFile

__all__ = ["AdapterRef", "LoraAdapter", "LoraAdapterError", "LoraTensor", "adapter_identity", "is_routed_expert",
           "load_lora_adapter"]

# The routed experts' matrices: the stacked 3-D layout (`ffn_gate_exps`, and the fused `ffn_gate_up_exps`)
# and the older one-tensor-per-expert layout (`ffn_gate.<e>`). Shared experts (`_shexp`) are not routed.
_ROUTED_EXPERT = re.compile(r"\.ffn_(gate|up|down|gate_up)(_exps|\.\d+)\.weight$")
_SKIPPED_SUFFIX = "_norm.weight"  # llama.cpp: "TODO: add support for norm vector"


class LoraAdapterError(GGUFError):
    """A readable GGUF file that is not a LoRA adapter this loader applies, or is made for another base
    model. (A file that is not readable GGUF at all fails as `GGUFError`, this class's parent.)"""


@dataclass(frozen=True)
class LoraTensor:
    """One adapted base tensor: its output gains `scale * b @ (a @ x)`."""
    base_name: str
    a: torch.Tensor  # float32 [r, in], or [E, r, in] for routed experts
    b: torch.Tensor  # float32 [out, r], or [E, out, r]
    scale: float     # alpha / rank as llama.cpp computes it for this tensor (1 where alpha is 0)

    @property
    def rank(self) -> int:
        return int(self.b.shape[-1])

    def delta(self) -> torch.Tensor:
        """`scale * b @ a`, the change to the base weight: [out, in] or [E, out, in]."""
        return self.scale * (self.b @ self.a)


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """An adapter as a hop names it to an expert service, which loads the file at `path` itself and
    computes with it only if its `identity` is this one (the two services may read different files)."""
    name: str
    path: str
    identity: str


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: Path
    alpha: float
    identity: str  # adapter_identity(path): what the attention and expert services compare
    tensors: dict[str, LoraTensor]  # by base tensor name
    skipped: tuple[str, ...] = field(default=())  # tensors llama.cpp skips too (`*_norm.weight`)

    @property
    def rank(self) -> int:
        """The largest rank of any tensor (what `--max-lora-rank` bounds)."""
        return max((t.rank for t in self.tensors.values()), default=0)

    @property
    def ref(self) -> AdapterRef:
        return AdapterRef(self.name, str(self.path), self.identity)

    def attention_side(self) -> dict[str, LoraTensor]:
        """What the attention service applies: everything but the routed experts."""
        return {n: t for n, t in self.tensors.items() if not is_routed_expert(n)}

    def expert_side(self) -> dict[str, LoraTensor]:
        """What the expert services apply: the routed experts' matrices."""
        return {n: t for n, t in self.tensors.items() if is_routed_expert(n)}


def is_routed_expert(base_name: str) -> bool:
    return _ROUTED_EXPERT.search(base_name) is not None


def load_lora_adapter(path: str | os.PathLike, base: GGUFFile, name: str,
                      max_rank: int | None = None) -> LoraAdapter:
    """The adapter at `path`, every pair checked against `base`'s tensor of that name; `max_rank`
    (vLLM's `--max-lora-rank`): a tensor of higher rank is refused."""
    g = GGUFFile(path)
    alpha = _check_metadata(g, base)
    pairs, skipped = _pairs(g)
    tensors = {}
    for base_name, (a_name, b_name) in sorted(pairs.items()):
        a, b = g.tensor(a_name), g.tensor(b_name)
        _check_shapes(g, base, base_name, a.shape, b.shape)
        rank = b.shape[-1]
        if max_rank is not None and rank > max_rank:
            raise LoraAdapterError(f"{g.path.name}: tensor {b_name!r} has rank {rank}, above the maximum "
                                   f"LoRA rank {max_rank} (--max-lora-rank)")
        tensors[base_name] = LoraTensor(base_name, dequantize(a), dequantize(b), alpha / rank if alpha else 1.0)
    if not tensors:
        raise LoraAdapterError(f"{g.path.name}: no LoRA tensor pairs ('<tensor>.lora_a' / '.lora_b')")
    return LoraAdapter(name, g.path, alpha, _identity(g), tensors, tuple(skipped))


def adapter_identity(path: str | os.PathLike) -> str:
    """What two services compare before trusting that they apply the same adapter: the file's name and
    size, as the model's `file_id`, plus a fingerprint of its metadata and tensor bytes. Two adapters
    of one shape differ only in their numbers, so name and size alone would not tell them apart."""
    return _identity(GGUFFile(path))


def _identity(g: GGUFFile) -> str:
    h = hashlib.sha256()
    h.update(repr(sorted((k, repr(v)) for k, v in g.metadata.items())).encode())
    h.update(tensor_digest(g.tensor(n) for n in sorted(g.tensor_names)).encode())
    return f"{g.file_id}:{h.hexdigest()[:16]}"


def _check_metadata(g: GGUFFile, base: GGUFFile) -> float:
    """The checks llama.cpp makes before reading any tensor; returns alpha."""
    kind = g.value("general.type", str, "")
    if kind != "adapter":
        raise LoraAdapterError(f"{g.path.name}: not a LoRA adapter: metadata key 'general.type' is {kind!r}, "
                               "expected 'adapter'")
    adapter_type = g.value("adapter.type", str, "")
    if adapter_type != "lora":
        raise LoraAdapterError(f"{g.path.name}: metadata key 'adapter.type' is {adapter_type!r}, expected 'lora'")
    if g.arch != base.arch:
        raise LoraAdapterError(f"{g.path.name}: metadata key 'general.architecture' is {g.arch!r}, but the base "
                               f"model {base.path.name} is {base.arch!r}")
    if "adapter.alora.invocation_tokens" in g.metadata:
        raise LoraAdapterError(f"{g.path.name}: metadata key 'adapter.alora.invocation_tokens': activated LoRA "
                               "(aLoRA) is not supported")
    alpha = float(g.value("adapter.lora.alpha", float, 0.0))
    if not math.isfinite(alpha):
        raise LoraAdapterError(f"{g.path.name}: metadata key 'adapter.lora.alpha' is {alpha}, not a finite number")
    return alpha


def _pairs(g: GGUFFile) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """base name -> (lora_a name, lora_b name); and the tensors skipped as llama.cpp skips them."""
    halves: dict[str, dict[str, str]] = {}
    skipped = []
    for name in g.tensor_names:
        stem, dot, suffix = name.rpartition(".")
        if dot and suffix in ("lora_a", "lora_b"):
            halves.setdefault(stem, {})[suffix] = name
        elif name.endswith(_SKIPPED_SUFFIX):
            skipped.append(name)
        else:
            raise LoraAdapterError(f"{g.path.name}: tensor {name!r} is neither '<tensor>.lora_a' nor '.lora_b'")
    for stem, found in halves.items():
        if len(found) < 2:
            (have, name), = found.items()
            want = f"{stem}.{'lora_b' if have == 'lora_a' else 'lora_a'}"
            raise LoraAdapterError(f"{g.path.name}: tensor {name!r} has no {want!r} to pair with")
    return {stem: (found["lora_a"], found["lora_b"]) for stem, found in halves.items()}, skipped


def _check_shapes(g: GGUFFile, base: GGUFFile, base_name: str, a: tuple[int, ...], b: tuple[int, ...]) -> None:
    """a [.., r, in] and b [.., out, r] (torch order) must fit the base tensor [out, in] or [E, out, in]."""
    where = f"{g.path.name}: tensor {base_name + '.lora_a'!r} / '.lora_b'"
    if base_name == "token_embd.weight":  # llama.cpp stores its pair flipped and applies it at the lookup
        raise LoraAdapterError(f"{where}: LoRA on the token embedding is not supported")
    if not base.has(base_name):
        raise LoraAdapterError(f"{where}: the base model {base.path.name} has no tensor {base_name!r} "
                               "(an adapter for another model?)")
    w = tuple(base.tensor(base_name).shape)
    if len(w) not in (2, 3):
        raise LoraAdapterError(f"{where}: base tensor {base_name!r} of shape {list(w)} is not a matrix")
    lead = w[:-2]
    fits = (len(a) == len(b) == len(w) and a[:-2] == lead == b[:-2] and a[-1] == w[-1] and b[-2] == w[-2]
            and a[-2] == b[-1])
    if not fits:
        raise LoraAdapterError(f"{where} have shapes {list(a)} / {list(b)}, which do not fit base "
                               f"tensor {list(w)} of {base.path.name} (want {[*lead, 'r', w[-1]]} / "
                               f"{[*lead, w[-2], 'r']}; an adapter for another model?)")
