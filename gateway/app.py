"""The HTTP app: routes and exception handlers around the handlers in handlers/, in the middleware of
middleware.py and request_id.py.

A route parses its body, calls its handler, and maps the outcome: an `ErrorResponse` becomes JSON
with its status, a response model JSON, an async iterator SSE. The attention client lives as
long as the app (the lifespan below). Every response carries its request's id (`x-request-id`),
and so does every error body: the log says the rest under that id.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from splitmoe.gateway import chat_page
from splitmoe.gateway.admission import Admission
from splitmoe.gateway.attention_client import AttentionClient, AttentionError
from splitmoe.gateway.docs import add_docs, request_body
from splitmoe.gateway.handlers.base import GenerationHandler
from splitmoe.gateway.handlers.chat import ChatHandler
from splitmoe.gateway.handlers.completions import CompletionHandler
from splitmoe.gateway.handlers.models import Served, ServedModel
from splitmoe.gateway.handlers.ops import OpsHandler
from splitmoe.gateway.handlers.tokens import TokensHandler
from splitmoe.gateway.lora_types import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from splitmoe.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from splitmoe.gateway.middleware import (
    PROBE_PATHS,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    StatusCountMiddleware,
)
from splitmoe.gateway.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    SamplingRequest,
    error_response,
    validation_error,
)
from splitmoe.gateway.request_id import RequestId, RequestIdMiddleware, error_json
from splitmoe.gateway.settings import GatewaySettings
from splitmoe.gateway.tokenize_types import DetokenizeRequest, TokenizeRequest, VersionResponse
from splitmoe.runtime.version import package_version

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must not buffer tokens

router = APIRouter()
VERSION = package_version()


# ----------------------------------------------------------------------------------------- routes

@router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
async def create_chat_completion(raw: Request) -> Response:
    return await generate(raw, "chatcmpl", ChatCompletionRequest, raw.app.state.chat)


@router.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
async def create_completion(raw: Request) -> Response:
    return await generate(raw, "cmpl", CompletionRequest, raw.app.state.completions)


@router.get("/v1/models")
async def list_models(raw: Request) -> Response:
    model: ServedModel = raw.app.state.model
    return to_response(await model.list(RequestId.current().value))


@router.get("/v1/models/{model_id:path}")  # :path: ids may hold slashes (org/name), as OpenAI's and vLLM's do
async def retrieve_model(raw: Request, model_id: str) -> Response:
    model: ServedModel = raw.app.state.model
    return to_response(await model.card(model_id, RequestId.current().value))


# vLLM serves these only when VLLM_ALLOW_RUNTIME_LORA_UPDATING is set; here they are on (behind the API key,
# as every route) unless GatewaySettings.allow_lora_updates is off, which leaves them out: 404, as in vLLM.
lora_router = APIRouter()


@lora_router.post("/v1/load_lora_adapter", openapi_extra=request_body(LoadLoraAdapterRequest))
async def load_lora_adapter(raw: Request) -> Response:
    """vLLM's: a GGUF LoRA adapter loaded on the base model, then served under its name."""
    model: ServedModel = raw.app.state.model
    return await answer(raw, LoadLoraAdapterRequest, model.load_adapter)


@lora_router.post("/v1/unload_lora_adapter", openapi_extra=request_body(UnloadLoraAdapterRequest))
async def unload_lora_adapter(raw: Request) -> Response:
    """vLLM's: the adapter's name no longer served."""
    model: ServedModel = raw.app.state.model
    return await answer(raw, UnloadLoraAdapterRequest, model.unload_adapter)


@router.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
async def tokenize(raw: Request) -> Response:
    """vLLM's: a prompt (text) or messages (a chat) as the model's token ids."""
    tokens: TokensHandler = raw.app.state.tokens
    return await answer(raw, TokenizeRequest, tokens.tokenize)


@router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
async def detokenize(raw: Request) -> Response:
    """vLLM's: token ids as text."""
    tokens: TokensHandler = raw.app.state.tokens
    return await answer(raw, DetokenizeRequest, tokens.detokenize)


@router.get("/version")
async def version() -> Response:
    return to_response(VersionResponse(version=VERSION))


@router.get("/health")
async def health(raw: Request) -> Response:
    ops: OpsHandler = raw.app.state.ops
    return to_response(await ops.health())


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    ops: OpsHandler = raw.app.state.ops
    return Response(content=await ops.metrics_text(), media_type=CONTENT_TYPE)


@router.get("/")
@router.get("/v1")
async def index(raw: Request) -> Response:
    """The URLs `splitmoe up` prints answer: a browser gets the chat page at /, other clients what is
    served here and where the API's routes are."""
    if chat_page.wants_page(raw.scope):
        return chat_page.page()
    model: ServedModel = raw.app.state.model
    try:
        served = await model.resolve(None)
    except AttentionError:  # loading, or the attention service is down: the index still answers
        served = None
    served_routes = router.routes + (lora_router.routes if raw.app.state.settings.allow_lora_updates else [])
    routes = sorted({(method, route.path) for route in served_routes for method in getattr(route, "methods", ())})
    return JSONResponse({"object": "splitmoe.index", "model": served.name if isinstance(served, Served) else None,
                         "openai_base_url": "/v1",
                         "routes": [f"{method} {path.replace(':path', '')}" for method, path in routes]})


