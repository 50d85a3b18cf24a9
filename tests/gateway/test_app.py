"""The HTTP app on a real port against a fake attention service: statuses, SSE, auth, limits, health, metrics."""
import json
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
import uvicorn
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.app import build_app
from gateway.settings import GatewaySettings
from tests.gateway import fake_attention
from splitmoe.telemetry import setup_tracing
from tests.support.processes import free_port

CHAT = {"messages": [{"role": "user", "content": "hello there"}]}


@contextmanager
def running_gateway(attention_port: int, **settings):
    port = free_port()
    app = build_app(GatewaySettings(attention_address=f"127.0.0.1:{attention_port}", port=port, **settings))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, loop="uvloop", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "gateway did not start"
        time.sleep(0.01)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            yield http
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def attention():
    server, fake, port = fake_attention.start()
    yield fake, port
    server.stop(None)


@pytest.fixture
def fake(attention):
    fake = attention[0]
    fake.ready, fake.unhealthy = True, []
    fake.requests.clear()
    fake.traceparents.clear()
    fake.cancelled.clear()
    return fake


@pytest.fixture(scope="module")
def http(attention):
    with running_gateway(attention[1], max_body_bytes=4096) as client:
        yield client


def api_base(http: httpx.Client) -> str:
    return str(http.base_url).rstrip("/") + "/v1"


def sse_events(response: httpx.Response) -> list[str]:
    text = response.read().decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    return [e[len("data: "):] for e in events]


def assert_openai_error(response: httpx.Response, status: int, error_type: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == error_type
    assert error["message"]
    return error


def assert_still_serving(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == " t0 t1"


# ------------------------------------------------------------------------------------------- chat

def test_chat_completion(http, fake):
    r = http.post("/v1/chat/completions", json={**CHAT, "model": "fake-moe", "max_tokens": 3, "stop": " t2"})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion" and body["model"] == "fake-moe"
    assert body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": " t0 t1", "refusal": None},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    [request] = fake.requests
    assert request.chat.messages[0].content == "hello there" and list(request.sampling.stop) == [" t2"]
    assert request.request_id == body["id"]


def test_chat_stream_is_openai_sse(http, fake):
    body = {**CHAT, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "fake-moe" and c["created"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1]) == " t0 t1 t2"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_openai_client_streams_chat_with_n_and_seeds(http, fake):
    client = openai.OpenAI(base_url=api_base(http), api_key="unused")
    stream = client.chat.completions.create(model="fake-moe", messages=CHAT["messages"], max_tokens=2, n=3, seed=7,
                                            stream=True, stream_options={"include_usage": True})
    texts, finishes, usage = ["", "", ""], {}, None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert texts == [" t0 t1"] * 3 and finishes == {0: "length", 1: "length", 2: "length"}
    assert usage.prompt_tokens == 2 and usage.completion_tokens == 6
    assert sorted(r.sampling.seed for r in fake.requests) == [7, 8, 9]


def test_chat_logprobs(http, fake):
    r = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 1})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"]) for c in content] == [(" t0", -0.5), (" t1", -1.5)]
    assert content[1]["top_logprobs"] == [{"token": " t1", "logprob": -1.5, "bytes": list(b" t1")}]


# ------------------------------------------------------------------------------------ completions

def test_completion_scoring_with_token_ids_echo_and_max_tokens_0(http, fake):
    body = {"prompt": [11, 12, 13], "max_tokens": 0, "echo": True, "logprobs": 1}
    r = http.post("/v1/completions", json=body).json()
    [choice] = r["choices"]
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-")
    assert choice["text"] == "<11> <12> <13>" and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["<11>", " <12>", " <13>"] and lp["text_offset"] == [0, 4, 9]
    assert lp["token_logprobs"] == [None, -1.0, -2.0]
    assert lp["top_logprobs"] == [None, {"x": -0.25, " <12>": -1.0}, {"x": -0.25, " <13>": -2.0}]
    assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
    assert [type(q).__name__ for q in fake.requests] == ["ScoreRequest"]  # nothing generated


