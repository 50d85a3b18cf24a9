"""Prometheus metrics: vLLM's names under the `splitmoe:` prefix, one registry per app.

Latencies and token counts are measured here in the gateway, per request. Scheduler, KV cache and
expert-hop figures belong to the attention service: /metrics asks it (GetStats) at scrape time
and `StatsCollector` exposes that snapshot, so they are never stale by more than one scrape.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from splitmoe.gateway.attention_types import AttentionStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets (v1/metrics/loggers.py), so dashboards built for vLLM read ours unchanged.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                 240.0, 480.0, 960.0, 1920.0, 7680.0)


class GatewayMetrics:
    """Every metric the gateway exposes, registered in its own registry (two apps never collide)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("splitmoe:time_to_first_token_seconds", "Time to the first generated message.",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("splitmoe:inter_token_latency_seconds", "Time between generated tokens of one choice.",
                             buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("splitmoe:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             buckets=E2E_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("splitmoe:prompt_tokens", "Prefilled prompt tokens.", registry=r)
        self.generation_tokens = Counter("splitmoe:generation_tokens", "Generated tokens.", registry=r)
        self.request_success = Counter("splitmoe:request_success", "Finished choices by finish reason.",
                                       ["finished_reason"], registry=r)
        self.http_responses = Counter("splitmoe:http_responses", "HTTP responses by status code.",
                                      ["status"], registry=r)
        self.stats = StatsCollector()
        r.register(self.stats)

    def request_timer(self, clock: Callable[[], float] = time.monotonic) -> "RequestTimer":
        return RequestTimer(self, clock)

    def render(self, stats: AttentionStats | None, num_lora_adapters: int | None = None) -> bytes:
        """The exposition text, with the attention service's figures from `stats` (None: unreachable) and
        the LoRA adapters it has loaded (None: unknown, left out)."""
        self.stats.update(stats, num_lora_adapters)
        return generate_latest(self.registry)


class RequestTimer:
    """One request's latencies: arrival, first message, and each choice's previous message."""

    def __init__(self, metrics: GatewayMetrics, clock: Callable[[], float]) -> None:
        self._metrics = metrics
        self._clock = clock
        self._start_s = clock()
        self._last_s: dict[int, float] = {}

    def on_message(self, choice: int, num_tokens: int) -> None:
        now_s = self._clock()
        if not self._last_s:
            self._metrics.ttft.observe(now_s - self._start_s)
        elif choice in self._last_s:
            # A message may carry several tokens (text held back for a stop string): share the gap.
            share = max(num_tokens, 1)
            for _ in range(share):
                self._metrics.itl.observe((now_s - self._last_s[choice]) / share)
        self._last_s[choice] = now_s

    def finish(self, prompt_tokens: int, completion_tokens: int, finish_reasons: Iterable[str | None]) -> None:
        self._metrics.e2e.observe(self._clock() - self._start_s)
        self._metrics.prompt_tokens.inc(prompt_tokens)
        self._metrics.generation_tokens.inc(completion_tokens)
        for reason in finish_reasons:
            self._metrics.request_success.labels(finished_reason=reason or "unknown").inc()


class StatsCollector(Collector):
    """The attention service's last GetStats answer as Prometheus families."""

    def __init__(self) -> None:
        self._stats: AttentionStats | None = None
        self._num_lora_adapters: int | None = None

    def update(self, stats: AttentionStats | None, num_lora_adapters: int | None = None) -> None:
        self._stats = stats
        self._num_lora_adapters = num_lora_adapters

    def describe(self) -> list[Metric]:
        return []  # families vary with the expert services present; skip the registry's name check

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        yield GaugeMetricFamily("splitmoe:attention_service_up", "1 if the attention service answered GetStats.",
                                value=0 if s is None else 1)
        if self._num_lora_adapters is not None:  # from ModelInfo: adapters served beside the base model
            yield GaugeMetricFamily("splitmoe:lora_adapters_loaded", "LoRA adapters loaded, each served by its name.",
                                    value=self._num_lora_adapters)
        if s is None:
            return
        yield from _scheduler_families(s)
        yield from _hop_families(s)
        tokens = CounterMetricFamily("splitmoe:expert_tokens", "Tokens routed to each expert.",
                                     labels=["layer", "expert"])
        for count in s.expert_tokens:
            tokens.add_metric([str(count.layer), str(count.expert)], count.tokens)
        yield tokens
        yield from _heat_families(s)
        yield from _device_families(s)


def _device_families(s: AttentionStats) -> Iterator[Metric]:
    """On a GPU: its memory by use (weights, kv_cache, gpu_experts, graphs, workspace, reserved,
    capacity; pinned_host is host memory the hops hold page-locked)."""
    if not s.device_memory:
        return
    memory = GaugeMetricFamily("splitmoe:gpu_memory_bytes", "Attention GPU memory by use, in bytes.",
                               labels=["kind", "device"])
    for m in s.device_memory:
        memory.add_metric([m.kind, s.device], m.bytes)
    yield memory


def _heat_families(s: AttentionStats) -> Iterator[Metric]:
    heat = GaugeMetricFamily("splitmoe:expert_heat_tokens_per_second",
                             "Decayed rate of tokens the router sends each expert (what placement by load follows).",
                             labels=["layer", "expert"])
    replicas = GaugeMetricFamily("splitmoe:expert_replicas",
                                 "Expert services computing each expert (0: the attention process computes it).",
                                 labels=["layer", "expert"])
    for e in s.expert_heat:
        labels = [str(e.layer), str(e.expert)]
        heat.add_metric(labels, e.tokens_per_s)
        replicas.add_metric(labels, sum(where != "local" for where in e.placed_on))
    yield heat
    yield replicas
    yield GaugeMetricFamily("splitmoe:expert_imbalance",
                            "Max over mean tokens per expert service per layer call, since the last rebalance.",
                            value=s.expert_imbalance)


def _scheduler_families(s: AttentionStats) -> Iterator[Metric]:
    yield GaugeMetricFamily("splitmoe:num_requests_running", "Sequences in the running batch.", value=s.num_running)
    yield GaugeMetricFamily("splitmoe:num_requests_waiting", "Requests queued for admission.", value=s.num_waiting)
    yield GaugeMetricFamily("splitmoe:kv_cache_usage_perc", "KV cache usage, 1 means 100 percent.",
                            value=s.kv_cache_usage)
    # vLLM's cache_config_info: the cache's settings as labels of a constant 1
    config = GaugeMetricFamily("splitmoe:cache_config_info", "The KV cache's configuration.",
                               labels=["cache_dtype", "num_tokens", "bytes_per_token"])
    config.add_metric([s.kv_cache_dtype, str(s.kv_cache_tokens), str(s.kv_cache_bytes_per_token)], 1)
    yield config
    yield GaugeMetricFamily("splitmoe:kv_cache_capacity_tokens", "Tokens the KV cache holds, over all sequences.",
                            value=s.kv_cache_tokens)
    yield GaugeMetricFamily("splitmoe:max_batch_seqs", "Most sequences batched in one scheduler step.",
                            value=s.max_batch_seqs_seen)
    yield GaugeMetricFamily("splitmoe:max_batch_tokens", "Most tokens batched in one scheduler step.",
                            value=s.max_batch_tokens_seen)
    yield CounterMetricFamily("splitmoe:scheduler_steps", "Scheduler steps run.", value=s.num_steps)
    # vLLM's pair: the hit rate is rate(hits) / rate(queries)
    yield CounterMetricFamily("splitmoe:prefix_cache_queries", "Prefix cache queries, in tokens (admitted requests).",
                              value=s.prefix_cache_queries)
    yield CounterMetricFamily("splitmoe:prefix_cache_hits", "Prefix cache hits, in tokens (not computed).",
                              value=s.prefix_cache_hits)
    # vLLM's speculative decoding counters: the acceptance rate is rate(accepted) / rate(draft tokens)
    yield CounterMetricFamily("splitmoe:spec_decode_num_drafts", "Drafts verified (speculative decoding).",
                              value=s.spec_num_drafts)
    yield CounterMetricFamily("splitmoe:spec_decode_num_draft_tokens", "Drafted tokens verified.",
                              value=s.spec_num_draft_tokens)
    yield CounterMetricFamily("splitmoe:spec_decode_num_accepted_tokens", "Drafted tokens accepted.",
                              value=s.spec_num_accepted_tokens)
    per_position = CounterMetricFamily("splitmoe:spec_decode_num_accepted_tokens_per_pos",
                                       "Drafted tokens accepted, by position in the draft.", labels=["position"])
    for position, accepted in enumerate(s.spec_accepted_per_position):
        per_position.add_metric([str(position)], accepted)
    yield per_position


def _hop_families(s: AttentionStats) -> Iterator[Metric]:
    labels = ["address"]
    families = {
        "hop_s_total": CounterMetricFamily("splitmoe:expert_hop_seconds", "Wall time of expert hops.", labels=labels),
        "compute_s_total": CounterMetricFamily("splitmoe:expert_compute_seconds",
                                               "Expert compute time inside hops.", labels=labels),
        "num_hops": CounterMetricFamily("splitmoe:expert_hops", "Expert hops (one per MoE layer and step).",
                                        labels=labels),
        "bytes_total": CounterMetricFamily("splitmoe:expert_hop_bytes", "Bytes sent and received in hops.",
                                           labels=labels),
    }
    healthy = GaugeMetricFamily("splitmoe:expert_service_healthy", "1 if the expert service is healthy.",
                                labels=labels)
    transport = GaugeMetricFamily("splitmoe:expert_service_transport",
                                  "1 for the transport each expert service is reached over now.",
                                  labels=["address", "transport"])
    for hop in s.hops:
        for field, family in families.items():
            family.add_metric([hop.address], getattr(hop, field))
        healthy.add_metric([hop.address], 1 if hop.healthy else 0)
        if hop.transport:
            transport.add_metric([hop.address, hop.transport], 1)
    yield from families.values()
    yield healthy
    yield transport
    yield GaugeMetricFamily("splitmoe:expert_layers_uncovered",
                            "MoE layers with an expert no healthy expert service hosts (no replica left).",
                            value=len(s.uncovered_layers))
