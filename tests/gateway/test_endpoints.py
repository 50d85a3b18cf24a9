"""vLLM's /tokenize and /detokenize, /v1/models/{id}, /version, /docs and the page at /, and the sampling
parameters that reach the sampler (logit_bias, stop_token_ids, min_tokens), over real HTTP.

`splitmoe serve-gateway` with an API key in front of `splitmoe serve-attention` on the demo model.
"""
from __future__ import annotations

import re

import httpx
import pytest

from tests.support.gateway_http import assert_openai_error, gateway_over_attention

pytestmark = pytest.mark.stack  # the gateway and the services as real processes

API_KEY = "endpoints-key"
MODEL = "demo"
DEMO_VOCAB = 275
DEMO_CONTEXT_TOKENS = 2048
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Why is the sky blue?"}]}
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(demo_gguf, tmp_path_factory):
    with gateway_over_attention(demo_gguf, tmp_path_factory.mktemp("endpoints"), "--api-key", API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def anonymous(stack):
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        yield client


# ------------------------------------------------------------------------------ tokenize, detokenize

def test_tokenize_text_and_detokenize_round_trip(http):
    out = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True}).json()
    assert out["count"] == len(out["tokens"]) > 1 and out["max_model_len"] == DEMO_CONTEXT_TOKENS
    assert len(out["token_strs"]) == out["count"] and "".join(out["token_strs"]).replace("Ġ", " ") == "Hello world"
    assert http.post("/detokenize", json={"model": MODEL, "tokens": out["tokens"]}).json() == {"prompt": "Hello world"}
    plain = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert plain["tokens"] == out["tokens"] and plain["token_strs"] is None


def test_tokenize_a_chat_counts_what_a_generation_is_given(http):
    out = http.post("/tokenize", json={"messages": CHAT["messages"]}).json()
    answer = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1}).json()
    assert out["count"] == answer["usage"]["prompt_tokens"]
    text = http.post("/detokenize", json={"tokens": out["tokens"]}).json()["prompt"]
    assert "Why is the sky blue?" in text
    without = http.post("/tokenize", json={"messages": CHAT["messages"], "add_generation_prompt": False}).json()
    assert without["count"] < out["count"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [DEMO_VOCAB]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "1"}, "tokens"),
])
def test_tokenizer_endpoints_refuse_bad_bodies_with_a_400_naming_the_field(http, path, body, param):
    error = assert_openai_error(http.post(path, json=body), 400, "invalid_request_error")
    assert error["param"] == param and param in error["message"]


def test_tokenizer_endpoints_name_the_served_model_only(http):
    assert_openai_error(http.post("/tokenize", json={"model": "other", "prompt": "a"}), 404, "not_found_error")
    assert_openai_error(http.post("/detokenize", json={"model": "other", "tokens": [1]}), 404, "not_found_error")


# ------------------------------------------------------------------------------ models, version

def test_a_model_by_its_id_or_openais_404(http):
    card = http.get(f"/v1/models/{MODEL}").json()
    assert card == http.get("/v1/models").json()["data"][0]
    error = assert_openai_error(http.get("/v1/models/org/other"), 404, "not_found_error")
    assert error["code"] == "model_not_found" and "org/other" in error["message"]


def test_version_names_the_package(http):
    assert re.fullmatch(r"\S+", http.get("/version").json()["version"])


# ------------------------------------------------------------------------------ docs, page, API key

