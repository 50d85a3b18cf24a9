"""Mistral's calls (vLLM's `mistral` parser), in both of its tokenizers' formats:

* before tokenizer v11 (Mixtral-8x22B-Instruct, Mistral-7B-Instruct-v0.3): a JSON array,
  `[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]`;
* v11 on (Mistral-Small-3.2, Magistral, Devstral): one marker per call,
  `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`, an optional `[CALL_ID]id` before `[ARGS]`.

`[TOOL_CALLS]` and `[ARGS]` are control tokens: the decoder writes them out for this parser.
"""
from __future__ import annotations

import secrets
import string

from splitmoe.attention_service.engine.tool_calls.base import StatesParser
from splitmoe.attention_service.engine.tool_calls.json_calls import CallArray

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
MARKERS = (TOOL_CALLS, ARGS, CALL_ID)


class MistralParser(StatesParser):
    def __init__(self) -> None:
        super().__init__()
        self._calls: CallArray | None = None

    def _new_id(self) -> str:
        # Mistral's templates refuse any other id when the call comes back in the next turn.
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def _content(self, final: bool) -> bool:
        if self._content_until((TOOL_CALLS,), final) is None:
            return False
        self._state = self._kind
        return True

    def _kind(self, final: bool) -> bool:
        """After [TOOL_CALLS]: `[` opens the old format's array; anything else is a name."""
        self._buffer = self._buffer.lstrip()
        if not self._buffer:
            return False
        if self._buffer[0] == "[" and not self._buffer.startswith(MARKERS):
            self._state, self._calls = self._array, CallArray(self)
        else:
            self._state = self._name
        return True

    def _array(self, final: bool) -> bool:
        rest = self._calls.feed(self._buffer)
        self._buffer = rest or ""
        if rest is None:
            if final:
                self._calls.finish()
            return False
        self._state = self._content
        return True

    def _name(self, final: bool) -> bool:
        at = self._buffer.find(ARGS)
        if at < 0:
            return False
        name, self._buffer = self._buffer[:at], self._buffer[at + len(ARGS):]
        name, _, call_id = name.partition(CALL_ID)
        self._begin_call(name, call_id.strip())
        self._state = self._args
        return True

    def _args(self, final: bool) -> bool:
        if not self._stream_arguments((TOOL_CALLS,), final):
            return False
        self._state = self._content
        return True
