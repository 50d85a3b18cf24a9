"""GET /health and GET /metrics: probes and scrapes, answered from the attention service's stats.

Both wait for the attention service at most `timeout_s` (a second, less than probes' own
deadlines): it answers GetStats from what it already knows of its expert services (health kept
by keepalive and hop deadlines, token counts asked with a short deadline), so a silent expert
host cannot hold a probe, nor be blamed on the attention service.
"""
from __future__ import annotations

import asyncio
import logging

from splitmoe.gateway.attention_client import AttentionError
from splitmoe.gateway.attention_types import AttentionStats, HopStats
from splitmoe.gateway.handlers.base import Handler
from splitmoe.gateway.openai_types import ErrorResponse, error_response

log = logging.getLogger("splitmoe.gateway")


class OpsHandler(Handler):
    """GET /health: 503 while the model loads or some expert has no healthy service left; 200
    `degraded` while replicas stand in for an unhealthy service. GET /metrics."""

    def __init__(self, *args, timeout_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_s = timeout_s  # GatewaySettings.health_timeout_s
        self._logged_down = ""  # the unhealthy services last logged: each change is logged once

    async def health(self) -> ErrorResponse | dict:
        """Says how many expert services are down, never which: their addresses are internal. The
        log names them (when that changes), and /metrics, behind the API key, labels them."""
        try:
            async with asyncio.timeout(self.timeout_s):
                info = await self.model.info()
                if not info.ready:
                    return error_response(503, "the model is still loading", code="loading")
                stats = await self.client.stats(self.timeout_s)
        except TimeoutError:
            return error_response(503, f"attention service unavailable: no answer within {self.timeout_s:g} s",
                                  code="unavailable")
        except AttentionError as e:  # not logged: probes come every few seconds
            return error_response(503, f"attention service unavailable: {e.message}", code="unavailable")
        down = [hop for hop in stats.hops if not hop.healthy]
        self._log_change(down)
        if not down:
            return {"status": "ok"}
        summary = f"{len(down)} of {len(stats.hops)} expert services unhealthy"
        if stats.uncovered_layers:
            return error_response(503, summary, code="expert_unhealthy")
        return {"status": "degraded", "message": f"{summary}, replicas serve their experts"}

    def _log_change(self, down: list[HopStats]) -> None:
        which = describe(down)
        if which != self._logged_down:
            self._logged_down = which
            if which:
                log.warning("expert services unhealthy: %s", which)
            else:
                log.info("every expert service healthy again")

    async def metrics_text(self) -> bytes:
        stats, num_adapters = await asyncio.gather(self._stats(), self._num_lora_adapters())
        return self.metrics.render(stats, num_adapters)

    async def _num_lora_adapters(self) -> int | None:
        """None while the attention service is loading or does not answer within the probes' time."""
        try:
            async with asyncio.timeout(self.timeout_s):
                info = await self.model.fresh_info()
        except (TimeoutError, AttentionError):
            return None
        return len(info.lora_adapters) if info.ready else None

    async def _stats(self) -> AttentionStats | None:
        try:
            return await self.client.stats(self.timeout_s)
        except AttentionError:
            return None  # still expose the gateway's own metrics; attention_service_up reads 0


def describe(hops: list[HopStats]) -> str:
    return "; ".join(f"{hop.address} ({hop.last_error or 'unhealthy'})" for hop in hops)
