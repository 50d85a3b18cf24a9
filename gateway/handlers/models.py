"""GET /v1/models and /v1/models/{id}, the served model's names, which every handler resolves first, and
vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, which change them."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from splitmoe.gateway.attention_client import AttentionClient, AttentionError
from splitmoe.gateway.attention_types import LoraAdapter, ModelInfo
from splitmoe.gateway.failures import failed
from splitmoe.gateway.lora_types import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from splitmoe.gateway.openai_types import ErrorResponse, ModelCard, ModelList, error_response

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Served:
    """What a request's `model` names: the name its responses carry, and the adapter it runs with."""
    name: str
    lora_name: str = ""  # "": the base model


class ServedModel:
    """The one base model behind this gateway and the LoRA adapters loaded on it.

    The base's ModelInfo is cached once ready (its id and context never change). Adapters come and go
    while serving, so their names are kept apart: refreshed by one ModelInfo call when a request names
    one not known here, and forgotten after this gateway's own load or unload.
    """

    def __init__(self, client: AttentionClient, served_name: str | None) -> None:
        self._client = client
        self._served_name = served_name
        self._ready_info: ModelInfo | None = None
        self._adapters: dict[str, LoraAdapter] = {}
        self.created = int(time.time())

    async def info(self) -> ModelInfo:
        """The base model's info; its `lora_adapters` may be stale (`fresh_info` has them)."""
        if self._ready_info is not None:
            return self._ready_info
        return await self.fresh_info()

    async def fresh_info(self) -> ModelInfo:
        """One ModelInfo call: the adapters loaded now, remembered for `resolve`."""
        info = await self._client.model_info()
        if info.ready:  # id and context length never change once loaded
            self._ready_info = info
        self._adapters = {adapter.name: adapter for adapter in info.lora_adapters}
        return info

    def forget_adapters(self) -> None:
        """After a load or unload, or an adapter request the attention service refused: ask again next time."""
        self._adapters = {}

    async def name(self) -> str:
        if self._served_name:
            return self._served_name
        info = await self.info()
        if not info.model_id:
            raise AttentionError(503, "the model is still loading", "unavailable")
        return info.model_id

    async def resolve(self, requested: str | None) -> Served | ErrorResponse:
        """The base model (`requested` None or its name), a loaded adapter, or 404 for any other name;
        raises AttentionError while the attention service is down or loading."""
        name = await self.name()
        if requested is None or requested == name:
            return Served(name)
        if requested not in self._adapters:
            await self.fresh_info()  # loaded since we last asked, maybe by another gateway
        if requested in self._adapters:
            return Served(requested, lora_name=requested)
        return model_not_found(requested)

    async def list(self, request_id: str) -> ModelList | ErrorResponse:
        """The base model's card, then one per adapter (vLLM's: `parent` is the base, `root` the file)."""
        try:
            name, info = await self.name(), await self.fresh_info()
        except AttentionError as e:
            return failed(request_id, e)
        context_tokens = info.context_tokens or None
        base = ModelCard(id=name, created=self.created, root=info.model_id or name, max_model_len=context_tokens)
        adapters = [ModelCard(id=a.name, created=self.created, root=a.path, parent=name, max_model_len=context_tokens)
                    for a in info.lora_adapters]
        return ModelList(data=[base, *adapters])

    async def card(self, model_id: str, request_id: str) -> ModelCard | ErrorResponse:
        """One model's card (the base's or an adapter's), OpenAI's 404 for any other id."""
        listed = await self.list(request_id)
        if isinstance(listed, ErrorResponse):
            return listed
        return next((card for card in listed.data if card.id == model_id), None) or model_not_found(model_id)

    async def load_adapter(self, request: LoadLoraAdapterRequest, request_id: str) -> str | ErrorResponse:
        """vLLM's answer: 200 with a line of plain text; the attention service's refusal as a 400."""
        try:
            if request.lora_name == await self.name():
                return error_response(400, f"lora_name: '{request.lora_name}' is the base model's name",
                                      code="invalid_argument", param="lora_name")
            await self._client.load_lora_adapter(request.lora_name, request.lora_path)
        except AttentionError as e:
            return failed(request_id, e)
        finally:
            self.forget_adapters()
        log.info("%s: loaded LoRA adapter %r from %s", request_id, request.lora_name, request.lora_path)
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    async def unload_adapter(self, request: UnloadLoraAdapterRequest, request_id: str) -> str | ErrorResponse:
        """An unknown name is the attention service's NOT_FOUND: 404, as vLLM answers it."""
        try:
            await self._client.unload_lora_adapter(request.lora_name)
        except AttentionError as e:
            return failed(request_id, e)
        finally:
            self.forget_adapters()
        log.info("%s: unloaded LoRA adapter %r", request_id, request.lora_name)
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."


def model_not_found(requested: str) -> ErrorResponse:
    """OpenAI's words for a model id that is not served here."""
    shown = requested if len(requested) <= 100 else requested[:100] + "..."
    return error_response(404, f"The model `{shown}` does not exist.", code="model_not_found", param="model")