def test_openapi_documents_every_request_body(anonymous):
    spec = anonymous.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, model in [("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest"),
                        ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")]:
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
    assert {"messages", "logit_bias", "min_tokens", "stop_token_ids"} <= set(schemas["ChatCompletionRequest"]["properties"])
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', anonymous.get("/openapi.json").text))
    assert refs <= set(schemas), refs - set(schemas)  # every reference resolves
    assert {"/v1/models/{model_id}", "/version", "/tokenize"} <= set(spec["paths"])


def test_docs_load_only_assets_the_gateway_serves(anonymous):
    html = anonymous.get("/docs").text
    urls = re.findall(r'(?:src|href)\s*=\s*["\']([^"\']+)', html) + re.findall(r"url: ?'([^']+)'", html)
    assert urls and not [u for u in urls if "//" in u], urls  # no other host
    for url in urls:
        response = anonymous.get(url)
        assert response.status_code == 200 and response.content, url
    assert "SwaggerUIBundle" in anonymous.get("/docs/assets/swagger-ui-bundle.js").text


def test_browsers_get_the_chat_page_at_the_root_and_api_clients_the_index(http, anonymous):
    page = anonymous.get("/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assets = re.findall(r'(?:src|href)="(/[^"]+)"', page.text)
    assert {"/static/chat.js", "/static/chat.css"} <= set(assets) and "//" not in "".join(assets)
    for asset in assets:
        assert anonymous.get(asset).status_code == 200, asset
    assert http.get("/").json()["object"] == "splitmoe.index"  # curl and SDKs: the JSON index, as before
    assert http.get("/", headers={"Accept": "application/json, text/html"}).json()["object"] == "splitmoe.index"


def test_with_an_api_key_only_the_page_and_docs_are_open(anonymous):
    for path in ("/", "/v1/models", f"/v1/models/{MODEL}", "/version", "/metrics"):
        assert_openai_error(anonymous.get(path), 401, "authentication_error")
    assert_openai_error(anonymous.post("/tokenize", json={"prompt": "a"}), 401, "authentication_error")
    assert_openai_error(anonymous.get("/static/../v1/models"), 401, "authentication_error")


# ------------------------------------------------------------------------------ sampling parameters

def complete(http, **fields) -> dict:
    """The completion choice of a greedy request on fixed prompt ids."""
    body = {"model": MODEL, "prompt": [5, 17, 30], "max_tokens": 6, **GREEDY, **fields}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_logit_bias_forces_and_bans_tokens(http):
    forced = http.post("/detokenize", json={"tokens": [100] * 6}).json()["prompt"]
    assert complete(http, logit_bias={"100": 100})["text"] == forced
    free = complete(http)["text"]
    first = http.post("/tokenize", json={"prompt": free, "add_special_tokens": False}).json()["tokens"][0]
    banned = complete(http, logit_bias={str(first): -100})["text"]
    assert banned != free and not banned.startswith(http.post("/detokenize", json={"tokens": [first]}).json()["prompt"])


def test_logit_bias_outside_the_vocabulary_is_a_400_naming_it(http):
    for body in ({**CHAT, "logit_bias": {str(DEMO_VOCAB): 1}}, {**CHAT, "logit_bias": {"x": 1}}):
        error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400, "invalid_request_error")
        assert error["param"] == "logit_bias" and "logit_bias" in error["message"]


def test_stop_token_ids_end_the_generation_even_with_ignore_eos(http):
    free = complete(http, max_tokens=8)["text"]
    ids = http.post("/tokenize", json={"prompt": free, "add_special_tokens": False}).json()["tokens"]
    stopped = complete(http, max_tokens=8, stop_token_ids=[ids[2]])
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == http.post("/detokenize", json={"tokens": ids[:3]}).json()["prompt"]


def test_min_tokens_holds_back_the_models_stop_token(http):
    """EOS banned by min_tokens: a generation that stops at once without it goes on to min_tokens."""
    eos_first = {"logit_bias": {str(eos): 100 for eos in eos_ids(http)}, "temperature": 0}
    body = {"model": MODEL, "prompt": [5, 17, 30], "max_tokens": 10, **eos_first}
    assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 1
    held = http.post("/v1/completions", json={**body, "min_tokens": 4}).json()
    assert held["usage"]["completion_tokens"] == 5 and held["choices"][0]["finish_reason"] == "stop"


def eos_ids(http) -> list[int]:
    """The demo's end-of-text token(s), found by their spelling in the vocabulary."""
    spelled = http.post("/tokenize", json={"prompt": "<|im_end|>", "add_special_tokens": False,
                                           "return_token_strs": True}).json()
    assert spelled["count"] == 1, spelled
    return spelled["tokens"]