def test_completion_echo_then_generation_with_logprobs(http, fake):
    r = http.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2, "echo": True, "logprobs": 0}).json()
    [choice] = r["choices"]
    assert choice["text"] == "a b t0 t1"
    assert choice["logprobs"]["tokens"] == ["a", " b", " t0", " t1"]
    assert choice["logprobs"]["text_offset"] == [0, 1, 3, 6]
    assert choice["logprobs"]["token_logprobs"][0] is None


def test_completion_stream_with_several_prompts(http, fake):
    body = {"prompt": ["a", "b c"], "max_tokens": 2, "stream": True, "echo": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        assert c["object"] == "text_completion"
        texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert texts == {0: "a t0 t1", 1: "b c t0 t1"}
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_openai_client_completions(http, fake):
    client = openai.OpenAI(base_url=api_base(http), api_key="unused")
    out = client.completions.create(model="fake-moe", prompt=[1, 2], max_tokens=0, echo=True, logprobs=0)
    assert out.choices[0].logprobs.tokens == ["<1>", " <2>"] and out.usage.prompt_tokens == 2


# ----------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("path, content, status, error_type", [
    ("/v1/chat/completions", b'{"messages": [', 400, "invalid_request_error"),
    ("/v1/chat/completions", b"", 400, "invalid_request_error"),
    ("/v1/chat/completions", json.dumps({**CHAT, "max_tokens": -1}).encode(), 400, "invalid_request_error"),
    ("/v1/chat/completions", json.dumps({**CHAT, "temperature": "x"}).encode(), 400, "invalid_request_error"),
    ("/v1/chat/completions", json.dumps({**CHAT, "model": "gpt-4"}).encode(), 404, "not_found_error"),
    ("/v1/completions", json.dumps({"prompt": "x", "n": 0}).encode(), 400, "invalid_request_error"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "TOO_LONG"}]}).encode(),
     400, "invalid_request_error"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "BUSY"}]}).encode(),
     429, "rate_limit_error"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "DOWN"}]}).encode(),
     503, "service_unavailable_error"),
    ("/v1/completions", json.dumps({"prompt": "CRASH", "stream": True}).encode(), 500, "server_error"),
    ("/v1/nothing-here", b"{}", 404, "not_found_error"),
    ("/v1/chat/completions", b"x" * 5000, 413, "invalid_request_error"),
])
def test_errors_are_openai_json_and_the_server_keeps_serving(http, fake, path, content, status, error_type):
    error = assert_openai_error(http.post(path, content=content), status, error_type)
    assert "secret" not in error["message"]
    assert_still_serving(http)


def test_user_facing_messages_and_params(http, fake):
    too_long = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "TOO_LONG"}]})
    assert "maximum context length" in too_long.json()["error"]["message"]
    negative = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": -1}).json()["error"]
    assert negative["param"] == "max_tokens"
    unknown = http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"}).json()["error"]
    assert unknown["code"] == "model_not_found" and "gpt-4" in unknown["message"]


def test_a_chunked_body_over_the_limit_is_413(http, fake):
    r = http.post("/v1/chat/completions", content=iter([b"{" + b" " * 3000, b" " * 3000 + b"}"]))
    assert_openai_error(r, 413, "invalid_request_error")
    assert_still_serving(http)


def test_a_failure_mid_stream_ends_with_an_error_event(http, fake):
    body = {"messages": [{"role": "user", "content": "MIDFAIL"}], "stream": True, "max_tokens": 5}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable_error" and "died" in error["message"]
    assert_still_serving(http)


def test_openai_client_raises_its_typed_errors(http, fake):
    client = openai.OpenAI(base_url=api_base(http), api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="fake-moe", messages=CHAT["messages"], max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=CHAT["messages"])
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="fake-moe", messages=[{"role": "user", "content": "BUSY"}])


# ---------------------------------------------------------------------------------- disconnection

def test_a_client_leaving_a_stream_cancels_its_generation(http, fake):
    body = {"messages": [{"role": "user", "content": "SLOW"}], "stream": True, "max_tokens": 500}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    assert fake.cancelled.wait(5), "the generation went on after the client left"
    assert_still_serving(http)


def test_a_client_leaving_a_non_streaming_request_cancels_it(http, fake):
    body = {"messages": [{"role": "user", "content": "SLOW"}], "max_tokens": 500}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json=body, timeout=0.3)
    assert fake.cancelled.wait(5), "the generation went on after the client left"


