"""The gateway's operations side end to end: startup, /health, a full queue, a dead expert service, metrics.

Real processes on loopback: `splitmoe serve-gateway` -> `splitmoe serve-attention` (the demo model,
one running and one waiting request at most) -> two `splitmoe serve-experts`, each the only host of
half the experts. Every state is reached by its real cause: the gateway starts before the attention
service (503, down), the attention service waits for expert services that do not answer (503, loading),
concurrent long requests fill the queue (429), kill -9 takes an expert service away (an error
event mid-stream, 503 in /health), and so does loading another shard into one (503 in /health).
"""
from __future__ import annotations

import json
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from splitmoe.demo_model import DemoShape
from splitmoe.proto import expert_pb2, expert_pb2_grpc
from tests.support.expert_services import ExpertServices
from tests.support.gateway_http import (
    assert_openai_error,
    metric,
    running_gateway,
    samples,
    wait_http,
    wait_until_idle,
)
from tests.support.processes import cluster_channel, free_port, spawn, stop

pytestmark = pytest.mark.stack  # the gateway and the services as real processes

MODEL = "demo"                      # the served name: the stem of conftest's demo.gguf
EXPERT_TIMEOUT_S = 2.0
SHAPE = DemoShape()                 # the demo model's shape: layers, experts, experts per token
HALVES = {"low": f"0-{SHAPE.num_experts // 2 - 1}", "high": f"{SHAPE.num_experts // 2}-{SHAPE.num_experts - 1}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Why is the sky blue?"}]}
SHORT = {**CHAT, "ignore_eos": True, "temperature": 0}     # exactly max_tokens tokens
LONG = {**SHORT, "max_tokens": 1900}                        # runs for many seconds


@dataclass(frozen=True)
class Stack:
    url: str
    experts: ExpertServices
    startup: dict[str, dict[str, httpx.Response]]   # what the gateway answered before the stack was up
    attention: subprocess.Popen
    gateway_log: Path


def probe(url: str) -> dict[str, httpx.Response]:
    return {"health": httpx.get(f"{url}/health", timeout=10), "models": httpx.get(f"{url}/v1/models", timeout=10),
            "chat": httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=10),
            "metrics": httpx.get(f"{url}/metrics", timeout=10)}


def is_loading(response: httpx.Response) -> bool:
    return response.status_code == 503 and response.json()["error"]["code"] == "loading"


@pytest.fixture(scope="module")
def stack(demo_gguf, tmp_path_factory) -> Stack:
    """Expert services and the gateway first, then the attention service, probing the gateway on the way."""
    log_dir = tmp_path_factory.mktemp("operations")
    experts = ExpertServices(log_dir)
    for name, span in HALVES.items():
        experts.start(name, demo_gguf, "--experts", span)
    port, startup = free_port(), {}
    try:
        with running_gateway(port, log_dir / "splitmoe.gateway.log") as url:
            startup["down"] = probe(url)
            experts.wait()
            for name in HALVES:
                # Hung (SIGSTOP) but listening: the attention service's connections wait in the backlog
                # instead of being refused, so it loads as soon as they are resumed.
                experts.pause(name)
            attention = spawn(["serve-attention", str(demo_gguf), "--port", str(port), "--max-running", "1",
                               "--max-waiting", "1", "--expert-timeout-s", str(EXPERT_TIMEOUT_S), "--expert-services",
                               ",".join(experts.address(n) for n in HALVES)], log_dir / "attention.log")
            try:
                wait_http(url + "/health", attention, is_loading)
                startup["loading"] = probe(url)
                for name in HALVES:
                    experts.resume(name)
                wait_http(url + "/health", attention, lambda r: r.status_code == 200)
                yield Stack(url, experts, startup, attention, log_dir / "splitmoe.gateway.log")
            except Exception:
                print((log_dir / "attention.log").read_text(errors="replace")[-4000:])
                raise
            finally:
                stop(attention)
    finally:
        experts.stop_all()


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


