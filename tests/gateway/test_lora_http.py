"""LoRA adapters over HTTP, as vLLM serves them: listed in /v1/models, named by `model`, loaded and
unloaded at run time (/v1/load_lora_adapter, /v1/unload_lora_adapter), behind the API key.

Real processes on loopback: `splitmoe serve-gateway` (with an API key) in front of `splitmoe
serve-attention` on tests/data/lora's base, with its attention adapter given at start (`--lora-modules`)
and room for one more (`--max-loras 2`). float32, so that the prompt's logprobs under each model can be
held to transformers + peft's float32 logits (references.npz) within 1e-4: the adapter moves them by
0.6, so a request that reached the base instead of its adapter, or the reverse, cannot pass.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from splitmoe.gateway.app import build_app
from splitmoe.gateway.settings import GatewaySettings
from tests.support.gateway_http import (
    GatewayStack,
    assert_openai_error,
    gateway_over_attention,
    metric,
    running_gateway,
    sse_chunks,
)

pytestmark = pytest.mark.stack  # the gateway and the attention service as real processes (but the last test)

DATA = Path(__file__).resolve().parents[1] / "data" / "lora"
BASE = "base-qwen3moe"                      # the served name: the stem of the base's file
ADAPTER = "attn"                            # loaded at start
ATTN_LORA = str(DATA / "attn-lora.gguf")
API_KEY = "lora-key"
CONTEXT_TOKENS = 4096
LOGPROB_TOLERANCE = 1e-4                    # float32 against peft's float32 (measured: 9e-7)
ADAPTER_SHIFT = 0.5                         # the adapter moves p1's logprobs by 0.61 at most (references)
SUCCESS_LOADED = "Success: LoRA adapter '{}' added successfully."    # vLLM's words, byte for byte
SUCCESS_REMOVED = "Success: LoRA adapter '{}' removed successfully."


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[GatewayStack]:
    with gateway_over_attention(DATA / "base-qwen3moe.gguf", tmp_path_factory.mktemp("lora"), "--api-key", API_KEY,
                                attention_args=("--dtype", "float32", "--lora-modules", f"{ADAPTER}={ATTN_LORA}",
                                                "--max-loras", "2")) as s:
        yield s


@pytest.fixture(scope="module")
def http(stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def references() -> dict[str, np.ndarray]:
    with np.load(DATA / "references.npz") as refs:
        return {key: refs[key] for key in refs.files}


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def reference_prompt_logprobs(references: dict, model: str) -> np.ndarray:
    """peft's logprob of each of p1's tokens after the first, under `model` ("base" or "attn")."""
    ids = references["prompts/p1"]
    return log_softmax(references[f"{model}/p1/logits"])[np.arange(len(ids) - 1), ids[1:]]


def prompt_logprobs(http: httpx.Client, model: str, ids: list[int]) -> np.ndarray:
    """The prompt's own logprobs (echo, no generation: a Score call), under `model`."""
    response = http.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 0, "echo": True,
                                                  "logprobs": 0})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    return np.array(response.json()["choices"][0]["logprobs"]["token_logprobs"][1:])


def assert_scores_as(http: httpx.Client, references: dict, model: str, as_reference: str) -> None:
    ids = references["prompts/p1"].tolist()
    got = prompt_logprobs(http, model, ids)
    other = "base" if as_reference == "attn" else "attn"
    assert np.abs(got - reference_prompt_logprobs(references, as_reference)).max() < LOGPROB_TOLERANCE
    assert np.abs(got - reference_prompt_logprobs(references, other)).max() > ADAPTER_SHIFT


def listed(http: httpx.Client) -> dict[str, dict]:
    response = http.get("/v1/models")
    assert response.status_code == 200, response.text
    return {card["id"]: card for card in response.json()["data"]}


def load(http: httpx.Client, name: str, path: str = ATTN_LORA) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def unload(http: httpx.Client, name: str) -> httpx.Response:
    return http.post("/v1/unload_lora_adapter", json={"lora_name": name})


# ------------------------------------------------------------------------------------------ listing

def test_models_list_the_base_then_each_adapter_with_its_parent_and_file(http):
    response = http.get("/v1/models").json()
    assert [card["id"] for card in response["data"]] == [BASE, ADAPTER]
    base, adapter = response["data"]
    assert (base["root"], base["parent"], base["max_model_len"]) == (BASE, None, CONTEXT_TOKENS)
    assert (adapter["root"], adapter["parent"], adapter["max_model_len"]) == (ATTN_LORA, BASE, CONTEXT_TOKENS)
    assert adapter["object"] == "model" and adapter["owned_by"] == base["owned_by"]


def test_a_model_by_its_id_finds_adapters_too(http):
    assert http.get(f"/v1/models/{ADAPTER}").json() == listed(http)[ADAPTER]
    error = assert_openai_error(http.get("/v1/models/attn-v2"), 404, "not_found_error")
    assert error["code"] == "model_not_found"


