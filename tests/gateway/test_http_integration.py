"""The gateway in front of a REAL attention service (the demo model), through the openai client and httpx.

Both services run as `python -m splitmoe ...` processes on free loopback ports, like an operator runs them.
"""
import json
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from splitmoe.demo_model import write_demo_model
from tests.support.processes import REPO, free_port, grpc_service, spawn, stop

API_KEY = "integration-key"
MODEL = "demo"                    # the served name: the GGUF file's stem
DEMO_CONTEXT_TOKENS = 2048
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def serve_attention_available() -> bool:
    return subprocess.run([sys.executable, "-m", "splitmoe", "serve-attention", "--help"], cwd=REPO,
                          capture_output=True).returncode == 0


def wait_http_ok(url: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"gateway exited with {proc.returncode}"
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    if not serve_attention_available():
        pytest.skip("serve-attention not available yet")
    tmp = tmp_path_factory.mktemp("stack")
    model = tmp / f"{MODEL}.gguf"
    write_demo_model(model)
    attention_port, gateway_port = free_port(), free_port()
    with grpc_service(["serve-attention", str(model), "--port", str(attention_port)], attention_port,
                      tmp / "attention.log"):
        gateway = spawn(["serve-gateway", "--attention", f"127.0.0.1:{attention_port}", "--port", str(gateway_port),
                         "--api-key", API_KEY], tmp / "gateway.log")
        try:
            url = f"http://127.0.0.1:{gateway_port}"
            wait_http_ok(f"{url}/health", gateway)
            yield url
        except Exception:
            print((tmp / "gateway.log").read_text(errors="replace")[-4000:])
            raise
        finally:
            stop(gateway)


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def metric(http: httpx.Client, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", http.get("/metrics").text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def assert_still_serving(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **GREEDY)
    assert out.usage.completion_tokens == 2


def test_models_and_health(http):
    assert http.get("/health").json() == {"status": "ok"}
    [card] = http.get("/v1/models").json()["data"]
    assert (card["id"], card["object"], card["max_model_len"]) == (MODEL, "model", DEMO_CONTEXT_TOKENS)


def test_chat_non_streaming(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **GREEDY)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion" and out.model == MODEL
    [choice] = out.choices
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_chat_stream_assembles_to_the_non_streaming_answer(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **GREEDY)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.id.startswith("chatcmpl-") for c in chunks)
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_raw_sse_framing(http):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: {")
        json.loads(event[len("data: "):])


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True,
                                         top_logprobs=3, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-5  # greedy: nothing beats the top candidate


def test_n_choices_with_a_seed_replay_exactly(client):
    def run():
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2, seed=1234,
                                             temperature=1.0, extra_body={"ignore_eos": True})
        assert sorted(c.index for c in out.choices) == [0, 1]
        return [c.message.content for c in sorted(out.choices, key=lambda c: c.index)]
    assert run() == run()


def test_stop_string_ends_the_choice_before_it(client):
    text = client.completions.create(model=MODEL, prompt="The sky", max_tokens=12, **GREEDY).choices[0].text
    stop = next((text[i:i + 2] for i in range(2, len(text) - 1) if "\ufffd" not in text[i:i + 2]), None)
    if stop is None:
        pytest.skip("the random demo model wrote no usable stop string")
    out = client.completions.create(model=MODEL, prompt="The sky", max_tokens=12, stop=[stop], **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:text.index(stop)]


def test_completion_scores_token_ids_with_echo_and_max_tokens_0(http, client):
    ids = [5, 17, 30, 99, 7]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2}
    r = http.post("/v1/completions", json=body).json()
    [choice] = r["choices"]
    assert r["object"] == "text_completion" and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert choice["text"] == "".join(lp["tokens"])
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    parsed = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    assert parsed.choices[0].logprobs.tokens == lp["tokens"]


def test_completion_echo_then_generation(client):
    ids = [5, 17, 30]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, echo=True, logprobs=1, **GREEDY)
    [choice] = out.choices
    assert len(choice.logprobs.tokens) == len(ids) + 4 and choice.logprobs.token_logprobs[0] is None
    scored = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    assert choice.text.startswith(scored.choices[0].text)
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 4


@pytest.mark.parametrize("path, content, status", [
    ("/v1/chat/completions", b'{"model": "demo", "messages": [', 400),
    ("/v1/chat/completions", json.dumps({"model": "not-this-one", "messages": MESSAGES}).encode(), 404),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": -5}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hello"}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": MESSAGES, "temperature": "warm"}).encode(), 400),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [5] * (DEMO_CONTEXT_TOKENS + 10)}).encode(), 400),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [10**6]}).encode(), 400),
    ("/v1/no-such-route", b"{}", 404),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(http, client, path, content, status):
    assert_error(http.post(path, content=content, headers={"Content-Type": "application/json"}), status)
    assert_still_serving(client)


def test_a_prompt_over_the_context_is_400_with_the_reason(http, client):
    long_chat = [{"role": "user", "content": "a " * (DEMO_CONTEXT_TOKENS + 100)}]
    with pytest.raises(openai.BadRequestError, match="maximum context length is 2048"):
        client.chat.completions.create(model=MODEL, messages=long_chat, max_tokens=1)
    error = assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": long_chat,
                                                                 "stream": True}), 400)
    assert "2048" in error["message"]
    assert_still_serving(client)


def test_api_key_guards_v1_but_not_health_and_metrics(base_url):
    assert_error(httpx.get(f"{base_url}/v1/models"), 401)
    assert_error(httpx.post(f"{base_url}/v1/chat/completions", json={"messages": MESSAGES},
                            headers={"Authorization": "Bearer wrong"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{base_url}/health").status_code == 200
    assert httpx.get(f"{base_url}/metrics").status_code == 200


def test_metrics_after_traffic(http, client):
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, **GREEDY)
    assert metric(http, "splitmoe:attention_service_up") == 1
    assert metric(http, "splitmoe:prompt_tokens_total") > 0
    assert metric(http, "splitmoe:generation_tokens_total") >= 3
    assert metric(http, 'splitmoe:request_success_total{finished_reason="length"}') >= 1
    assert metric(http, "splitmoe:time_to_first_token_seconds_count") >= 1
    assert metric(http, "splitmoe:max_batch_seqs") >= 1
    assert 0 <= metric(http, "splitmoe:kv_cache_usage_perc") <= 1
    for name in ("splitmoe:num_requests_running", "splitmoe:num_requests_waiting"):
        assert metric(http, name) >= 0


def wait_until_idle(http: httpx.Client, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(http, "splitmoe:num_requests_running") + metric(http, "splitmoe:num_requests_waiting") > 0:
        assert time.monotonic() < deadline, "the generation went on after its client left"
        time.sleep(0.05)
    steps = metric(http, "splitmoe:scheduler_steps_total")
    time.sleep(0.3)
    assert metric(http, "splitmoe:scheduler_steps_total") == steps  # nothing is computing any more


def test_a_client_leaving_a_stream_cancels_its_generation(http, client):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert metric(http, "splitmoe:num_requests_running") == 1
    wait_until_idle(http)
    assert_still_serving(client)


def test_a_client_leaving_a_non_streaming_request_cancels_it(http, client):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json=body, timeout=0.5)
    wait_until_idle(http)
    assert_still_serving(client)