def hop_label(stack: Stack, name: str) -> str:
    return f'{{address="{stack.experts.address(name)}"}}'


# ---------------------------------------------------------------------------------------- startup

def test_503_while_the_attention_service_is_down(stack):
    down = stack.startup["down"]
    health = assert_openai_error(down["health"], 503, "service_unavailable_error")
    assert health["code"] == "unavailable" and "attention service unavailable" in health["message"]
    assert_openai_error(down["models"], 503, "service_unavailable_error")
    assert_openai_error(down["chat"], 503, "service_unavailable_error")
    for name in ("health", "models", "chat"):  # gRPC's connection error names the address: the log's only
        assert "127.0.0.1" not in down[name].text and "ipv4" not in down[name].text
    assert down["metrics"].status_code == 200  # the gateway's own metrics, and that the service is missing
    assert metric(down["metrics"].text, "splitmoe:attention_service_up") == 0


def test_503_while_the_model_is_loading(stack):
    loading = stack.startup["loading"]
    assert "loading" in assert_openai_error(loading["health"], 503, "service_unavailable_error")["message"]
    assert "loading" in assert_openai_error(loading["models"], 503, "service_unavailable_error")["message"]
    assert "loading" in assert_openai_error(loading["chat"], 503, "service_unavailable_error")["message"]


def test_healthy_once_every_expert_service_answers(http, stack):
    assert http.get("/health").json() == {"status": "ok"}
    text = http.get("/metrics").text
    assert metric(text, "splitmoe:attention_service_up") == 1
    for name in HALVES:
        assert metric(text, f"splitmoe:expert_service_healthy{hop_label(stack, name)}") == 1


# ---------------------------------------------------------------------------------------- metrics

def test_hops_and_tokens_per_expert_are_counted(http, stack):
    before = http.get("/metrics").text
    prompt = list(range(40, 80))
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200, r.text
    after = http.get("/metrics").text
    for name in HALVES:  # 40 prompt tokens route to both halves of the experts
        label = hop_label(stack, name)
        hops = f"splitmoe:expert_hops_total{label}"
        assert metric(after, hops) > metric(before, hops)
        assert metric(after, f"splitmoe:expert_hop_seconds_total{label}") > 0
        assert metric(after, f"splitmoe:expert_hop_bytes_total{label}") > 0
    routed = sum(samples(after, "splitmoe:expert_tokens_total").values())
    routed -= sum(samples(before, "splitmoe:expert_tokens_total").values())
    # Every token fed through the model (the prompt, then each sampled token but the last) picks K experts per layer.
    assert routed == SHAPE.num_layers * SHAPE.num_experts_used * (len(prompt) + 4 - 1)


# --------------------------------------------------------------------------------------- overload

def test_probes_answer_within_their_deadline_while_the_attention_service_hangs(http, stack):
    stack.attention.send_signal(signal.SIGSTOP)  # listening, answering nothing
    try:
        for path in ("/health", "/metrics"):
            start_s = time.monotonic()
            answer = http.get(path)
            assert time.monotonic() - start_s < 1.5, path  # --health-timeout-s 0.8, not the 5 s probe deadline
            if path == "/health":
                assert assert_openai_error(answer, 503, "service_unavailable_error")["code"] == "unavailable"
            else:
                assert metric(answer.text, "splitmoe:attention_service_up") == 0
    finally:
        stack.attention.send_signal(signal.SIGCONT)
    wait_http(stack.url + "/health", None, lambda r: r.status_code == 200, timeout_s=30)


