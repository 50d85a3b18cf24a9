"""The flagship architectures end to end: openai client -> gateway -> attention -> two expert services.

Each must answer exactly what the single-process reference (`splitmoe generate --chat`) answers,
with its experts split across two services.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.support.gguf_edit import rewrite_gguf
from tests.support.processes import REPO, run_splitmoe
from tests.support.stack import running_stack

pytestmark = pytest.mark.stack  # the whole stack as real processes

MODELS = ["deepseek2/deepseek2-q8_0.gguf", "deepseek3/deepseek3-q4_k_m.gguf", "gptoss/gptoss-mxfp4_moe.gguf",
          "dbrx/dbrx-q4_k_m.gguf", "deepseek/deepseek-q8_0.gguf", "glm4moe/glm4moe-q8_0.gguf",
          "llama4/llama4-q4_k_m.gguf"]
PROMPT = "def norm(v):"


@pytest.mark.parametrize("name", MODELS)
def test_streamed_chat_through_two_expert_services_equals_generate(fixtures_dir, tmp_path, name):
    model = fixtures_dir / name
    with running_stack(model, tmp_path) as stack:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model_id = client.models.list().data[0].id
        stream = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": PROMPT}],
                                                max_tokens=16, temperature=0, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    reference = run_splitmoe("generate", str(model), "--prompt", PROMPT, "--chat", "-n", "16")
    assert text and text == reference[:-1]


GLM45_TEMPLATE = REPO / "tests" / "data" / "chat_templates" / "glm45.jinja"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"enum": [1, 2, 3]}},
           "required": ["city", "days"], "additionalProperties": False}


def test_glm45_template_and_calls_through_the_gateway(fixtures_dir, tmp_path):
    """The glm4moe fixture with GLM-4.5's chat template: a call forced by tool_choice comes back as an
    OpenAI call, and sent back with its result it is rendered in GLM's own markup, as the template says."""
    model = tmp_path / "glm4moe-chat.gguf"
    rewrite_gguf(fixtures_dir / "glm4moe" / "glm4moe-q8_0.gguf", model,
                 set_keys={"tokenizer.chat_template": GLM45_TEMPLATE.read_text()})
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with running_stack(model, tmp_path) as stack:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model_id = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model_id, messages=messages, tools=tools, max_tokens=60,
                                               temperature=0, tool_choice={"type": "function",
                                                                           "function": {"name": "get_weather"}})
        [call] = reply.choices[0].message.tool_calls
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, WEATHER)
        history = [*messages, reply.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "21 C"}]
        tokens = httpx.post(stack.url + "/tokenize", json={"model": model_id, "messages": history,
                                                           "add_generation_prompt": True}, timeout=60).json()
        prompt = httpx.post(stack.url + "/detokenize", json={"model": model_id, "tokens": tokens["tokens"]},
                            timeout=60).json()["prompt"]
    assert prompt.startswith("[gMASK]<sop><|user|>\nWeather in Paris?<|assistant|>") and prompt.endswith("<|assistant|>")
    assert (f"<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>{arguments['city']}</arg_value>\n"
            f"<arg_key>days</arg_key>\n<arg_value>{arguments['days']}</arg_value>\n</tool_call>") in prompt
    assert "<|observation|>\n<tool_response>\n21 C\n</tool_response>" in prompt