# ----------------------------------------------------------------------------------- using adapters

@pytest.mark.parametrize("model, as_reference", [(BASE, "base"), (ADAPTER, "attn")])
def test_the_prompt_scores_as_peft_scores_it_under_the_model_named(http, references, model, as_reference):
    assert_scores_as(http, references, model, as_reference)


def test_no_model_named_is_the_base(http, references):
    ids = references["prompts/p1"].tolist()
    out = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}).json()
    got = np.array(out["choices"][0]["logprobs"]["token_logprobs"][1:])
    assert out["model"] == BASE
    assert np.abs(got - reference_prompt_logprobs(references, "base")).max() < LOGPROB_TOLERANCE


def test_greedy_generation_follows_the_adapter(http, references):
    """p1's next token differs under the adapter (peft: 1399 vs 1942, each ahead of its second by 0.03)."""
    ids = references["prompts/p1"].tolist()
    texts = {}
    for model, ref in ((BASE, "base"), (ADAPTER, "attn")):
        out = http.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0,
                                                 "ignore_eos": True, "logprobs": 1}).json()
        [first] = out["choices"][0]["logprobs"]["token_logprobs"]
        assert abs(first - log_softmax(references[f"{ref}/p1/logits"])[-1].max()) < LOGPROB_TOLERANCE
        texts[model] = out["choices"][0]["text"]
        assert out["model"] == model
    assert texts[BASE] != texts[ADAPTER]


def test_chat_and_its_stream_run_on_the_adapter_and_name_it(http):
    body = {"model": ADAPTER, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    whole = http.post("/v1/chat/completions", json=body)
    assert whole.status_code == 200, whole.text
    assert whole.json()["model"] == ADAPTER
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        chunks = sse_chunks(response)
    assert {chunk["model"] for chunk in chunks} == {ADAPTER}
    streamed = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    assert streamed == whole.json()["choices"][0]["message"]["content"]
    base = http.post("/v1/chat/completions", json={**body, "model": BASE}).json()["choices"][0]["message"]["content"]
    assert base != streamed


def test_the_tokenizer_answers_to_an_adapters_name(http):
    base = http.post("/tokenize", json={"model": BASE, "prompt": "Hello world"}).json()
    assert http.post("/tokenize", json={"model": ADAPTER, "prompt": "Hello world"}).json() == base
    assert http.post("/detokenize", json={"model": ADAPTER, "tokens": base["tokens"]}).json() == {"prompt": "Hello world"}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "a", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}),
    ("/tokenize", {"prompt": "a"}),
])
def test_an_unknown_model_is_openais_404(http, path, body):
    error = assert_openai_error(http.post(path, json={**body, "model": "attn-v2"}), 404, "not_found_error")
    assert error["code"] == "model_not_found" and error["param"] == "model" and "attn-v2" in error["message"]


# ------------------------------------------------------------------------------ loading, unloading

def test_an_adapter_loaded_at_run_time_is_listed_used_then_gone_once_unloaded(http, references):
    loaded = load(http, "late")
    try:
        assert (loaded.status_code, loaded.text) == (200, SUCCESS_LOADED.format("late"))
        assert loaded.headers["content-type"].startswith("text/plain")
        card = listed(http)["late"]
        assert (card["root"], card["parent"]) == (ATTN_LORA, BASE)
        assert_scores_as(http, references, "late", "attn")
    finally:
        removed = unload(http, "late")
    assert (removed.status_code, removed.text) == (200, SUCCESS_REMOVED.format("late"))
    assert list(listed(http)) == [BASE, ADAPTER]
    gone = http.post("/v1/completions", json={"model": "late", "prompt": "a", "max_tokens": 1})
    assert assert_openai_error(gone, 404, "not_found_error")["code"] == "model_not_found"
    again = assert_openai_error(unload(http, "late"), 404, "not_found_error")
    assert "late" in again["message"] and "\n" not in again["message"]


def test_loads_past_max_loras_or_of_a_name_taken_are_400s(http):
    try:
        assert load(http, "second").status_code == 200  # with attn: --max-loras 2
        full = assert_openai_error(load(http, "third"), 400, "invalid_request_error")
        assert "max-loras" in full["message"] and "\n" not in full["message"]
        taken = assert_openai_error(load(http, ADAPTER), 400, "invalid_request_error")
        assert "already been loaded" in taken["message"]
    finally:
        assert unload(http, "second").status_code == 200
    assert list(listed(http)) == [BASE, ADAPTER]


