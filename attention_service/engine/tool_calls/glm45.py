"""GLM-4.5 / 4.6's calls (vLLM's `glm45` parser):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>[1, 2]</arg_value>
    </tool_call>

The name runs to the line's end (or straight into the first `<arg_key>`: GLM-4.7 writes no
newlines); each argument is a key and a value, the value as the template wrote it: JSON for
non-strings (its `tojson`), the bare text for strings. The arguments stream out as one JSON object,
an argument at a time. A parameter the request's schema types as a string is read as the text it
is; any other value that parses as JSON is that JSON value, else a string, as vLLM reads them.
`<tool_call>` is also Qwen's marker: GLM is told apart by `<arg_key>`.
"""
from __future__ import annotations

import json
from typing import Collection, Mapping

from splitmoe.attention_service.engine.tool_calls.base import StatesParser, find_first

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
MARKERS = (OPEN, CLOSE, KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE)


def argument_value(text: str) -> str:
    """One value as JSON text: itself where it is JSON (strict: no NaN or Infinity, which Python's
    parser takes and clients' refuse), else the string it is."""
    try:
        json.loads(text, parse_constant=_not_json)
        return text.strip()
    except ValueError:
        return json.dumps(text, ensure_ascii=False)


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


class Glm45Parser(StatesParser):
    def __init__(self, string_parameters: Mapping[str, Collection[str]] | None = None) -> None:
        """string_parameters: function name -> its parameters typed as strings."""
        super().__init__()
        self._string_parameters = string_parameters or {}
        self._strings: Collection[str] = ()  # the current call's
        self._num_arguments = 0
        self._arg_key = ""

    def _content(self, final: bool) -> bool:
        if self._content_until((OPEN,), final) is None:
            return False
        self._state = self._name
        return True

    def _name(self, final: bool) -> bool:
        hit = find_first(self._buffer, ("\n", KEY_OPEN, CLOSE))
        if hit is None and not final:
            return False
        at = hit[0] if hit else len(self._buffer)
        name = self._buffer[:at].strip()
        self._begin_call(name)
        self._strings = self._string_parameters.get(name, ())
        self._buffer, self._num_arguments, self._state = self._buffer[at:], 0, self._args
        return True

    def _args(self, final: bool) -> bool:
        """Between arguments: the next key, or the call's end."""
        marker = self._skip_until((KEY_OPEN, CLOSE), final)
        if marker is None:
            return self._cut_short(final)
        if marker == CLOSE:
            self._end_call()
            return True
        self._state = self._key
        return True

    def _key(self, final: bool) -> bool:
        at = self._buffer.find(KEY_CLOSE)
        if at < 0:
            return self._cut_short(final)
        self._arg_key, self._buffer = self._buffer[:at].strip(), self._buffer[at + len(KEY_CLOSE):]
        self._state = self._valueopen
        return True

    def _valueopen(self, final: bool) -> bool:
        if self._skip_until((VALUE_OPEN,), final) is None:
            return self._cut_short(final)
        self._state = self._value
        return True

    def _value(self, final: bool) -> bool:
        at = self._buffer.find(VALUE_CLOSE)
        if at < 0:
            return self._cut_short(final)
        opening = "{" if not self._num_arguments else ", "
        text = self._buffer[:at]
        value = json.dumps(text, ensure_ascii=False) if self._arg_key in self._strings else argument_value(text)
        self._emit_arguments(f"{opening}{json.dumps(self._arg_key, ensure_ascii=False)}: {value}")
        self._num_arguments += 1
        self._buffer, self._state = self._buffer[at + len(VALUE_CLOSE):], self._args
        return True

    def _end_call(self) -> None:
        self._emit_arguments("}" if self._num_arguments else "{}")
        self._state = self._content

    def _cut_short(self, final: bool) -> bool:
        """The reply ended inside a call: its complete arguments are closed as they are."""
        if final:
            self._buffer = ""
            self._end_call()
        return False
