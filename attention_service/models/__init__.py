"""Architecture registry: GGUF `general.architecture` -> its ArchSpec. Filled here, read-only after."""
from splitmoe.attention_service.model.arch_spec import ArchSpec
from splitmoe.attention_service.models import (
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
from splitmoe.modelfile.gguf_file import GGUFError

ARCHS: dict[str, ArchSpec] = {m.SPEC.gguf_arch: m.SPEC for m in (qwen3moe, qwen2moe, mixtral, olmoe, gpt_oss,
                                                          deepseek2, dbrx, deepseek, glm4moe, llama4)}


def arch_spec(gguf_arch: str, file_name: str = "model") -> ArchSpec:
    spec = ARCHS.get(gguf_arch)
    if spec is None:
        raise GGUFError(f"{file_name}: architecture {gguf_arch!r} is not supported "
                        f"(supported: {', '.join(sorted(ARCHS))})")
    return spec
