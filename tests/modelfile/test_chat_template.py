"""modelfile.chat_template against transformers' `apply_chat_template` on real-world templates."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from splitmoe.modelfile.chat_template import CHATML_TEMPLATE, ChatTemplate, TemplateError  # noqa: E402
from splitmoe.modelfile.tokenizer import Tokenizer  # noqa: E402

FIXTURES = ROOT.parent / "shared" / "fixtures"
HF_DIR = FIXTURES / "qwen3moe" / "hf"
needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"../shared/fixtures not found: {FIXTURES}")

# Qwen3's template (Qwen/Qwen3-0.6B): tools, tool calls and responses, reasoning, enable_thinking.
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Mixtral-8x7B-Instruct-v0.1's template: BOS written by the template, strict role alternation.
MIXTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# Exercises tojson's options, loop controls, whitespace control and the generation block.
JSON_TEMPLATE = """{% for m in messages %}
  {% if m.role == 'skip' %}{% continue %}{% endif %}
  {{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=true) }}|{{ m | tojson(separators=(',', ':')) }}
  {% generation %}{{ m.content }}{% endgeneration %}
{% endfor %}
{% if tools %}{{ tools | tojson }}{% endif %}{{ reasoning_content | default('') }}"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city \u2014 \u00b0C, <unsafe> & \"quoted\"",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hi there \U0001f600"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "<think>\n2 is even.\n</think>\n\n7"},
        {"role": "user", "content": "Another?"},
    ],
    "tools": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in K\u00f8benhavn?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Need the tool.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "K\u00f8benhavn"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            ],
        },
        {"role": "tool", "content": '{"temp": 12}'},
        {"role": "tool", "content": '{"temp": 9}'},
    ],
    "reasoning_alias": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "thinking": "Simple sum."},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6", "reasoning": "Also simple."},
    ],
}


@pytest.fixture(scope="module")
def hf_tokenizer():
    if not HF_DIR.is_dir():
        pytest.skip(f"../shared/fixtures not found: {HF_DIR}")
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(HF_DIR))


def hf_render(hf_tokenizer, template, messages, **kwargs):
    hf_tokenizer.chat_template = template
    return hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


@needs_fixtures
@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("options", [
    {"add_generation_prompt": True},
    {"add_generation_prompt": False},
    {"add_generation_prompt": True, "enable_thinking": False},
    {"add_generation_prompt": True, "tools": [WEATHER_TOOL]},
])
def test_qwen3_matches_transformers(hf_tokenizer, name, options):
    messages = CONVERSATIONS[name]
    ours = ChatTemplate(QWEN3, eos_token="<|endoftext|>").render(messages, **options)
    assert ours == hf_render(hf_tokenizer, QWEN3, messages, **options)


@needs_fixtures
def test_mixtral_matches_transformers_and_raises(hf_tokenizer):
    template = ChatTemplate(MIXTRAL, bos_token="<s>", eos_token="</s>")
    messages = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "Bye"},
    ]
    expected = hf_render(hf_tokenizer, MIXTRAL, messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    assert template.render(messages) == expected == "<s>[INST] Hello [/INST]Hi!</s>[INST] Bye [/INST]"

    bad_order = [{"role": "assistant", "content": "first"}, {"role": "user", "content": "second"}]
    with pytest.raises(Exception, match="Conversation roles must alternate"):
        hf_render(hf_tokenizer, MIXTRAL, bad_order, bos_token="<s>", eos_token="</s>")
    with pytest.raises(TemplateError, match="Conversation roles must alternate") as info:
        template.render(bad_order)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


@needs_fixtures
def test_tojson_loopcontrols_and_generation_match_transformers(hf_tokenizer):
    messages = [
        {"role": "user", "content": "caf\u00e9 <b>&</b> \U0001f600", "z": [1, 2.5, None, True]},
        {"role": "skip", "content": "never shown"},
        {"role": "assistant", "content": "ok", "reasoning_content": "why"},
    ]
    ours = ChatTemplate(JSON_TEMPLATE).render(messages, tools=[WEATHER_TOOL], reasoning_content="extra")
    expected = hf_render(hf_tokenizer, JSON_TEMPLATE, messages, add_generation_prompt=True, tools=[WEATHER_TOOL],
                         reasoning_content="extra")
    assert ours == expected
    assert "caf\u00e9 <b>&</b>" in ours  # neither ASCII- nor HTML-escaped


def test_raise_exception_is_template_error():
    with pytest.raises(TemplateError, match="no system role"):
        ChatTemplate("{{ raise_exception('no system role') }}").render([])


@pytest.mark.parametrize("source", [
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% if messages.__class__ %}x{% endif %}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.append(1) }}",
    "{% set ns = namespace(__dict__=1) %}",
    "{{ dict.__class__ }}",
])
def test_sandbox_blocks_python_internals(source):
    with pytest.raises(TemplateError) as info:
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
    assert "\n" not in str(info.value)


def test_rich_objects_reach_the_template_as_placeholders():
    class Secret:
        def read(self):
            return "leaked"

    out = ChatTemplate("{{ messages[0].content }}|{{ flag }}").render(
        [{"role": "user", "content": Secret()}], flag=Secret()
    )
    assert out == "<Secret>|<Secret>"


def test_syntax_error_is_one_line():
    with pytest.raises(TemplateError, match="line 2") as info:
        ChatTemplate("ok\n{% for x in %}")
    assert "\n" not in str(info.value)


def test_render_error_is_one_line():
    with pytest.raises(TemplateError, match="TypeError") as info:
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])
    assert "\n" not in str(info.value)


def test_strftime_now():
    assert ChatTemplate("{{ strftime_now('%Y') }}").render([]) == str(datetime.now().year)


def test_chatml_default():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ChatTemplate(CHATML_TEMPLATE).render(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ChatTemplate(CHATML_TEMPLATE).render(messages, add_generation_prompt=False).endswith("Hi<|im_end|>\n")


@needs_fixtures
def test_from_gguf_metadata_falls_back_to_chatml_and_uses_special_tokens():
    from splitmoe.modelfile.gguf_file import GGUFFile

    meta = GGUFFile(FIXTURES / "qwen3moe" / "qwen3moe-q8_0.gguf").metadata
    assert "tokenizer.chat_template" not in meta
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    chatml = ChatTemplate.from_gguf_metadata(meta, tokenizer)
    assert chatml.source == CHATML_TEMPLATE
    assert (chatml.bos_token, chatml.eos_token) == ("", "<|endoftext|>")
    prompt = chatml.render([{"role": "user", "content": "hi"}])
    assert tokenizer.encode(prompt)[:1] == [2046]

    own = ChatTemplate.from_gguf_metadata({**meta, "tokenizer.chat_template": "{{ eos_token }}"}, tokenizer)
    assert own.render([]) == "<|endoftext|>"
