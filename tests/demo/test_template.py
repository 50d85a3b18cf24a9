"""splitmoe/demo/template.py: Qwen3's rendering where tools are in play, ChatML's where they are not."""
from __future__ import annotations

import random

from splitmoe.attention_service.engine.tool_calls import detect_tool_format
from splitmoe.demo import corpus, vocab
from splitmoe.demo.template import CHAT_TEMPLATE, TOOL_TOKENS
from splitmoe.modelfile.chat_template import CHATML_TEMPLATE, ChatTemplate
from tests.modelfile.test_chat_template import QWEN3

DEMO, CHATML, QWEN = ChatTemplate(CHAT_TEMPLATE), ChatTemplate(CHATML_TEMPLATE), ChatTemplate(QWEN3)


def test_chats_without_tools_render_as_chatml():
    chats = [lesson.chat for lesson in corpus.chats(seed=0, num_chats=2000) if lesson.tools is None
             and not any("tool_calls" in m or m["role"] == "tool" for m in lesson.chat)]
    assert len(chats) > 1000 and any(chat[0]["role"] == "system" for chat in chats)
    for chat in chats:
        for messages, prompt in ((chat, False), (chat[:-1], True)):
            assert DEMO.render(messages, add_generation_prompt=prompt) == CHATML.render(
                messages, add_generation_prompt=prompt)


def test_chats_with_tools_render_as_qwen3s_template_renders_them():
    lessons = [lesson for lesson in corpus.skill_round(random.Random(0)) if lesson.tools]
    system = {"role": "system", "content": "You are a helpful assistant."}
    lessons += [corpus.Lesson([system, *lesson.chat], lesson.tools) for lesson in lessons[:20]]
    two_calls = corpus.weather_call("Paris")
    two_calls["tool_calls"] += corpus.weather_call("Rome")["tool_calls"]
    lessons.append(corpus.Lesson([{"role": "user", "content": "Paris and Rome?"}, two_calls,
                                  {"role": "tool", "tool_call_id": "a", "content": "18"},
                                  {"role": "tool", "tool_call_id": "b", "content": "21"}], [corpus.WEATHER_TOOL]))
    assert any(len(lesson.chat) > 2 for lesson in lessons)  # results of calls are among them
    for lesson in lessons:
        prompt = lesson.chat if lesson.chat[-1]["role"] == "tool" else lesson.chat[:-1]
        assert DEMO.render(prompt, tools=lesson.tools) == QWEN.render(prompt, tools=lesson.tools)


def test_the_vocabulary_holds_the_markers_and_the_server_reads_calls_as_hermes():
    meta = vocab.tokenizer_metadata(vocab.learn_merges(corpus.words(), 2000))
    tok = vocab.tokenizer(meta)
    for marker in TOOL_TOKENS:
        [token] = tok.encode(marker)
        assert tok.decode([token], skip_special_tokens=True) == marker  # written out, not skipped
    for word in ("_weather", ' {"', '":"', " Tokyo"):
        assert len(tok.encode(word)) == 1, word
    assert detect_tool_format(tok, CHAT_TEMPLATE, reasoning=None).name == "hermes"