async def generate(raw: Request, id_prefix: str, body: type[SamplingRequest], handler: GenerationHandler) -> Response:
    """A generation route: the request's id renamed to its response's (`chatcmpl-<hex>`), its body parsed and
    handed to its handler, which a hang-up cancels."""
    request_id = RequestId.current().rename(id_prefix)
    request = await parse_body(raw, body)
    if isinstance(request, ErrorResponse):
        return to_response(request)
    return to_response(await with_cancellation(raw, handler.create(request, request_id)))


async def answer(raw: Request, body: type[M],
                 handle: Callable[[M, str], Awaitable[BaseModel | ErrorResponse | str]]) -> Response:
    """A plain route: its JSON body parsed and handed, with the request's id, to `handle`."""
    request = await parse_body(raw, body)
    if isinstance(request, ErrorResponse):
        return to_response(request)
    return to_response(await handle(request, RequestId.current().value))


async def parse_body(raw: Request, model: type[M]) -> M | ErrorResponse:
    """The body as `model`; malformed JSON and wrong fields are OpenAI's 400, not FastAPI's 422."""
    try:
        return model.model_validate_json(await raw.body())
    except ValidationError as e:
        return validation_error(e)


def to_response(result: ErrorResponse | BaseModel | dict | str | AsyncIterator[str] | None) -> Response:
    if result is None:  # the client hung up; nobody reads this
        return Response(status_code=499)
    if isinstance(result, ErrorResponse):
        return error_json(result)
    if isinstance(result, str):  # vLLM's plain-text answers (a LoRA adapter loaded or unloaded)
        return PlainTextResponse(result)
    if isinstance(result, BaseModel):
        return Response(content=result.model_dump_json(), media_type="application/json")
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)


async def with_cancellation(raw: Request, work: Awaitable[T]) -> T | None:
    """Run a handler until it returns or the client hangs up; a hang-up cancels it (and its calls).

    Streams are covered by StreamingResponse itself once they start; this covers the wait before
    (queueing, prefill) and whole non-streaming generations. None means the client is gone.
    """
    handler = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait((handler, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not handler.done():
            handler.cancel()
        await asyncio.gather(handler, watcher, return_exceptions=True)
    return None if handler.cancelled() else handler.result()


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


# ----------------------------------------------------------------------------- exception handlers

async def http_exception(raw: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = f"no route {raw.method} {raw.url.path}" if exc.status_code == 404 else str(exc.detail)
    return error_json(error_response(exc.status_code, message), headers=exc.headers)


async def request_validation_exception(raw: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {"msg": "invalid request"}
    return error_json(error_response(400, str(first.get("msg")), code="invalid_value"))


async def internal_exception(raw: Request, exc: Exception) -> JSONResponse:
    request_id = RequestId.current_or_none()
    log.error("%s: unhandled error on %s %s", request_id and request_id.value, raw.method, raw.url.path, exc_info=exc)
    return error_json(error_response(500, "internal error in the gateway"))


# ------------------------------------------------------------------------------------------- app

@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Open the attention client inside the server's event loop and close it on shutdown."""
    settings: GatewaySettings = app.state.settings
    client = AttentionClient(settings)
    model = ServedModel(client, settings.served_model_name)
    admission = Admission(settings.max_generations_per_request, settings.max_generations_in_flight)
    app.state.model = model
    app.state.chat = ChatHandler(client, model, app.state.metrics, admission)
    app.state.completions = CompletionHandler(client, model, app.state.metrics, admission)
    app.state.ops = OpsHandler(client, model, app.state.metrics, admission, timeout_s=settings.health_timeout_s)
    app.state.tokens = TokensHandler(client, model, app.state.metrics, admission)
    try:
        yield
    finally:
        await client.close()


def _untraced(scope: Scope) -> bool:
    return scope.get("path") in PROBE_PATHS


# FastAPI's own OpenTelemetry server span is the gateway's one span per request: it continues a
# client's traceparent, and it is current while the handlers start their gRPC calls, so
# AttentionClient's metadata carries it on. Probes and scrapes are not traced; Prometheus has the metrics.
TELEMETRY = {"tracing": True, "operation_spans": False, "metrics": False, "logs": False, "exclude": _untraced}


def build_app(settings: GatewaySettings) -> FastAPI:
    app = FastAPI(title="SplitMoE gateway", version=VERSION, lifespan=lifespan, telemetry=TELEMETRY,
                  docs_url=None, redoc_url=None)  # docs.py serves /docs on local assets
    app.state.settings = settings
    app.state.metrics = GatewayMetrics()
    app.include_router(router)
    if settings.allow_lora_updates:
        app.include_router(lora_router)
    add_docs(app)
    app.mount(chat_page.STATIC_PATH, StaticFiles(directory=chat_page.STATIC_DIR), name="static")
    app.add_exception_handler(StarletteHTTPException, http_exception)
    app.add_exception_handler(RequestValidationError, request_validation_exception)
    app.add_exception_handler(Exception, internal_exception)
    # Each add wraps the previous: the key is checked before a body is read, the status count sees
    # every answer, and the outermost gives each request its id before anything can answer it.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    if settings.api_key:
        # /health stays open, as llama-server keeps it; /metrics names internal addresses.
        open_paths = PROBE_PATHS if settings.public_metrics else frozenset({"/health"})
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, open_paths=open_paths,
                           is_public=chat_page.is_public)
    app.add_middleware(StatusCountMiddleware, metrics=app.state.metrics)
    app.add_middleware(RequestIdMiddleware)
    return app
