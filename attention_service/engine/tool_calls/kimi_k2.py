"""Kimi-K2's calls (vLLM's `kimi_k2` parser):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Beijing"}<|tool_call_end|><|tool_calls_section_end|>

The text between `<|tool_call_begin|>` and `<|tool_call_argument_begin|>` is the call's id,
`functions.NAME:INDEX`; Kimi's template writes that id back when the result returns (`## Return of
functions.get_weather:0`), so it is the id the client gets, as vLLM returns it.
"""
from __future__ import annotations

import re

from splitmoe.attention_service.engine.tool_calls.base import SectionedCallsParser

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END)
_ID = re.compile(r"(?:functions\.)?(?P<name>.+?)(?::\d+)?")


class KimiK2Parser(SectionedCallsParser):
    SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END = SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END
    ARGS_ENDS = (CALL_END, SECTION_END)

    def _header(self, final: bool) -> bool:
        at = self._buffer.find(ARGS_BEGIN)
        if at < 0:
            return False
        call_id, self._buffer = self._buffer[:at].strip(), self._buffer[at + len(ARGS_BEGIN):]
        match = _ID.fullmatch(call_id)
        self._begin_call(match["name"] if match else "", call_id or "")
        self._state = self._args
        return True
