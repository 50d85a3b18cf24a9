"""Tool calls through the whole stack (issue 14): the official `openai` client against the gateway,
the attention service and two expert services on the built-in demo model. Its random weights never
write a call by themselves: a named `tool_choice` constrains the reply to the function's parameters
schema (the grammar engine's token masks), and the reply comes back as that function's call, whole
and streamed; then the tool's result goes back in the next turn through the chat template.
"""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.stack  # conftest's bf16_stack: the whole stack as real processes

PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 120  # the longest arguments: 8 characters as \uXXXX escapes, a token each


def ask(openai_client, served_model_id, **options):
    return openai_client.chat.completions.create(model=served_model_id, messages=MESSAGES, tools=TOOLS, seed=7,
                                          max_tokens=MAX_TOKENS, **options)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_named_tool_choice_returns_a_valid_call(openai_client, served_model_id, seed):
    choice = ask(openai_client, served_model_id, tool_choice=NAMED, temperature=1.0, extra_body={"seed": seed}).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS)


def test_the_streamed_call_is_the_whole_one(openai_client, served_model_id):
    whole = ask(openai_client, served_model_id, tool_choice=NAMED, temperature=0.0).choices[0].message.tool_calls[0]
    with openai_client.chat.completions.stream(model=served_model_id, messages=MESSAGES, tools=TOOLS, seed=7,
                                        max_tokens=MAX_TOKENS, tool_choice=NAMED, temperature=0.0) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    deltas = [d for c in chunks for ch in c.choices for d in (ch.delta.tool_calls or [])]
    first, rest = deltas[0], deltas[1:]
    # As OpenAI streams a call: index, id, type and name first; then only argument fragments.
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather") and first.id
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    [streamed] = final.choices[0].message.tool_calls  # the client's accumulator joined the deltas
    assert final.choices[0].finish_reason == "tool_calls"
    assert (streamed.function.name, streamed.function.arguments) == (whole.function.name, whole.function.arguments)
    jsonschema.validate(json.loads(streamed.function.arguments), PARAMETERS)


def test_required_returns_calls_of_the_tools(openai_client, served_model_id):
    choice = ask(openai_client, served_model_id, tool_choice="required", temperature=1.0, parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls  # parallel_tool_calls false: at most one
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_the_tool_result_goes_back_in_the_next_turn(openai_client, served_model_id):
    answer = ask(openai_client, served_model_id, tool_choice=NAMED, temperature=0.0)
    first = answer.choices[0].message
    result = json.dumps({"temperature": 21})
    history = [*MESSAGES, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": result}]
    reply = openai_client.chat.completions.create(model=served_model_id, messages=history, tools=TOOLS, max_tokens=8,
                                           temperature=0.0)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    # The template rendered the tool's result (the demo vocabulary: about a token per byte) into the prompt.
    assert reply.usage.prompt_tokens >= answer.usage.prompt_tokens + len(result) // 2


def test_tool_choice_mistakes_are_400s(openai_client, served_model_id):
    with pytest.raises(openai.BadRequestError) as e:
        ask(openai_client, served_model_id, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice" and "nope" in e.value.body["message"]
