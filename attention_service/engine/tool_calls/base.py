"""What every tool-call parser shares: the deltas it emits, the scanning of marked-up text, and the
whole-text parse (the streaming parser fed everything at once, so the two can never disagree).

A parser reads the reply's content as it is released and splits it into content outside calls and
`ToolCallDelta`s, in the order OpenAI streams them: a call's first delta carries its index, id and
name; later ones carry fragments of its arguments (JSON text), which concatenate to the whole.
"""
from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Sequence


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int            # the call's position in the reply, from 0
    id: str = ""          # first delta only
    name: str = ""        # first delta only
    arguments: str = ""   # a fragment of the arguments' JSON text


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str        # JSON text


@dataclass(slots=True)
class Parsed:
    """What a parser released: content outside calls, and call deltas."""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls += other.calls
        return self


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)  # OpenAI's ids are call_ and 24 characters


def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`: text that
    may still turn into a marker, held back until the next piece decides it."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


def find_first(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """(position, marker) of the earliest marker in `text`, or None."""
    hits = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(hits) if hits else None


class JsonEnd:
    """Finds where a JSON value ends in text arriving piece by piece: strings and escapes tracked,
    brackets counted. Only objects and arrays are followed; anything else is not JSON arguments."""

    def __init__(self) -> None:
        self.depth = 0
        self.started = False
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> int | None:
        """The length of `text` up to and including the value's last character, or None if it goes on."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self.depth += 1
                self.started = True
            elif ch in "}]":
                self.depth -= 1
                if self.started and self.depth == 0:
                    return i + 1
        return None


class Arguments:
    """A call's arguments as they stream: a JSON object (or array) followed to its closing bracket,
    or, when the model writes something else, raw text up to one of `ends`. Leading whitespace is
    dropped. `feed` returns (fragment, rest): rest is None while the arguments go on, else the text
    after them (the end marker still in it, for the format to consume)."""

    def __init__(self, ends: Sequence[str]) -> None:
        self._ends = tuple(ends)
        self._json: JsonEnd | None = None
        self._raw = ""  # raw mode: text held back (a possible end marker, trailing whitespace)
        self._mode = ""  # "" undecided | "json" | "raw"

    def feed(self, text: str) -> tuple[str, str | None]:
        if not self._mode:
            text = text.lstrip()
            if not text:
                return "", None
            self._mode = "json" if text[0] in "{[" else "raw"
            self._json = JsonEnd()
        if self._mode == "json":
            end = self._json.feed(text)
            return (text, None) if end is None else (text[:end], text[end:])
        return self._feed_raw(text)

    def _feed_raw(self, text: str) -> tuple[str, str | None]:
        self._raw += text
        hit = find_first(self._raw, self._ends)
        if hit is not None:
            out, rest = self._raw[:hit[0]].rstrip(), self._raw[hit[0]:]
            self._raw = ""
            return out, rest
        keep = len(self._raw) - partial_suffix(self._raw, self._ends)
        out = self._raw[:keep].rstrip()
        self._raw = self._raw[len(out):]
        return out, None

    def finish(self) -> str:
        """The end of the reply came first: what is left (JSON text is never held back)."""
        out, self._raw = self._raw.rstrip(), ""
        return out


class ToolCallParser(ABC):
    """The streaming skeleton: text is buffered, and `_step` (the format's state machine) consumes
    from the front of the buffer as far as it can decide, appending to `self._out`, until it makes
    no more progress. `final`: the reply has ended, nothing more will come."""

    def __init__(self) -> None:
        self._buffer = ""
        self._out = Parsed()
        self._num_calls = 0
        self._arguments: Arguments | None = None
        self._after_calls = False  # whitespace right after calls is not content

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> Parsed:
        return self._run(final=True)

    def _run(self, final: bool) -> Parsed:
        while self._buffer or final:
            if not self._step(final):
                break
        out, self._out = self._out, Parsed()
        return out

    @abstractmethod
    def _step(self, final: bool) -> bool:
        """Consume what can be decided from the front of the buffer; False: no more progress now."""

    # --- helpers for the formats ---

    def _content_until(self, markers: Sequence[str], final: bool) -> str | None:
        """Release content up to the first marker and consume the marker: return it (None: not yet
        seen, and the buffer may end in the start of one, kept)."""
        if self._after_calls:
            self._buffer = self._buffer.lstrip()
            self._after_calls = not self._buffer
        hit = find_first(self._buffer, markers)
        if hit is not None:
            at, marker = hit
            self._out.content += self._buffer[:at]
            self._buffer = self._buffer[at + len(marker):]
            return marker
        keep = 0 if final else partial_suffix(self._buffer, markers)
        self._out.content += self._buffer[:len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return None

    def _skip_until(self, markers: Sequence[str], final: bool) -> str | None:
        """Like `_content_until`, dropping the text instead (markup between the parts of a call)."""
        hit = find_first(self._buffer, markers)
        if hit is not None:
            self._buffer = self._buffer[hit[0] + len(hit[1]):]
            return hit[1]
        keep = 0 if final else partial_suffix(self._buffer, markers)
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return None

    def _begin_call(self, name: str, call_id: str = "") -> None:
        self._out.calls.append(ToolCallDelta(self._num_calls, call_id or self._new_id(), name.strip()))
        self._num_calls += 1
        self._after_calls = True

    def _new_id(self) -> str:
        return new_call_id()

    def _stream_arguments(self, ends: Sequence[str], final: bool) -> bool:
        """Continue the current call's arguments; True once they are complete (the rest stays buffered)."""
        if self._arguments is None:
            self._arguments = Arguments(ends)
        fragment, rest = self._arguments.feed(self._buffer)
        if rest is None and final:
            fragment += self._arguments.finish()
        self._emit_arguments(fragment)
        self._buffer = rest or ""
        if rest is None and not final:
            return False
        self._arguments = None
        return True

    def _emit_arguments(self, fragment: str) -> None:
        if fragment:
            self._out.calls.append(ToolCallDelta(self._num_calls - 1, arguments=fragment))


def parse_whole(parser: ToolCallParser, text: str) -> tuple[str, list[ToolCall]]:
    """The whole reply at once: its content and its calls."""
    parsed = parser.feed(text)
    parsed += parser.finish()
    return parsed.content, assemble(parsed.calls)


def assemble(deltas: Sequence[ToolCallDelta]) -> list[ToolCall]:
    """Deltas joined into calls, as a client's stream accumulator joins them."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
        call["id"] = call["id"] or d.id
        call["name"] = call["name"] or d.name
        call["arguments"] += d.arguments
    return [ToolCall(**calls[i]) for i in sorted(calls)]


def arguments_json(value) -> str:
    """Arguments given as a parsed value (a format that wraps them in its own JSON) as JSON text."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


State = Callable[[bool], bool]  # a StatesParser's state: reads the buffer (final: the reply has ended)


class StatesParser(ToolCallParser):
    """A format read as states, each a method: `_state` is the current one, and each step runs it.
    A state moves `_state` on by naming the next method, so grep finds every way into a state.
    Every reply starts in `_content`."""

    def __init__(self) -> None:
        super().__init__()
        self._state: State = self._content

    def _step(self, final: bool) -> bool:
        return self._state(final)

    @abstractmethod
    def _content(self, final: bool) -> bool:
        """Outside calls: content up to the first call's marker."""


class SectionedCallsParser(StatesParser):
    """Calls inside a section: `SECTION_BEGIN (CALL_BEGIN header arguments CALL_END)* SECTION_END`
    (DeepSeek's and Kimi-K2's formats). A subclass reads the header (`_header`: name or id, up to
    where the arguments start, then moves to `_args`); the arguments stream until one of
    `ARGS_ENDS`. A model that skips the section marker goes straight to the call."""

    SECTION_BEGIN = SECTION_END = CALL_BEGIN = CALL_END = ""
    ARGS_ENDS: tuple[str, ...] = ()

    @abstractmethod
    def _header(self, final: bool) -> bool:
        """From CALL_BEGIN to the arguments: begins the call."""

    def _content(self, final: bool) -> bool:
        marker = self._content_until((self.SECTION_BEGIN, self.CALL_BEGIN), final)
        return self._branch(marker, self.SECTION_BEGIN, self._section, self._header)

    def _section(self, final: bool) -> bool:
        """Between calls: the next call, or the end of the section."""
        marker = self._skip_until((self.CALL_BEGIN, self.SECTION_END), final)
        return self._branch(marker, self.CALL_BEGIN, self._header, self._content)

    def _branch(self, marker: str | None, first: str, if_first: State, otherwise: State) -> bool:
        """The next state by which of two markers was found; False while neither has arrived."""
        if marker is None:
            return False
        self._state = if_first if marker == first else otherwise
        return True

    def _args(self, final: bool) -> bool:
        if not self._stream_arguments(self.ARGS_ENDS, final):
            return False
        self._state = self._callend
        return True

    def _callend(self, final: bool) -> bool:
        if self._skip_until((self.CALL_END,), final) is None:
            return False
        self._state = self._section
        return True
