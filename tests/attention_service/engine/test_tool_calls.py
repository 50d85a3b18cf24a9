"""Tool-call parsing (attention_service/engine/tool_calls/), on literal model outputs taken from each
family's own documentation or chat template (the source is cited above each), whole and streamed in
pieces of every size; then through the serving path, tokens to deltas, with the markers as the
vocabulary's own tokens."""
from __future__ import annotations

import json
import random

import pytest

from splitmoe.attention_service.engine.reasoning import HARMONY_MARKERS, TextDelta, detect_reasoning_format, output_text
from splitmoe.attention_service.engine.tool_calls import (
    FORMATS,
    ToolCalling,
    ToolCallText,
    ToolFormat,
    deepseek,
    detect_tool_format,
    glm45,
    hermes,
    kimi_k2,
    mistral,
    string_parameters,
)
from splitmoe.attention_service.engine.tool_calls.base import Parsed, ToolCall, assemble, parse_whole
from splitmoe.attention_service.engine.tool_calls.forced import NamedCall, RequiredCalls
from splitmoe.modelfile.chat_template import ChatTemplate
from tests.attention_service.engine.test_reasoning import make_tokenizer
from tests.modelfile.test_chat_template import QWEN3
from tests.support.processes import REPO

# Qwen's function-calling guide (qwen.readthedocs.io, "Function Calling", Hermes-style tool use):
# the model's reply to "What's the temperature in San Francisco now? How about tomorrow?".
QWEN_DOCS = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
    '"date": "2024-10-01"}}\n</tool_call>'
)
# DeepSeek-V3's chat template (tokenizer_config.json of deepseek-ai/DeepSeek-V3, also R1's), which renders
# an assistant call as '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + type + '<｜tool▁sep｜>' + name + '\n'
# + '```json' + '\n' + arguments + '\n' + '```' + '<｜tool▁call▁end｜>', the next with a '\n' before it,
# then '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' (the end of sentence is the stop token, not text).
DEEPSEEK_V3_TEMPLATE = (
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"location": "Tokyo"}\n```'
    '<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"location": "Paris"}\n```'
    '<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
# DeepSeek-V3.1's model card ("ToolCall"): "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>
# tool_call_arguments<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>", filled in.
DEEPSEEK_V31_CARD = (
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"location": "Tokyo"}<｜tool▁call▁end｜>'
    '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"location": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
# Kimi-K2's docs/tool_call_guidance.md (moonshotai/Kimi-K2-Instruct), "Manually Parsing Tool Calls".
KIMI_DOCS = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
             '{"city": "Beijing"}<|tool_call_end|><|tool_calls_section_end|>')
# Mistral's function-calling example for Mistral-7B-Instruct-v0.3 / Mixtral-8x22B-Instruct (the model card's
# and Ollama's "Example response"), the pre-v11 tokenizers' array form.
MISTRAL_ARRAY = ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", '
                 '"format": "celsius"}}]')
# Mistral-Small-3.2-24B-Instruct-2506's chat template (v11 on), which writes each call as
# "[TOOL_CALLS]" + name + "[ARGS]" + arguments.
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'
# OpenAI's harmony guide (openai-cookbook articles/openai-harmony.md, "Receiving tool calls").
HARMONY_DOCS = ('<|channel|>analysis<|message|>Need to use function get_current_weather.<|end|><|start|>assistant'
                '<|channel|>commentary to=functions.get_current_weather <|constrain|>json<|message|>'
                '{"location":"San Francisco"}<|call|>')
# GLM-4.5's chat template (tests/data/chat_templates/glm45.jinja, zai-org/GLM-4.5), its rendering of
# an assistant call; the template's own instructions to the model spell the same shape.
GLM45_TEMPLATE = ('\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n'
                  '<arg_key>days</arg_key>\n<arg_value>[1, 2]</arg_value>\n</tool_call>\n<tool_call>get_time\n</tool_call>')
