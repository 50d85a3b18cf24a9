"""One request, one trace: gateway span -> attention spans -> expert spans, across real gRPC hops.

The three servers run in this process, on real loopback sockets, so that one SDK in-memory
exporter sees every span; context crosses each hop in gRPC metadata exactly as between processes.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict

import httpx
import pytest
import uvicorn
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from splitmoe.attention_service.expert_backends.remote import RemoteExpertsSettings
from splitmoe.attention_service.server import serve as serve_attention
from splitmoe.attention_service.settings import AttentionSettings
from splitmoe.expert_service.server import ExpertServer
from splitmoe.expert_service.settings import ExpertServiceSettings
from splitmoe.expert_service.shard import HostedShard
from splitmoe.gateway.app import build_app
from splitmoe.gateway.settings import GatewaySettings
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.runtime.telemetry import setup_tracing
from tests.support.processes import CLUSTER, free_port, wait_grpc_serving


@pytest.fixture(scope="module")
def spans():
    exporter = InMemorySpanExporter()
    setup_tracing("splitmoe-test", extra_processors=[SimpleSpanProcessor(exporter)])
    return exporter


@pytest.fixture(scope="module")
def stack(spans, demo_gguf):
    model = demo_gguf
    expert_port, attention_port, gateway_port = free_port(), free_port(), free_port()
    experts = ExpertServer(ExpertServiceSettings(model_path=model, port=expert_port, security=CLUSTER),
                           HostedShard(GGUFFile(model)))
    experts.start()
    stop_attention = threading.Event()
    attention = threading.Thread(target=lambda: asyncio.run(serve_attention(
        AttentionSettings(model_path=str(model), port=attention_port, security=CLUSTER,
                          experts=RemoteExpertsSettings(addresses=(f"127.0.0.1:{expert_port}",), security=CLUSTER)), external_stop=stop_attention)))
    attention.start()
    wait_grpc_serving(f"127.0.0.1:{attention_port}", 60)
    app = build_app(GatewaySettings(attention_address=f"127.0.0.1:{attention_port}", port=gateway_port,
                                    cluster=CLUSTER))
    gateway = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=gateway_port, log_level="warning"))
    gateway_thread = threading.Thread(target=gateway.run)
    gateway_thread.start()
    url = f"http://127.0.0.1:{gateway_port}"
    deadline = time.monotonic() + 30
    while not gateway.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield url
    gateway.should_exit = True
    gateway_thread.join(10)
    stop_attention.set()
    attention.join(10)
    experts.stop()


def test_one_request_is_one_trace_across_all_three_services(stack, spans):
    spans.clear()
    response = httpx.post(stack + "/v1/chat/completions", timeout=60, json={
        "model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert response.status_code == 200, response.text
    time.sleep(0.2)  # the last expert spans end as their responses leave
    by_trace = defaultdict(list)
    for span in spans.get_finished_spans():
        by_trace[span.context.trace_id].append(span)
    services = {tid: {s.instrumentation_scope.name for s in group} for tid, group in by_trace.items()}
    complete = [tid for tid, names in services.items()
                if any("gateway" in n or "fastapi" in n for n in names)
                and "splitmoe.attention" in names and any("expert" in n for n in names)]
    assert complete, f"no trace has gateway, attention and expert spans: {services}"
    names = {s.name for s in by_trace[complete[0]]}
    assert {"POST /v1/chat/completions", "attention.generate", "attention.prefill_step", "attention.decode_step",
            "expert.forward"} <= names
    # 3 steps (a prefill, 2 decodes) x 2 MoE layers of the demo model, each one expert call
    assert sum(s.name == "expert.forward" for s in by_trace[complete[0]]) == 6