# ----------------------------------------------------------------------------- models, health, auth

def test_models_list(http, fake):
    r = http.get("/v1/models").json()
    assert r["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in r["data"]] == [("fake-moe", "model", 64)]


def test_served_model_name_replaces_the_model_id(attention, fake):
    with running_gateway(attention[1], served_model_name="alias") as http:
        assert http.get("/v1/models").json()["data"][0]["id"] == "alias"
        assert http.post("/v1/chat/completions", json={**CHAT, "model": "alias", "max_tokens": 1}).status_code == 200
        assert_openai_error(http.post("/v1/chat/completions", json={**CHAT, "model": "fake-moe"}), 404,
                            "not_found_error")


def test_health_follows_loading_and_expert_health(attention, fake):
    fake.ready = False
    with running_gateway(attention[1]) as http:
        assert "loading" in assert_openai_error(http.get("/health"), 503, "service_unavailable_error")["message"]
        assert_openai_error(http.post("/v1/chat/completions", json=CHAT), 503, "service_unavailable_error")
        fake.ready = True
        assert http.get("/health").status_code == 200
        fake.unhealthy = ["127.0.0.1:7002"]
        error = assert_openai_error(http.get("/health"), 503, "service_unavailable_error")
        assert "127.0.0.1:7002" in error["message"] and "7001" not in error["message"]


def test_attention_service_down(fake):
    with running_gateway(free_port(), request_timeout_s=5) as http:
        assert_openai_error(http.get("/health"), 503, "service_unavailable_error")
        assert_openai_error(http.post("/v1/chat/completions", json=CHAT), 503, "service_unavailable_error")
        metrics = http.get("/metrics")
        assert metrics.status_code == 200 and "splitmoe:attention_service_up 0.0" in metrics.text


def test_metrics(http, fake):
    http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3})
    text = http.get("/metrics").text
    for line in ("splitmoe:num_requests_running 1.0", "splitmoe:num_requests_waiting 0.0",
                 "splitmoe:kv_cache_usage_perc 0.5", "splitmoe:max_batch_seqs 4.0",
                 'splitmoe:expert_service_healthy{address="127.0.0.1:7001"} 1.0',
                 'splitmoe:expert_hops_total{address="127.0.0.1:7001"} 10.0',
                 'splitmoe:expert_tokens_total{expert="3",layer="0"} 17.0', 'splitmoe:http_responses_total{status="200"}'):
        assert line in text
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "prompt_tokens_total", "generation_tokens_total",
                 'request_success_total{finished_reason="length"}', "expert_hop_seconds_total",
                 "expert_hop_bytes_total"):
        assert f"splitmoe:{name}" in text


def test_api_key(attention, fake):
    with running_gateway(attention[1], api_key="sekret") as http:
        assert_openai_error(http.post("/v1/chat/completions", json=CHAT), 401, "authentication_error")
        wrong = http.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert_openai_error(wrong, 401, "authentication_error")
        assert http.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        client = openai.OpenAI(base_url=api_base(http), api_key="sekret")
        out = client.chat.completions.create(model="fake-moe", messages=CHAT["messages"], max_tokens=1)
        assert out.choices[0].message.content == " t0"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=api_base(http), api_key="bad").models.list()


def test_one_span_per_request_whose_context_reaches_the_attention_service(http, fake):
    exporter = InMemorySpanExporter()
    setup_tracing("splitmoe-gateway", extra_processors=[SimpleSpanProcessor(exporter)])
    try:
        http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
        http.get("/health")
        deadline = time.monotonic() + 5
        while not (spans := exporter.get_finished_spans()):
            assert time.monotonic() < deadline, "no gateway span"
            time.sleep(0.01)
        time.sleep(0.1)
        [span] = exporter.get_finished_spans()  # one per request; health probes are not traced
        assert span.attributes["http.route"] == "/v1/chat/completions"
        assert span.attributes["http.response.status_code"] == 200
        [traceparent] = fake.traceparents
        assert traceparent.split("-")[1] == format(span.context.trace_id, "032x")
    finally:
        exporter.shutdown()
