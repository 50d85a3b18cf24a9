"""DeepSeek's calls (vLLM's `deepseek_v3` and `deepseek_v31` parsers, one parser here for both).

V3 and R1 (their chat template's rendering of a call):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 dropped the type and the fence: `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
<｜tool▁call▁end｜>`. Which one a call is shows before `<｜tool▁sep｜>`: the word `function` (V3's
type), or the name.
"""
from __future__ import annotations

from splitmoe.attention_service.engine.tool_calls.base import SectionedCallsParser

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
_V3_TYPE = "function"
_FENCE = "```"


class DeepSeekParser(SectionedCallsParser):
    SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END = CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END
    ARGS_ENDS = (CALL_END, _FENCE)

    def _header(self, final: bool) -> bool:
        at = self._buffer.find(SEP)
        if at < 0:
            return False
        header, self._buffer = self._buffer[:at].strip(), self._buffer[at + len(SEP):]
        if header == _V3_TYPE:
            self._state = self._v3name
        else:
            self._begin_call(header)
            self._state = self._args
        return True

    def _v3name(self, final: bool) -> bool:
        """V3: the name runs to the end of its line, then the ```json fence opens the arguments."""
        at = self._buffer.find(_FENCE)
        if at < 0:
            return False
        line_end = self._buffer.find("\n", at)
        if line_end < 0:
            return False
        self._begin_call(self._buffer[:at])
        self._buffer = self._buffer[line_end + 1:]
        self._state = self._args
        return True
