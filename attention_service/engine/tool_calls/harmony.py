"""gpt-oss's calls, harmony messages addressed to a function (vLLM's `openai` parser):

    <|channel|>analysis<|message|>Need to use function get_current_weather.<|end|><|start|>assistant
    <|channel|>commentary to=functions.get_current_weather <|constrain|>json<|message|>
    {"location":"San Francisco"}<|call|>

The recipient (`to=functions.NAME`) may stand in the role part of the header or in the channel
part. A message to a function is a call, its body the arguments; `analysis` bodies are reasoning
(the reasoning parser has taken them out before this one runs; here they are dropped); every other
body is content. In the serving path, HarmonyParser writes the markup of non-analysis messages
out for this parser (its `tool_markup` mode).
"""
from __future__ import annotations

import re

from splitmoe.attention_service.engine.tool_calls.base import StatesParser

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
MARKERS = (START, CHANNEL, MESSAGE, *ENDS, "<|constrain|>")
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_REASONING_CHANNEL = "analysis"


class HarmonyToolParser(StatesParser):
    def _content(self, final: bool) -> bool:
        marker = self._content_until((START, CHANNEL, *ENDS), final)
        if marker is None:
            return False
        if marker in (START, CHANNEL):
            self._buffer = marker + self._buffer  # the header parse reads which part it is in
            self._state = self._header
        return True

    def _header(self, final: bool) -> bool:
        at = self._buffer.find(MESSAGE)
        if at < 0:
            return False
        header, self._buffer = self._buffer[:at], self._buffer[at + len(MESSAGE):]
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL_NAME.search(header)
        if recipient and recipient[1].startswith(FUNCTIONS):
            self._begin_call(recipient[1][len(FUNCTIONS):])
            self._state = self._args
        elif channel and channel[1] == _REASONING_CHANNEL:
            self._state = self._skip
        else:
            self._state = self._content
        return True

    def _args(self, final: bool) -> bool:
        if not self._stream_arguments((*ENDS, START, CHANNEL), final):
            return False
        self._state = self._skip
        return True

    def _skip(self, final: bool) -> bool:
        """To the end of the message (an analysis body; what follows a call's arguments)."""
        if self._skip_until(ENDS, final) is None:
            return False
        self._state = self._content
        return True
