"""OpenAI's server-sent events: one `data:` line per chunk, a failure as one more chunk, then [DONE]."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from pydantic import BaseModel

from splitmoe.gateway.attention_client import AttentionError
from splitmoe.gateway.failures import failed, with_request_id
from splitmoe.gateway.openai_types import error_response

log = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"


def sse_line(payload: BaseModel, exclude: set[str] | None = None) -> str:
    return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"


async def sse_stream(chunks: AsyncIterator[BaseModel], include_usage: bool, request_id: str) -> AsyncIterator[str]:
    """OpenAI's SSE framing: `data: {chunk}` lines, an error as one more chunk, then [DONE]."""
    exclude = None if include_usage else {"usage"}  # OpenAI sends "usage": null only when asked for usage
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield sse_line(chunk, exclude)
    except AttentionError as e:
        yield sse_line(failed(request_id, e))
    except Exception:
        log.exception("%s: stream failed", request_id)
        yield sse_line(with_request_id(error_response(500, "internal error in the gateway"), request_id))
    yield SSE_DONE