@pytest.mark.parametrize("body, param", [
    ({"lora_name": "x", "lora_path": "/nonexistent/adapter.gguf"}, None),
    ({"lora_name": "x", "lora_path": str(DATA / "base-qwen3moe.gguf")}, None),    # a model, not an adapter
    ({"lora_name": "x", "lora_path": str(DATA / "README.md")}, None),             # not GGUF at all
    ({"lora_name": BASE, "lora_path": ATTN_LORA}, "lora_name"),
    ({"lora_path": ATTN_LORA}, "lora_name"),
    ({"lora_name": "x"}, "lora_path"),
    ({"lora_name": "", "lora_path": ATTN_LORA}, "lora_name"),
    ({"lora_name": " x", "lora_path": ATTN_LORA}, "lora_name"),
    ({"lora_name": "x\ny", "lora_path": ATTN_LORA}, "lora_name"),
    ({"lora_name": "x" * 257, "lora_path": ATTN_LORA}, "lora_name"),
    ({"lora_name": 5, "lora_path": ATTN_LORA}, "lora_name"),
    ({"lora_name": "x", "lora_path": ATTN_LORA, "load_inplace": True}, "load_inplace"),
])
def test_a_bad_load_is_a_400_in_one_line_and_changes_nothing(http, body, param):
    error = assert_openai_error(http.post("/v1/load_lora_adapter", json=body), 400, "invalid_request_error")
    assert "\n" not in error["message"] and len(error["message"]) < 400, error["message"]
    if param:
        assert error["param"] == param
    assert list(listed(http)) == [BASE, ADAPTER]


@pytest.mark.parametrize("body", [{}, {"lora_name": ""}, {"lora_name": 5}])
def test_a_bad_unload_is_a_400(http, body):
    error = assert_openai_error(http.post("/v1/unload_lora_adapter", json=body), 400, "invalid_request_error")
    assert error["param"] == "lora_name"


def test_vllms_lora_int_id_is_accepted_and_ignored(http):
    assert load(http, "by-id").status_code == 200
    removed = http.post("/v1/unload_lora_adapter", json={"lora_name": "by-id", "lora_int_id": 7})
    assert (removed.status_code, removed.text) == (200, SUCCESS_REMOVED.format("by-id"))


def test_malformed_json_is_a_400(http):
    response = http.post("/v1/load_lora_adapter", content=b"{", headers={"content-type": "application/json"})
    assert assert_openai_error(response, 400, "invalid_request_error")["code"] == "invalid_json"


def test_loading_and_unloading_need_the_api_key(stack):
    with httpx.Client(base_url=stack.url, timeout=60) as anonymous:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            denied = anonymous.post(path, json={"lora_name": ADAPTER, "lora_path": ATTN_LORA})
            assert assert_openai_error(denied, 401, "authentication_error")["code"] == "invalid_api_key"
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        assert list(listed(http)) == [BASE, ADAPTER]  # the adapter the anonymous unload named is still there


def test_an_adapter_unloaded_by_another_gateway_is_a_404_here(stack, http, references):
    """This gateway knows `shared` from using it; another unloads it: the next request here gets the 404
    of an unknown model (the attention service's 400 makes this gateway ask again), not a 400."""
    assert load(http, "shared").status_code == 200
    try:
        assert_scores_as(http, references, "shared", "attn")
        with running_gateway(stack.attention_port, stack.log_dir / "other-gateway.log") as other:
            assert httpx.post(other + "/v1/unload_lora_adapter", json={"lora_name": "shared"}).status_code == 200
    except BaseException:
        unload(http, "shared")  # not on success: this gateway's own unload would make it forget what it knows
        raise
    for _ in range(2):
        gone = http.post("/v1/completions", json={"model": "shared", "prompt": "a", "max_tokens": 1})
        assert assert_openai_error(gone, 404, "not_found_error")["code"] == "model_not_found"


def test_metrics_count_the_adapters_loaded(http):
    assert metric(http.get("/metrics").text, "splitmoe:lora_adapters_loaded") == 1
    assert load(http, "counted").status_code == 200
    try:
        assert metric(http.get("/metrics").text, "splitmoe:lora_adapters_loaded") == 2
    finally:
        unload(http, "counted")


def test_the_routes_are_documented_and_indexed(http):
    spec = http.get("/openapi.json").json()
    for path, model in [("/v1/load_lora_adapter", "LoadLoraAdapterRequest"),
                        ("/v1/unload_lora_adapter", "UnloadLoraAdapterRequest")]:
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert f"POST {path}" in http.get("/", headers={"Accept": "application/json"}).json()["routes"]
    assert {"lora_name", "lora_path"} <= set(spec["components"]["schemas"]["LoadLoraAdapterRequest"]["properties"])


# ---------------------------------------------------------------------------- without run-time loading

def test_without_lora_updates_the_routes_are_absent_as_in_vllm():
    """vLLM serves them only with VLLM_ALLOW_RUNTIME_LORA_UPDATING; a client probing for them sees 404.
    Nothing here reaches the attention service (none listens): the routes are not there to call it."""
    with TestClient(build_app(GatewaySettings("127.0.0.1:1", allow_lora_updates=False))) as client:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            response = client.post(path, json={"lora_name": "x", "lora_path": ATTN_LORA})
            assert response.status_code == 404 and response.json()["error"]["message"] == f"no route POST {path}"
        assert "/v1/load_lora_adapter" not in client.get("/openapi.json").json()["paths"]
