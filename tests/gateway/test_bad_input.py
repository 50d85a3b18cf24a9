"""Bad input gets a clear error and harms no one else: the gateway end to end, fuzzed.

Real processes on loopback: `splitmoe serve-gateway` (with an API key) in front of `splitmoe
serve-attention` serving the demo model under a chat template that reads a `greeting` variable
and message names, so that chat_template_kwargs and `name` show in the prompt's length.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Iterator

import httpx
import pytest

from splitmoe.gateway.openai_types import ERROR_TYPES, INT32_MAX, INT64_MAX
from tests.support.gateway_http import (
    GatewayStack,
    assert_openai_error,
    gateway_over_attention,
    running_gateway,
    sse_events,
)
from tests.support.gguf_edit import rewrite_gguf

pytestmark = pytest.mark.stack  # the gateway and the services as real processes

API_KEY = "bad-input-key"
MODEL = "demo"
CONTEXT_TOKENS = 2048                # the demo model's
TEMPLATE = (
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}"
    "{% if message['name'] is defined %} {{ message['name'] }}{% endif %}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "The sky", "max_tokens": 2}
FUZZ_SEED = 1047
FUZZ_BODIES = 300


@pytest.fixture(scope="module")
def stack(demo_gguf, tmp_path_factory) -> GatewayStack:
    log_dir = tmp_path_factory.mktemp("bad-input")
    model = log_dir / "demo.gguf"  # the same stem: served as "demo"
    rewrite_gguf(demo_gguf, model, drop_keys=("tokenizer.chat_template",),
                 set_keys={"tokenizer.chat_template": TEMPLATE})
    with gateway_over_attention(model, log_dir, "--api-key", API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
        yield client


def assert_serves(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={**CHAT, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


# ------------------------------------------------------------------------------------------ fuzz

class Raw:
    """JSON text put into a body as is: what json.dumps cannot write (NaN, deep nesting, bad bytes)."""

    def __init__(self, text: bytes) -> None:
        self.text = text


NASTY = [
    None, True, False, 0, -1, 1, 2, 3, -2**31 - 1, 2**31 - 1, 2**31, 2**32, 2**63, INT64_MAX, -INT64_MAX - 2,
    2**64, 10**30, 10**400, 0.5, -0.0, 3.7, 1e308, -1e-308, "", "x", "0", "true", "null", "\u0000", "\U0001f600",
    "\u202e\u0301", "x" * 100_000, "é" * 30_000, [], [1, 2, 3], [[]], ["a", 1], [None], {}, {"a": 1}, {"type": "text"},
    Raw(b"NaN"), Raw(b"-Infinity"), Raw(b"1e999"), Raw(b'"\\ud800"'), Raw(b'"\xff\xfe"'), Raw(b'"\xc3"'),
    Raw(b"[" * 5000 + b"]" * 5000), Raw(b'{"a":' * 300 + b"1" + b"}" * 300), Raw(b"[" + b"7," * 20000 + b"7]"),
]
CHAT_FIELDS = [
    "model", "messages", "messages.0", "messages.0.role", "messages.0.content", "messages.0.name", "max_tokens",
    "max_completion_tokens", "n", "seed", "stop", "stream", "stream_options", "stream_options.include_usage",
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "logprobs", "top_logprobs", "response_format", "response_format.type", "tools", "tool_choice",
    "user", "ignore_eos", "num_experts_per_token", "add_generation_prompt", "reasoning_format",
    "chat_template_kwargs", "chat_template_kwargs.greeting", "min_tokens", "stop_token_ids", "reasoning_effort",
]
COMPLETION_FIELDS = [
    "model", "prompt", "prompt.0", "max_tokens", "n", "best_of", "echo", "logprobs", "suffix", "seed", "stop",
    "stream", "stream_options", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "user", "ignore_eos", "num_experts_per_token", "guided_json",
]
ROUTES = {"/v1/chat/completions": (CHAT, CHAT_FIELDS), "/v1/completions": (COMPLETION, COMPLETION_FIELDS)}


def fuzz_bodies(seed: int, count: int) -> Iterator[tuple[str, bytes]]:
    """`count` (route, body) pairs: a valid body with one to three mutations, from `seed`."""
    rng = random.Random(seed)
    for _ in range(count):
        path = rng.choice(sorted(ROUTES))
        base, fields = ROUTES[path]
        body = json.loads(json.dumps(base))
        for _ in range(rng.randint(1, 3)):
            body = mutate(rng, body, fields)
        yield path, encode(rng, body)


def mutate(rng: random.Random, body, fields: list[str]):
    kind = rng.random()
    if not isinstance(body, dict):
        return body
    if kind < 0.6:
        value = rng.choice(NASTY)
        field = rng.choice(fields)
        if field == "max_tokens" and value is None:
            value = 2**31  # null means "until the context is full": seconds of generation
        put(body, field, value)
    elif kind < 0.7:
        body.pop(rng.choice(["model", "messages", "prompt", "stream"]), None)
    elif kind < 0.8:
        repeat, count = rng.choice([1, 50]), rng.choice([1, 5000])  # huge names, or thousands of them
        body.update({f"unknown_{rng.randrange(10**6)}_{i}" * repeat: i for i in range(count)})
    elif kind < 0.9:
        body = rng.choice([[body], None, 123, "body", [], Raw(b"{" * 2000)])
    else:  # many messages, or many prompts
        key = "messages" if "messages" in body else "prompt"
        body[key] = [body[key][0] if isinstance(body.get(key), list) and body[key] else body.get(key)] * 50
    return body


def put(body: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    node = body
    for part in parents:
        nxt = node[int(part)] if isinstance(node, list) else node.get(part)
        if not isinstance(nxt, (dict, list)) or (isinstance(nxt, list) and not nxt):
            nxt = {}
            if isinstance(node, dict):
                node[part] = nxt
            else:
                return
        node = nxt
    if isinstance(node, list):
        node[0] = value
    else:
        node[last] = value


def encode(rng: random.Random, body) -> bytes:
    raws: list[bytes] = []

    def placeholder(value):
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"@@raw{len(raws) - 1}@@"
        raise TypeError(type(value))

    text = json.dumps(body, default=placeholder).encode()
    for i, raw in enumerate(raws):
        text = text.replace(f'"@@raw{i}@@"'.encode(), raw)
    if rng.random() < 0.05:  # cut short: not JSON any more
        text = text[:rng.randrange(len(text) + 1)]
    return text


def check_answer(response: httpx.Response, path: str, body: bytes, attention_port: int) -> None:
    where = f"{path} {body[:300]!r}"
    assert response.status_code < 500, f"{where}: {response.status_code} {response.text[:500]}"
    assert response.headers.get("x-request-id"), where
    # as an address shows it (host:port), not the bare digits: a random completion id may hold those
    assert not re.search(rf":{attention_port}(?!\d)", response.text), f"{where}: an internal address in {response.text[:500]}"
    if response.status_code >= 400:
        error = assert_openai_error(response, response.status_code, ERROR_TYPES[response.status_code])
        assert len(error["message"]) < 1000, where
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(response)
        assert events[-1] == "[DONE]", where
        for event in events[:-1]:
            assert "error" not in json.loads(event), f"{where}: {event}"
    else:
        assert response.json()["choices"], where


def test_fuzzed_bodies_get_4xx_openai_errors_and_the_stack_serves_on(stack, http):
    started = time.monotonic()
    statuses: dict[int, int] = {}
    for path, body in fuzz_bodies(FUZZ_SEED, FUZZ_BODIES):
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
        check_answer(response, path, body, stack.attention_port)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
    assert statuses.get(200, 0) >= 10 and statuses.get(400, 0) >= 100, statuses  # both kinds were tried
    assert time.monotonic() - started < 60
    assert_serves(http)
    lines = (stack.log_dir / "splitmoe.gateway.log").read_text(errors="replace").splitlines()
    assert max(len(line) for line in lines) < 2000  # unknown fields: names cut short, once each


# -------------------------------------------------------------------------------------- admission

def test_an_oversized_fan_out_is_refused_at_once_and_harms_no_concurrent_request(stack):
    async def run():
        limits = httpx.Limits(max_connections=300)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=stack.url, headers=headers, timeout=120, limits=limits) as c:
            async def small(i):
                await asyncio.sleep(0.005 * i)
                return await c.post("/v1/completions", json={**COMPLETION, "ignore_eos": True})

            async def timed(body):
                started = time.monotonic()
                return await c.post("/v1/completions", json=body), time.monotonic() - started

            oversized = timed({**COMPLETION, "prompt": ["hi"] * 50, "n": 128, "max_tokens": 1})
            within = timed({**COMPLETION, "prompt": ["hi", "ho"], "n": 32, "max_tokens": 1})
            return await asyncio.gather(oversized, within, *(small(i) for i in range(200)))

    (oversized, oversized_s), (within, _), *small = asyncio.run(run())
    error = assert_openai_error(oversized, 400, "invalid_request_error")
    assert "6400" in error["message"] and "128" in error["message"] and error["param"] == "n"
    assert oversized_s < 2
    assert within.status_code == 200 and len(within.json()["choices"]) == 64
    assert [r.status_code for r in small] == [200] * 200, {r.status_code: r.text for r in small}


def test_a_storm_of_fan_outs_within_the_cap_sheds_load_with_429_and_cancels_no_one(stack, http):
    """20 requests of 128 generations each, with 200 small ones: 2,560 calls at once would make the
    attention service's gRPC server cancel calls at random (anyone's: 503 `cancelled`); the gateway's
    in-flight limit keeps the burst below that, so an overloaded stack answers 429 and nothing else."""
    async def run():
        limits = httpx.Limits(max_connections=300)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=stack.url, headers=headers, timeout=120, limits=limits) as c:
            async def post(body, delay_s):
                await asyncio.sleep(delay_s)
                return await c.post("/v1/completions", json=body)

            fans = [post({**COMPLETION, "n": 128, "max_tokens": 1}, 0) for _ in range(20)]
            small = [post(COMPLETION, 0.005 * i) for i in range(200)]
            return await asyncio.gather(*fans, *small)

    answers = asyncio.run(run())
    assert {r.status_code for r in answers} <= {200, 429}, {r.status_code: r.text for r in answers}
    assert any(r.status_code == 200 for r in answers[20:])
    assert_serves(http)


def test_generations_in_flight_past_the_limit_are_429_and_per_request_past_the_cap_400(stack):
    log_path = stack.log_dir / "gateway-small.log"
    with running_gateway(stack.attention_port, log_path, "--max-generations-per-request", "3",
                         "--max-generations-in-flight", "4") as url:
        long = {**CHAT, "n": 3, "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=long, timeout=60) as running:
            lines = running.iter_lines()
            assert next(lines).startswith("data: ")  # three generations hold three of four slots
            full = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "n": 2}, timeout=60)
            assert assert_openai_error(full, 429, "rate_limit_error")["code"] == "rate_limit_exceeded"
            assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
        too_many = httpx.post(f"{url}/v1/completions", json={**COMPLETION, "prompt": ["a", "b"], "n": 2}, timeout=60)
        assert "4 generations" in assert_openai_error(too_many, 400, "invalid_request_error")["message"]
        # The stream's slots come back once the gateway sees its client gone: the whole limit is free again.
        deadline = time.monotonic() + 10
        while (again := httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "n": 3}, timeout=60)).status_code == 429:
            assert time.monotonic() < deadline, "the slots of a closed stream were not given back"
            time.sleep(0.05)
        assert again.status_code == 200, again.text


# --------------------------------------------------------------------------------- context, bounds

def test_prompt_plus_max_tokens_over_the_context_is_400_naming_both(http):
    over = http.post("/v1/completions", json={**COMPLETION, "prompt": [5] * 2000, "max_tokens": 100})
    assert assert_openai_error(over, 400, "invalid_request_error")["message"] == (
        "This model's maximum context length is 2048 tokens. However, you requested 2100 tokens (2000 in the "
        "messages, 100 in the completion). Please reduce the length of the messages or completion.")
    chat = {**CHAT, "max_tokens": CONTEXT_TOKENS}
    message = assert_openai_error(http.post("/v1/chat/completions", json=chat), 400, "invalid_request_error")["message"]
    assert f"{CONTEXT_TOKENS} in the completion" in message and "maximum context length is 2048" in message
    huge = {**COMPLETION, "prompt": "hello world " * 690_000}  # 8 MB: refused by its size, before tokenizing
    started = time.monotonic()
    assert "bytes" in assert_openai_error(http.post("/v1/completions", json=huge), 400,
                                          "invalid_request_error")["message"]
    assert time.monotonic() - started < 3
    assert_serves(http)


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "prompt", [1, INT32_MAX + 1]),
    ("/v1/completions", "prompt", [[5], [2**64]]),
    ("/v1/completions", "max_tokens", INT32_MAX + 1),
    ("/v1/chat/completions", "max_tokens", 2**40),
    ("/v1/chat/completions", "max_completion_tokens", INT32_MAX + 1),
    ("/v1/chat/completions", "top_k", INT32_MAX + 1),
    ("/v1/chat/completions", "num_experts_per_token", INT32_MAX + 1),
    ("/v1/completions", "seed", INT64_MAX + 1),
    ("/v1/completions", "logprobs", 2**63),
    ("/v1/completions", "n", 2**31),
    ("/v1/completions", "best_of", 2**31),
])
def test_integers_past_their_protobuf_field_are_400_naming_it(http, path, field, value):
    base = CHAT if path == "/v1/chat/completions" else COMPLETION
    error = assert_openai_error(http.post(path, json={**base, field: value}), 400, "invalid_request_error")
    assert error["param"] == field, error


def test_int32_max_itself_reaches_the_attention_service(http):
    error = assert_openai_error(http.post("/v1/completions", json={**COMPLETION, "max_tokens": INT32_MAX}), 400,
                                "invalid_request_error")
    assert f"{INT32_MAX} in the completion" in error["message"]
    error = assert_openai_error(http.post("/v1/completions", json={**COMPLETION, "prompt": [INT32_MAX]}), 400,
                                "invalid_request_error")
    assert "token ids must lie in [0, " in error["message"]


# --------------------------------------------------------------------- parameters, not ignored

def prompt_tokens(http: httpx.Client, **fields) -> int:
    r = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1, **fields})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_chat_template_kwargs_and_message_names_reach_the_template(http):
    plain = prompt_tokens(http)
    assert prompt_tokens(http, chat_template_kwargs={"greeting": "Hello there"}) > plain
    named = [{**CHAT["messages"][0], "name": "ada"}]
    assert prompt_tokens(http, messages=named) > plain
    reserved = http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"messages": []}})
    assert "messages" in assert_openai_error(reserved, 400, "invalid_request_error")["message"]


def test_repetition_penalty_changes_greedy_output(http):
    def text(**fields) -> str:
        body = {**COMPLETION, "prompt": [5, 17, 30, 5, 17, 30], "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, **fields}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    assert text(repetition_penalty=1.0) == text()
    assert text(repetition_penalty=2.0) != text()


@pytest.mark.parametrize("field, value", [
    ("guided_json", {"type": "object"}), ("reasoning_effort", "low"), ("repeat_penalty", 1.2),
    ("use_beam_search", True), ("skip_special_tokens", False), ("include_stop_str_in_output", True),
    ("add_special_tokens", True),
])
def test_parameters_that_would_change_the_output_are_never_ignored(http, field, value):
    error = assert_openai_error(http.post("/v1/chat/completions", json={**CHAT, field: value}), 400,
                                "invalid_request_error")
    assert error["param"] == field and "not supported" in error["message"]


# ------------------------------------------------------------------------------------- request ids

def test_every_answer_has_a_request_id_and_errors_name_it(http, stack):
    ok = http.post("/v1/chat/completions", json=CHAT)
    assert ok.headers["x-request-id"] == ok.json()["id"]  # chatcmpl-...: one id for the log and the client
    unauthorized = httpx.get(f"{stack.url}/v1/models")
    assert assert_openai_error(unauthorized, 401, "authentication_error")["request_id"].startswith("req-")
    bad = assert_openai_error(http.post("/v1/completions", json={"prompt": []}), 400, "invalid_request_error")
    assert bad["request_id"].startswith("cmpl-")
    assert http.get("/health").headers["x-request-id"]
