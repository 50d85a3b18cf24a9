"""GET /health and GET /metrics: probes and scrapes, answered from the attention service's stats."""
from __future__ import annotations

from splitmoe.gateway.attention_client import AttentionError
from splitmoe.gateway.handlers.base import Handler
from splitmoe.gateway.openai_types import ErrorResponse, error_response


class OpsHandler(Handler):
    """GET /health (503 while the model loads or an expert service is down) and GET /metrics."""

    async def health(self) -> ErrorResponse | dict:
        try:
            info = await self.model.info()
            if not info.ready:
                return error_response(503, "the model is still loading", code="loading")
            stats = await self.client.stats()
        except AttentionError as e:  # not logged: probes come every few seconds
            return error_response(503, f"attention service unavailable: {e.message}", code="unavailable")
        down = sum(not hop.healthy for hop in stats.hops)
        if down:  # which ones: /metrics, behind the API key (addresses are internal)
            return error_response(503, f"{down} of {len(stats.hops)} expert services unhealthy",
                                  code="expert_unhealthy")
        return {"status": "ok"}

    async def metrics_text(self) -> bytes:
        try:
            stats = await self.client.stats()
        except AttentionError:
            stats = None  # still expose the gateway's own metrics; attention_service_up reads 0
        return self.metrics.render(stats)
