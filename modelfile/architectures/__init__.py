"""The architecture registry: GGUF `general.architecture` -> its ArchSpec, one module per family.

Each family's module (modelfile/architectures/<family>.py) holds all that is its own: its
`Architecture` (the file facts both services read: expert activation, metadata defaults, the keys
only it has) and its `ArchSpec` (the attention side's wiring of the shared layers). Adding a family
is one module here, listed in FAMILIES, plus its tests. Filled at import, read-only after.
"""
from splitmoe.modelfile.architectures import (
    dbrx,
    deepseek,
    deepseek2,
    glm4moe,
    gpt_oss,
    llama4,
    mixtral,
    olmoe,
    qwen2moe,
    qwen3moe,
)
from splitmoe.modelfile.architectures.base import Architecture, ArchSpec
from splitmoe.modelfile.gguf_file import GGUFError

FAMILIES = (qwen3moe, qwen2moe, mixtral, olmoe, gpt_oss, deepseek2, dbrx, deepseek, glm4moe, llama4)
ARCHS: dict[str, ArchSpec] = {m.SPEC.gguf_arch: m.SPEC for m in FAMILIES}


def arch_spec(gguf_arch: str, file_name: str = "model") -> ArchSpec:
    """The attention side's spec of `gguf_arch`; an architecture not listed is refused, naming the file."""
    spec = ARCHS.get(gguf_arch)
    if spec is None:
        raise GGUFError(f"{file_name}: architecture {gguf_arch!r} is not supported "
                        f"(supported: {', '.join(sorted(ARCHS))})")
    return spec


def architecture(gguf_arch: str) -> Architecture:
    """The file facts of `gguf_arch`, or the common case (SiLU experts, no defaults) for one not listed:
    the expert service serves any file of the usual tensor layout; the attention side refuses
    architectures it has no ArchSpec for (`arch_spec`)."""
    spec = ARCHS.get(gguf_arch)
    return spec.architecture if spec else Architecture(gguf_arch)
