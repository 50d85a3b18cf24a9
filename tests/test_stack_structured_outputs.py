"""Structured outputs through the whole stack (issue 14): the official `openai` client against the
gateway, the attention service and two expert services on the built-in demo model, whose random
weights would never write JSON by themselves: every answer below is JSON only because the grammar
engine's token masks allow nothing else.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.stack  # conftest's bf16_stack: the whole stack as real processes

# Small enough to keep 100 answers quick, with every kind of node: a nested object, an array, an enum,
# bounded integers and strings, required fields. Bounds keep a random model's answers short.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "zip": {"type": "integer", "minimum": 0,
                                                                               "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
# The longest answer: every string at its bound in \uXXXX escapes (6 bytes a character, a token each).
MAX_TOKENS = 400
NUM_REQUESTS = 100
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


def test_100_seeded_json_schema_answers_all_validate(openai_client, served_model_id):
    def ask(seed: int):
        return openai_client.chat.completions.create(model=served_model_id, messages=MESSAGES, seed=seed, temperature=1.0,
                                              max_tokens=MAX_TOKENS, response_format=RESPONSE_FORMAT)

    with ThreadPoolExecutor(16) as pool:  # concurrent: the masks are filled batch-wide
        answers = list(pool.map(ask, range(NUM_REQUESTS)))
    for seed, answer in enumerate(answers):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", f"seed {seed}: {choice.finish_reason}: {choice.message.content!r}"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    # The seed replays: the same request gives the same answer.
    assert ask(7).choices[0].message.content == answers[7].choices[0].message.content


@pytest.mark.parametrize("response_format", [{"type": "json_object"}, RESPONSE_FORMAT], ids=["json_object", "schema"])
def test_answers_parse_streamed_and_not(openai_client, served_model_id, response_format):
    for seed in range(3):
        kwargs = dict(model=served_model_id, messages=MESSAGES, seed=seed, max_tokens=MAX_TOKENS,
                      response_format=response_format)
        whole = openai_client.chat.completions.create(**kwargs).choices[0]
        chunks = list(openai_client.chat.completions.create(stream=True, **kwargs))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert whole.finish_reason == "stop" and isinstance(json.loads(whole.message.content), dict)
        assert streamed == whole.message.content  # the detokenizer gives the exact text either way
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_a_truncated_answer_says_length(openai_client, served_model_id):
    answer = openai_client.chat.completions.create(model=served_model_id, messages=MESSAGES, seed=0, max_tokens=5,
                                            response_format=RESPONSE_FORMAT).choices[0]
    assert answer.finish_reason == "length"
    assert '{"name":"'.startswith(answer.message.content)  # what the schema forces first, cut short


@pytest.mark.parametrize("schema, words", [
    ({"type": "strin"}, "Invalid type"),
    ({"$ref": "#/definitions/missing"}, "missing"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
])
def test_a_schema_the_engine_cannot_use_is_400_naming_response_format(openai_client, served_model_id, schema, words):
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(model=served_model_id, messages=MESSAGES, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    error = refused.value.body
    assert error["param"] == "response_format" and words in error["message"]
