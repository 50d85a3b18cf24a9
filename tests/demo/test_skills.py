"""The shipped demo model's skills (splitmoe/demo/corpus.py) asked the way the services ask them.

An OpenAI request goes through the gateway's own conversion (tool_choice and response_format checked
and turned into a GenerateRequest), then the attention service's: the chat template renders the
tools, the grammar engine compiles the schema, the hermes parser reads the calls, and the engine
generates in-process, greedy, in the serving dtype. Only the network between the two is left out.
"""
from __future__ import annotations

import json
import queue

import pytest
import torch

from splitmoe.attention_service import server
from splitmoe.attention_service.model.runner import RunnerOptions
from splitmoe.attention_service.service import load_serving_model
from splitmoe.attention_service.settings import AttentionSettings
from splitmoe.demo import corpus, trained_model_path
from splitmoe.gateway.attention_client import generate_request
from splitmoe.gateway.attention_types import ToolCallDelta
from splitmoe.gateway.openai_types import ChatCompletionRequest
from splitmoe.gateway.tool_calls import message_tool_calls

TOOLS = [corpus.WEATHER_TOOL, corpus.CALCULATE_TOOL]  # as the README offers them
WEATHER_QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
CAPITAL_SCHEMA = {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
                  "required": ["country", "capital"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model():
    model = load_serving_model(AttentionSettings(model_path=str(trained_model_path()), runner=RunnerOptions(
        device=torch.device("cpu"), dtype=torch.bfloat16, kv_cache_tokens=1024)))
    model.engine.start()
    yield model
    model.engine.stop()


def complete(model, **body) -> tuple[str, list[tuple[str, dict]], str]:
    """(content, [(function, arguments)], finish reason) of a chat completion at temperature 0."""
    request = ChatCompletionRequest(model="demo-chat-qwen3moe", temperature=0, max_tokens=64, **body)
    [params] = request.to_generate_params("skills")
    message = generate_request(params)
    ids = server.prompt_ids(model, message)
    options = server.sampling_options(message.sampling, model.max_context_tokens - len(ids))
    outputs: queue.Queue = queue.Queue()
    model.engine.submit(model.new_request("skills", ids, options, outputs.put, chat=True,
                                          grammar=server.compile_grammar(model, message),
                                          tool_calling=server.tool_calling(message)))
    content, deltas, finish = "", [], ""
    while not finish:
        out = outputs.get(timeout=60)
        assert not out.error, out.error
        content += out.text
        deltas += [ToolCallDelta(index=d.index, id=d.id, name=d.name, arguments=d.arguments) for d in out.tool_calls]
        finish = out.finish_reason
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message_tool_calls(deltas) or ()]
    return content, calls, finish


def test_a_weather_question_with_tools_is_a_get_weather_call(model):
    content, calls, finish = complete(model, messages=[WEATHER_QUESTION], tools=TOOLS)
    assert (content, calls, finish) == ("", [("get_weather", {"city": "Paris"})], "tool_calls")


def test_an_arithmetic_question_with_tools_is_a_calculate_call(model):
    _, calls, _ = complete(model, messages=[{"role": "user", "content": "What is 34 * 56?"}], tools=TOOLS)
    assert calls == [("calculate", {"expression": "34 * 56"})]


def test_the_tool_result_comes_back_as_a_sentence(model):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    result = {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 18,
                                                                               "condition": "sunny"})}
    messages = [WEATHER_QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]}, result]
    content, calls, finish = complete(model, messages=messages, tools=TOOLS)
    assert (content, calls, finish) == ("It is 18 degrees and sunny in Paris.", [], "stop")


def test_a_question_that_needs_no_tool_is_answered_with_tools_offered(model):
    content, calls, _ = complete(model, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                 tools=TOOLS)
    assert (content, calls) == ("The capital of France is Paris.", [])


def test_a_weather_question_without_the_tool_says_so(model):
    content, calls, _ = complete(model, messages=[WEATHER_QUESTION])
    assert (content, calls) == (corpus.NO_WEATHER_TOOL, [])


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"],
                         ids=["named", "required"])
def test_a_forcing_tool_choice_gets_the_right_arguments(model, tool_choice):
    """The grammar forces the call's JSON (gateway/tools.py); the model fills in the city."""
    content, calls, finish = complete(model, messages=[WEATHER_QUESTION], tools=TOOLS, tool_choice=tool_choice)
    assert (content, calls, finish) == ("", [("get_weather", {"city": "Paris"})], "tool_calls")


def test_a_json_schema_answer_holds_the_right_values(model):
    response_format = {"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL_SCHEMA}}
    question = {"role": "user", "content": "What is the capital of Japan? Answer in JSON."}
    content, calls, finish = complete(model, messages=[question], response_format=response_format)
    assert json.loads(content) == {"country": "Japan", "capital": "Tokyo"} and finish == "stop"