def test_a_full_queue_is_429_and_the_queued_request_still_runs(http, client, stack):
    with http.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as running:
        events = running.iter_lines()  # kept: dropping the iterator would close the connection
        assert next(events).startswith("data: ")  # the first token came: it holds the one slot
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(httpx.post, f"{stack.url}/v1/chat/completions", timeout=60,
                                 json={**SHORT, "max_tokens": 2})
            deadline = time.monotonic() + 10
            while metric(http.get("/metrics").text, "splitmoe:num_requests_waiting") < 1:
                assert time.monotonic() < deadline and not queued.done(), "the second request was not queued"
                time.sleep(0.02)
            full = assert_openai_error(http.post("/v1/chat/completions", json=CHAT), 429, "rate_limit_error")
            assert "queue is full" in full["message"]
            with pytest.raises(openai.RateLimitError):
                client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=1)
            running.close()  # the client leaves: its slot goes to the queued request
            done = queued.result(timeout=60)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2
    wait_until_idle(http)


# ------------------------------------------------------------------------------ expert failure

def test_an_expert_service_killed_mid_stream(http, stack):
    with http.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        stack.experts.kill("high")  # kill -9: the only host of experts 4-7
        killed = time.monotonic()
        events = [line[len("data: "):] for line in lines if line]
    assert time.monotonic() - killed < EXPERT_TIMEOUT_S + 10
    assert r.status_code == 200 and events[-1] == "[DONE]"  # the status went out with the first token
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable_error" and "expert" in error["message"].lower()
    assert stack.experts.address("high") not in events[-2] and error["request_id"].startswith("chatcmpl-")
    try:
        assert_dead_expert_is_reported(http, stack)
    finally:
        stack.experts.restart("high")
    wait_http(stack.url + "/health", None, lambda r: r.status_code == 200, timeout_s=30)
    out = http.post("/v1/chat/completions", json={**SHORT, "max_tokens": 3})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3


def assert_dead_expert_is_reported(http: httpx.Client, stack: Stack) -> None:
    health = assert_openai_error(http.get("/health"), 503, "service_unavailable_error")
    assert health["code"] == "expert_unhealthy"
    # How many, never which: the address is internal (the gateway's log and /metrics name it)
    assert health["message"] == "1 of 2 expert services unhealthy"
    assert stack.experts.address("high") not in str(health)
    assert f"expert services unhealthy: {stack.experts.address('high')} (" in stack.gateway_log.read_text()
    text = http.get("/metrics").text
    assert metric(text, f"splitmoe:expert_service_healthy{hop_label(stack, 'high')}") == 0
    assert metric(text, f"splitmoe:expert_service_healthy{hop_label(stack, 'low')}") == 1
    # A new request needs the dead service's experts: 503 before any token, not a 500, and no address.
    refused = http.post("/v1/chat/completions", json=CHAT)
    assert_openai_error(refused, 503, "service_unavailable_error")
    assert stack.experts.address("high") not in refused.text


def test_health_is_503_while_an_expert_service_hosts_less_than_the_placement_needs(http, stack):
    high = stack.experts.address("high")
    with cluster_channel(high) as channel:
        stub = expert_pb2_grpc.ExpertServiceStub(channel)
        layers = list(stub.DescribeShard(expert_pb2.DescribeShardRequest(), timeout=10).layers)
        stub.LoadShard(expert_pb2.LoadShardRequest(layers=layers, experts=[0]), timeout=10)  # not ours: 4-7 lost
        try:
            health = wait_http(stack.url + "/health", None, lambda r: r.status_code != 200, timeout_s=15)
            assert assert_openai_error(health, 503, "service_unavailable_error")["code"] == "expert_unhealthy"
            assert_openai_error(http.post("/v1/chat/completions", json=CHAT), 503, "service_unavailable_error")
        finally:
            stub.LoadShard(expert_pb2.LoadShardRequest(), timeout=10)  # emptied: the attention service refills it
        wait_http(stack.url + "/health", None, lambda r: r.status_code == 200, timeout_s=30)
        refilled = stub.DescribeShard(expert_pb2.DescribeShardRequest(), timeout=10)
    assert list(refilled.experts) == list(range(SHAPE.num_experts // 2, SHAPE.num_experts))
    out = http.post("/v1/chat/completions", json={**SHORT, "max_tokens": 3})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
