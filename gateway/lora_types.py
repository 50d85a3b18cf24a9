"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter bodies: LoRA adapters loaded while serving.

Requests validate as openai_types' do (strict, unknown fields logged). A loaded adapter is served under
its name: a request whose `model` names it runs the base model with the adapter applied.
"""
from __future__ import annotations

from pydantic import Field, model_validator

from splitmoe.gateway.openai_types import OpenAIBaseModel, ParamError

# An adapter's name is a model id: in /v1/models, in every response's `model`, in logs. Long enough
# for a path-like name (org/adapter-v2), short enough to stay a name.
MAX_LORA_NAME_CHARS = 256


class LoadLoraAdapterRequest(OpenAIBaseModel):
    """POST /v1/load_lora_adapter: a GGUF LoRA adapter (as llama.cpp's convert_lora_to_gguf.py writes it),
    read by the attention service from `lora_path` on its own machine."""
    lora_name: str = Field(max_length=MAX_LORA_NAME_CHARS)
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace the adapter of that name; not supported (unload, then load)

    @model_validator(mode="after")
    def _check(self):
        if not self.lora_name or not self.lora_path:
            raise ParamError("lora_name" if not self.lora_name else "lora_path",
                             "both lora_name and lora_path must be given")
        _check_name(self.lora_name)
        if self.load_inplace:
            raise ParamError("load_inplace", "load_inplace is not supported; unload the adapter, then load it")
        return self


class UnloadLoraAdapterRequest(OpenAIBaseModel):
    """POST /v1/unload_lora_adapter: requests under way finish with the adapter; later ones get 404.
    vLLM's `lora_int_id` is accepted as any unknown field (and logged): names alone say which adapter."""
    lora_name: str = Field(max_length=MAX_LORA_NAME_CHARS)

    @model_validator(mode="after")
    def _check(self):
        if not self.lora_name:
            raise ParamError("lora_name", "lora_name must be given")
        return self


def _check_name(name: str) -> None:
    """A name a client can send back as `model`: no blank ends or control characters, which no one types."""
    if name != name.strip() or not name.isprintable():
        raise ParamError("lora_name", "lora_name must not hold control characters or start or end with a space")
