"""The gateway's OpenAI API end to end, through httpx and the official openai client.

Real processes on loopback: `splitmoe serve-gateway` (with an API key and a small body limit) in
front of `splitmoe serve-attention` serving the demo model with its experts in-process. Startup,
health, overload and expert-service failures are in test_app_operations.py.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support.gateway_http import (
    GatewayStack,
    assert_openai_error,
    gateway_over_attention,
    metric,
    running_gateway,
    sse_chunks,
    wait_http,
    wait_until_idle,
)

pytestmark = pytest.mark.stack  # the gateway and the services as real processes

API_KEY = "integration-key"
MODEL = "demo"                      # the served name: the stem of conftest's demo.gguf
DEMO_CONTEXT_TOKENS = 2048
MAX_BODY_BYTES = 16384              # above every body below but those meant to get 413
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
CHAT = {"model": MODEL, "messages": MESSAGES}
GREEDY = {"temperature": 0, "ignore_eos": True}     # in a body; the openai client passes ignore_eos as extra_body
CLIENT_GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def stack(demo_gguf, tmp_path_factory) -> GatewayStack:
    log_dir = tmp_path_factory.mktemp("app")
    with gateway_over_attention(demo_gguf, log_dir, "--api-key", API_KEY, "--max-body-bytes", str(MAX_BODY_BYTES)) as s:
        yield s


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def assert_still_serving(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **CLIENT_GREEDY)
    assert out.usage.completion_tokens == 2


def openai_spelling(token_bytes: list[int]) -> str:
    """How OpenAI spells a token: its text, or `bytes:\\xNN...` when it holds part of a character."""
    try:
        return bytes(token_bytes).decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in token_bytes)


# ----------------------------------------------------------------------------------- models, chat

def test_models_and_health(http):
    assert http.get("/health").json() == {"status": "ok"}
    r = http.get("/v1/models").json()
    assert r["object"] == "list"
    [card] = r["data"]
    assert (card["id"], card["object"], card["max_model_len"]) == (MODEL, "model", DEMO_CONTEXT_TOKENS)


@pytest.mark.parametrize("path", ["/", "/v1"])
def test_the_printed_urls_answer_with_an_index(http, path):
    body = http.get(path).json()
    assert body["openai_base_url"] == "/v1" and body["model"] == http.get("/v1/models").json()["data"][0]["id"]
    assert "POST /v1/chat/completions" in body["routes"] and "GET /health" in body["routes"]


def test_chat_non_streaming(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **CLIENT_GREEDY)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion" and out.model == MODEL
    [choice] = out.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.logprobs is None
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_chat_stream_is_openai_sse_and_adds_up_to_the_full_answer(http):
    body = {**CHAT, "max_tokens": 8, **GREEDY}
    full = http.post("/v1/chat/completions", json=body).json()
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=streamed) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_chunks(r)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL and c["created"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1])
    assert text == full["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])


def test_a_stream_without_include_usage_has_no_usage_field(http):
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 2, "stream": True, **GREEDY}) as r:
        chunks = sse_chunks(r)
    assert all("usage" not in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_n_seeded_choices_replay_exactly_streamed_or_not(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=6, n=2, seed=1234, temperature=1.0,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    assert sorted(c.index for c in full.choices) == [0, 1]
    texts, finishes, usage = ["", ""], {}, None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
        usage = chunk.usage or usage
    assert texts == [c.message.content for c in sorted(full.choices, key=lambda c: c.index)]
    assert finishes == {0: "length", 1: "length"}
    one = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert usage.prompt_tokens == full.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert usage.completion_tokens == full.usage.completion_tokens == 12


def test_chat_logprobs_spell_tokens_as_openai_does(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True,
                                         top_logprobs=3, **CLIENT_GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-5  # greedy: nothing beats the top candidate
        for token in (entry, *entry.top_logprobs):
            assert token.bytes and token.token == openai_spelling(token.bytes)


def test_stop_string_ends_the_choice_before_it(client):
    text = client.completions.create(model=MODEL, prompt="The sky", max_tokens=12, **CLIENT_GREEDY).choices[0].text
    stop = next((text[i:i + 2] for i in range(2, len(text) - 1) if "\ufffd" not in text[i:i + 2]), None)
    if stop is None:
        pytest.skip("the random demo model wrote no usable stop string")
    out = client.completions.create(model=MODEL, prompt="The sky", max_tokens=12, stop=[stop], **CLIENT_GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:text.index(stop)]


# ------------------------------------------------------------------------------------ completions

def test_completion_scores_token_ids_with_echo_and_max_tokens_0(http, client):
    ids = [5, 17, 30, 99, 7]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2}
    r = http.post("/v1/completions", json=body).json()
    [choice] = r["choices"]
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-") and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"][1:])  # the prompt's own token joins the top 2
    for token, logprob, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top[token] == logprob
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert choice["text"] == "".join(lp["tokens"])
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    parsed = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    assert parsed.choices[0].logprobs.tokens == lp["tokens"]


def test_echoed_tokens_that_split_a_character_are_spelled_as_bytes(http):
    ids = [104, 0xC3, 0xA9, 33]  # "h", the two bytes of "é", "!": in the demo vocabulary a byte's id is the byte
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}
    [choice] = http.post("/v1/completions", json=body).json()["choices"]
    assert choice["text"] == "hé!"  # the prompt decoded as a whole
    assert choice["logprobs"]["tokens"] == ["h", "bytes:\\xc3", "bytes:\\xa9", "!"]


def test_completion_echo_then_generation(client):
    ids = [5, 17, 30]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, echo=True, logprobs=1, **CLIENT_GREEDY)
    [choice] = out.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 4 and lp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    scored = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1).choices[0]
    assert choice.text.startswith(scored.text) and lp.tokens[:len(ids)] == scored.logprobs.tokens
    assert lp.text_offset[len(ids)] == len(scored.text)  # generated tokens' offsets continue after the echo
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 4


def test_a_stream_of_several_prompts_adds_up_to_the_full_response(http):
    body = {"model": MODEL, "prompt": ["The sky", "Once upon"], "max_tokens": 3, "echo": True, **GREEDY}
    full = http.post("/v1/completions", json=body).json()
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=streamed) as r:
        chunks = sse_chunks(r)
    texts = ["", ""]
    for c in chunks[:-1]:
        assert c["object"] == "text_completion" and c["id"] == chunks[0]["id"] and c["id"].startswith("cmpl-")
        [choice] = c["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == [c["text"] for c in full["choices"]]
    assert texts[0].startswith("The sky") and texts[1].startswith("Once upon")  # the echo opens each choice
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    assert full["usage"]["completion_tokens"] == 6


# ----------------------------------------------------------------------------------------- errors

def chat_body(**fields) -> bytes:
    return json.dumps({**CHAT, **fields}).encode()


@pytest.mark.parametrize("path, content, status, error_type", [
    ("/v1/chat/completions", b'{"model": "demo", "messages": [', 400, "invalid_request_error"),
    ("/v1/chat/completions", b"", 400, "invalid_request_error"),
    ("/v1/chat/completions", chat_body(max_tokens=-5), 400, "invalid_request_error"),
    ("/v1/chat/completions", chat_body(messages="hello"), 400, "invalid_request_error"),
    ("/v1/chat/completions", chat_body(temperature="warm"), 400, "invalid_request_error"),
    ("/v1/chat/completions", chat_body(model="not-this-one"), 404, "not_found_error"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "n": 0}).encode(), 400, "invalid_request_error"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [5] * (DEMO_CONTEXT_TOKENS + 10)}).encode(),
     400, "invalid_request_error"),  # the attention service's INVALID_ARGUMENT
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [10**6]}).encode(), 400, "invalid_request_error"),
    ("/v1/no-such-route", b"{}", 404, "not_found_error"),
    ("/v1/chat/completions", b"x" * (MAX_BODY_BYTES + 1), 413, "invalid_request_error"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(http, client, path, content, status, error_type):
    assert_openai_error(http.post(path, content=content, headers={"Content-Type": "application/json"}), status,
                        error_type)
    assert_still_serving(client)


def test_errors_name_their_cause(http, client):
    long_chat = [{"role": "user", "content": "a " * (DEMO_CONTEXT_TOKENS + 100)}]
    with pytest.raises(openai.BadRequestError, match="maximum context length is 2048"):
        client.chat.completions.create(model=MODEL, messages=long_chat, max_tokens=1)
    # A stream the attention service rejects gets its 4xx, not a 200 that breaks off.
    streamed = http.post("/v1/chat/completions", json={"model": MODEL, "messages": long_chat, "stream": True})
    assert "2048" in assert_openai_error(streamed, 400, "invalid_request_error")["message"]
    negative = assert_openai_error(http.post("/v1/chat/completions", content=chat_body(max_tokens=-1)), 400,
                                   "invalid_request_error")
    assert negative["param"] == "max_tokens" and negative["code"] == "invalid_value"
    unknown = assert_openai_error(http.post("/v1/chat/completions", content=chat_body(model="gpt-4")), 404,
                                  "not_found_error")
    assert unknown["code"] == "model_not_found" and unknown["param"] == "model" and "gpt-4" in unknown["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MESSAGES)
    assert_still_serving(client)


def test_a_chunked_body_over_the_limit_is_413(http, client):
    half = MAX_BODY_BYTES // 2 + 1
    r = http.post("/v1/chat/completions", content=iter([b"{" + b" " * half, b" " * half + b"}"]))  # no length declared
    assert_openai_error(r, 413, "invalid_request_error")
    assert_still_serving(client)


# ------------------------------------------------------------------------------ auth, names, metrics

def test_api_key_guards_v1_and_metrics_but_not_health(stack):
    url = stack.url
    assert_openai_error(httpx.get(f"{url}/v1/models"), 401, "authentication_error")
    wrong = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer wrong"})
    assert assert_openai_error(wrong, 401, "authentication_error")["code"] == "invalid_api_key"
    assert wrong.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{url}/v1/models", headers={"X-Api-Key": API_KEY}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{url}/health").status_code == 200
    assert_openai_error(httpx.get(f"{url}/metrics"), 401, "authentication_error")  # it names internal addresses
    assert httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_public_metrics_opens_metrics_alone(stack):
    with running_gateway(stack.attention_port, stack.log_dir / "gateway-public.log", "--api-key", API_KEY,
                         "--public-metrics") as url:
        assert httpx.get(f"{url}/metrics").status_code == 200
        assert_openai_error(httpx.get(f"{url}/v1/models"), 401, "authentication_error")


def test_served_model_name_replaces_the_model_id(stack):
    log_path = stack.log_dir / "gateway-alias.log"
    with running_gateway(stack.attention_port, log_path, "--served-model-name", "alias") as url:
        wait_http(url + "/health", None, lambda r: r.status_code == 200)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "alias"
        ok = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "model": "alias", "max_tokens": 1}, timeout=60)
        assert ok.status_code == 200 and ok.json()["model"] == "alias"
        assert_openai_error(httpx.post(f"{url}/v1/chat/completions", json=CHAT), 404, "not_found_error")


def test_metrics_after_traffic(http, client):
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, **CLIENT_GREEDY)
    long_prompt = [{"role": "user", "content": "a prompt long enough to fill several KV blocks " * 8}]
    for _ in range(2):  # the second finds the first's full blocks in the prefix cache
        client.chat.completions.create(model=MODEL, messages=long_prompt, max_tokens=1, **CLIENT_GREEDY)
    text = http.get("/metrics").text
    assert metric(text, "splitmoe:prefix_cache_queries_total") >= metric(text, "splitmoe:prefix_cache_hits_total") >= 32
    assert metric(text, "splitmoe:attention_service_up") == 1
    assert metric(text, "splitmoe:prompt_tokens_total") > 0
    assert metric(text, "splitmoe:generation_tokens_total") >= 3
    assert metric(text, 'splitmoe:request_success_total{finished_reason="length"}') >= 1
    assert metric(text, 'splitmoe:http_responses_total{status="200"}') >= 1
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert metric(text, f"splitmoe:{name}_count") >= 1
    assert metric(text, "splitmoe:max_batch_seqs") >= 1 and metric(text, "splitmoe:scheduler_steps_total") >= 3
    assert 0 <= metric(text, "splitmoe:kv_cache_usage_perc") <= 1
    for name in ("splitmoe:num_requests_running", "splitmoe:num_requests_waiting"):
        assert metric(text, name) >= 0


# ---------------------------------------------------------------------------------- disconnection

def test_a_client_leaving_a_stream_cancels_its_generation(http, client):
    body = {**CHAT, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert metric(http.get("/metrics").text, "splitmoe:num_requests_running") == 1
    wait_until_idle(http)
    assert_still_serving(client)


def test_a_client_leaving_a_non_streaming_request_cancels_it(http, client):
    body = {**CHAT, "max_tokens": 1900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json=body, timeout=0.5)
    wait_until_idle(http)
    assert_still_serving(client)