# GLM-4.7's template writes no newlines: '<tool_call>' + name, then each <arg_key>/<arg_value> pair.
GLM47_TEMPLATE = '<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>'

CASES = {  # id: (format, literal output, content, [(name, arguments)])
    "qwen-docs": ("hermes", QWEN_DOCS, "", [
        ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
        ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"})]),
    "qwen-content-first": ("hermes", "Let me check.\n" + QWEN_DOCS, "Let me check.\n", [
        ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
        ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"})]),
    "deepseek-v3-template": ("deepseek", DEEPSEEK_V3_TEMPLATE, "", [
        ("get_weather", {"location": "Tokyo"}), ("get_weather", {"location": "Paris"})]),
    "deepseek-v3.1-card": ("deepseek", DEEPSEEK_V31_CARD, "", [
        ("get_weather", {"location": "Tokyo"}), ("get_weather", {"location": "Paris"})]),
    "kimi-docs": ("kimi_k2", "I'll check. " + KIMI_DOCS, "I'll check. ", [("get_weather", {"city": "Beijing"})]),
    "mistral-array": ("mistral", MISTRAL_ARRAY, "", [
        ("get_current_weather", {"location": "San Francisco, CA", "format": "celsius"})]),
    "mistral-v11": ("mistral", MISTRAL_V11, "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    "harmony-docs": ("harmony", HARMONY_DOCS, "", [("get_current_weather", {"location": "San Francisco"})]),
    "glm45-template": ("glm45", "I'll check." + GLM45_TEMPLATE, "I'll check.\n", [
        ("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {})]),
    "glm47-template": ("glm45", GLM47_TEMPLATE, "", [("get_weather", {"city": "Paris"})]),
}


def calls_of(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(parser, text: str, rng: random.Random) -> Parsed:
    out, i = Parsed(), 0
    while i < len(text):
        n = rng.randint(1, 9)
        out += parser.feed(text[i:i + n])
        i += n
    out += parser.finish()
    return out


@pytest.mark.parametrize("case", CASES)
def test_literal_outputs_parse(case):
    fmt, text, content, calls = CASES[case]
    got_content, got_calls = parse_whole(FORMATS[fmt][0](), text)
    assert (got_content, calls_of(got_calls)) == (content, calls)
    assert len({c.id for c in got_calls}) == len(got_calls) and all(got_calls[i].id for i in range(len(calls)))


@pytest.mark.parametrize("case", CASES)
def test_streamed_in_any_pieces_as_openai_streams_them(case):
    fmt, text, content, calls = CASES[case]
    for seed in range(25):
        out = streamed(FORMATS[fmt][0](), text, random.Random(seed))
        assert (out.content, calls_of(assemble(out.calls))) == (content, calls), seed
        firsts = [d for d in out.calls if d.name]
        assert [d.index for d in firsts] == list(range(len(calls)))  # each call opens with its name, in order
        for d in out.calls:  # a call's fragments come after its first delta, none before
            assert d.index <= max(f.index for f in firsts if out.calls.index(f) <= out.calls.index(d))


def test_arguments_stream_before_the_call_ends():
    parser = FORMATS["hermes"][0]()
    head = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert [(d.name, d.arguments) for d in head.calls] == [("get_weather", ""), ("", '{"city": "Par')]


def test_kimi_returns_its_own_call_ids():
    # Kimi's template writes the id back with the result ("## Return of functions.get_weather:0").
    assert parse_whole(FORMATS["kimi_k2"][0](), KIMI_DOCS)[1][0].id == "functions.get_weather:0"


def test_mistral_ids_are_what_its_templates_accept():
    [call] = parse_whole(FORMATS["mistral"][0](), MISTRAL_ARRAY)[1]
    assert len(call.id) == 9 and call.id.isalnum()


def test_qwen3_template_rendering_of_a_call_parses_back():
    """The Qwen3 template's own rendering of an assistant call (tests/modelfile: Qwen/Qwen3-0.6B's template)."""
    arguments = {"city": "K\u00f8benhavn", "days": [1, 2]}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}]
    rendered = ChatTemplate(QWEN3).render(messages, add_generation_prompt=False)
    reply = rendered.split("<|im_start|>assistant\n")[-1].removesuffix("<|im_end|>\n")
    reply = reply.split("</think>\n\n")[-1]  # Qwen3 writes an empty think block before the last reply
    assert calls_of(parse_whole(FORMATS["hermes"][0](), reply)[1]) == [("get_weather", arguments)]


GLM45 = (REPO / "tests" / "data" / "chat_templates" / "glm45.jinja").read_text()


def test_glm45_template_rendering_of_calls_parses_back():
    """Strings are written bare, everything else as JSON (the template's `tojson`); both come back."""
    arguments = {"city": "K\u00f8benhavn", "days": [1, 2], "units": {"temp": "C"}, "hourly": True, "n": 3}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": arguments}},
                    {"type": "function", "function": {"name": "get_time", "arguments": {}}}]}]
    rendered = ChatTemplate(GLM45).render(messages, add_generation_prompt=False)
    reply = rendered.split("<|assistant|>")[-1].removeprefix("\n<think></think>")
    assert calls_of(parse_whole(FORMATS["glm45"][0](), reply)[1]) == [("get_weather", arguments), ("get_time", {})]


def test_glm45_is_read_off_its_template_too():
    assert detect_tool_format(make_tokenizer(), GLM45, None).name == "glm45"


def test_glm45_string_parameters_stay_strings():
    """A string that reads as JSON ("42", "true") is a string where the request's schema says so."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}, "n": {"type": "integer"}, "flag": {"type": "string"}}}}}]
    calling = ToolCalling("auto", string_parameters=string_parameters(tools))
    reply = "<tool_call>f\n<arg_key>code</arg_key>\n<arg_value>42</arg_value>\n<arg_key>n</arg_key>\n" \
            "<arg_value>42</arg_value>\n<arg_key>flag</arg_key>\n<arg_value>true</arg_value>\n</tool_call>"
    parser = ToolFormat("glm45", {}).parser(calling)
    assert calls_of(parse_whole(parser, reply)[1]) == [("f", {"code": "42", "n": 42, "flag": "true"})]
    assert calls_of(parse_whole(FORMATS["glm45"][0](), reply)[1]) == [("f", {"code": 42, "n": 42, "flag": True})]
    nan = "<tool_call>f<arg_key>x</arg_key><arg_value>NaN</arg_value></tool_call>"  # not JSON: a string
    assert json.loads(parse_whole(FORMATS["glm45"][0](), nan)[1][0].arguments) == {"x": "NaN"}


def test_a_glm45_reply_cut_short_keeps_its_complete_arguments():
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>da"
    assert calls_of(parse_whole(FORMATS["glm45"][0](), text)[1]) == [("get_weather", {"city": "Paris"})]


def test_text_that_is_no_call_stays_content():
    for fmt, text in [("hermes", "a <tool_call> b"), ("hermes", "x <tool_cal"), ("deepseek", "plain"),
                      ("kimi_k2", "plain <|tool"), ("mistral", "[TOOL"), ("harmony", "plain"),
                      ("glm45", "a <tool_cal")]:
        content, calls = parse_whole(FORMATS[fmt][0](), text)
        assert (content, calls) == (text, []), fmt


# --- tool_choice's forced shapes ----------------------------------------------------------------

def test_a_named_reply_is_one_call_of_that_function():
    out = streamed(NamedCall("get_weather"), ' {"city": "Oslo"}', random.Random(0))
    assert out.content == "" and calls_of(assemble(out.calls)) == [("get_weather", {"city": "Oslo"})]


def test_a_required_reply_is_its_array_of_calls():
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"parameters": {}, "name": "get_time"}]'
    for seed in range(10):
        out = streamed(RequiredCalls(), text, random.Random(seed))
        assert calls_of(assemble(out.calls)) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]


# --- choosing the format ------------------------------------------------------------------------

@pytest.mark.parametrize("added, expected", [
    ((kimi_k2.SECTION_BEGIN, *kimi_k2.MARKERS[1:]), "kimi_k2"),
    (deepseek.MARKERS, "deepseek"),
    (mistral.MARKERS, "mistral"),
    (glm45.MARKERS, "glm45"),  # <tool_call> among them, as in GLM's vocabulary: <arg_key> decides
    (hermes.MARKERS, "hermes"),
    ((), "hermes"),  # nothing recognised: the fallback
])
def test_the_format_comes_from_the_vocabulary(added, expected):
    tokenizer = make_tokenizer(control=added)
    fmt = detect_tool_format(tokenizer, "", detect_reasoning_format(tokenizer))
    assert fmt.name == expected and set(fmt.markers) == set(added)


def test_gpt_oss_is_harmony_and_the_override_wins():
    harmony = make_tokenizer(control=HARMONY_MARKERS)
    assert detect_tool_format(harmony, "", detect_reasoning_format(harmony)).name == "harmony"
    assert detect_tool_format(harmony, "", None, override="mistral").name == "mistral"
    assert detect_tool_format(harmony, "", None, override="none") is None


# --- the serving path: tokens -> reasoning, content and call deltas ------------------------------

def serve(tokenizer, ids, calling: ToolCalling, prompt_ids=(7,)) -> tuple[TextDelta, ToolCallText]:
    reasoning = detect_reasoning_format(tokenizer)
    fmt = detect_tool_format(tokenizer, "", reasoning)
    inner = output_text(tokenizer, (), reasoning, list(prompt_ids), parse=True, inline=False, tool_markup=fmt.markers)
    text = ToolCallText(inner, fmt.parser(calling), calling.single)
    return sum([text.add(i) for i in ids] + [text.flush()], TextDelta()), text


def test_control_token_markers_reach_the_parser():
    """Mistral's [TOOL_CALLS] is a control token, which decoding skips: the parser gets it written out."""
    tokenizer = make_tokenizer(control=mistral.MARKERS)
    total, text = serve(tokenizer, tokenizer.encode(MISTRAL_V11), ToolCalling("auto"))
    assert total.content == "" and text.has_tool_calls
    assert calls_of(assemble(total.tool_calls)) == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_parallel_tool_calls_false_keeps_the_first_call():
    tokenizer = make_tokenizer(control=mistral.MARKERS)
    total, _ = serve(tokenizer, tokenizer.encode(MISTRAL_V11), ToolCalling("auto", single=True))
    assert calls_of(assemble(total.tool_calls)) == [("get_weather", {"city": "Paris"})]


def test_harmony_calls_come_out_of_the_messages():
    harmony = make_tokenizer(control=HARMONY_MARKERS)
    prompt = harmony.encode("<|start|>user<|message|>Weather?<|end|><|start|>assistant")
    total, _ = serve(harmony, harmony.encode(HARMONY_DOCS), ToolCalling("auto"), prompt)
    assert total.reasoning == "Need to use function get_current_weather." and total.content == ""
    assert calls_of(assemble(total.tool_calls)) == [("get_current_weather", {"location": "San Francisco"})]


def test_harmony_final_answers_stay_content():
    harmony = make_tokenizer(control=HARMONY_MARKERS)
    reply = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Hi there<|return|>"
    total, text = serve(harmony, harmony.encode(reply), ToolCalling("auto"))
    assert (total.reasoning, total.content, total.tool_calls, text.has_tool_calls) == ("Easy.", "Hi there", (), False)


def test_forced_replies_need_no_markers():
    tokenizer = make_tokenizer()
    fmt = ToolFormat("hermes", {})
    inner = output_text(tokenizer, (), None, [7], parse=True, inline=False)
    text = ToolCallText(inner, fmt.parser(ToolCalling("named", "f")))
    total = sum([text.add(i) for i in tokenizer.encode('{"a": 1}')] + [text.flush()], TextDelta())
    assert calls_of(assemble(total.tool_calls)) == [("f", {"a": 1})] and total.content == ""
