"""`serve-experts --metrics-port`: how busy this expert service is, for Prometheus and the autoscaler.

Read at each scrape from what the service keeps anyway (the shard's totals, the hop handler's
lanes), so a hop pays nothing for it. `rate(splitmoe_expert_compute_seconds_total[1m])` is the
share of the time the expert kernels were computing: the signal deploy/kubernetes/base/
autoscaling.yaml scales on (through prometheus-adapter). Counts only: no address, no token, no
request content, so the port needs no secret; the network policy admits Prometheus to it alone.
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from splitmoe.expert_service.hops import HopHandler
from splitmoe.expert_service.shard import HostedShard


class ExpertMetrics(Collector):
    """The figures of one expert service, read when scraped."""

    def __init__(self, hosted: HostedShard, hops: HopHandler, draining: Callable[[], bool]):
        self._hosted, self._hops, self._draining = hosted, hops, draining

    def collect(self) -> Iterator[Metric]:
        totals = self._hosted.totals()
        described = self._hosted.describe()
        yield CounterMetricFamily("splitmoe_expert_compute_seconds", "Seconds the expert kernels computed hops "
                                  "(its rate: the share of the time this service is busy)", value=totals.compute_s)
        yield CounterMetricFamily("splitmoe_expert_hops", "Hops (layer calls) answered", value=totals.num_requests)
        yield GaugeMetricFamily("splitmoe_expert_hops_in_progress", "Hops being computed now (queue depth: "
                                "links whose hop is in the kernels)", value=self._hops.num_computing())
        yield GaugeMetricFamily("splitmoe_expert_links", "Attention-service links open (streams and shared-memory "
                                "connections)", value=self._hops.num_lanes())
        yield GaugeMetricFamily("splitmoe_expert_hosted_pairs", "(layer, expert) pairs hosted",
                                value=sum(len(experts) for _, experts in described.by_layer))
        yield GaugeMetricFamily("splitmoe_expert_hosted_bytes", "Expert weight bytes hosted", value=described.num_bytes)
        yield GaugeMetricFamily("splitmoe_expert_draining", "1 while told to stop and handing its experts over",
                                value=1.0 if self._draining() else 0.0)


def serve_metrics(host: str, port: int, metrics: ExpertMetrics) -> int:
    """Serve /metrics on host:port in a thread of its own (prometheus_client's server); the bound port."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(metrics)
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server.server_address[1]
