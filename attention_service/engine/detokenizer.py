"""Generated tokens -> streamed text, with stop strings held back across token boundaries.

Text is released only when it can no longer change: not while the tail is an incomplete UTF-8
sequence, and not while it could still be the start of a stop string.

Decoding is incremental, as vLLM's detokenizer: each token decodes only a short window of ids
(from `prefix` up), in the context of the tokens before it so that leading spaces and merged
bytes come out as a whole decode would give them, and the window moves on once its text is
complete. Only the text that a stop string could still reach is kept, so a token costs the same
at the thousandth token as at the first.
"""
from __future__ import annotations

from typing import Sequence

from splitmoe.modelfile.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] is context already turned into text
        self._read = 0  # ids[read:] have not been turned into text yet
        self._text = ""  # complete text from character `_base` on (what a stop string may still reach)
        self._base = 0
        self._released = 0  # characters of the whole text already handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append one token; return the text that became final (may be empty)."""
        self._ids.append(token_id)
        pending = self._advance()
        text = self._text + pending.rstrip(_INCOMPLETE)
        cut = self._stop_position(text)
        if cut is not None:
            self.stopped = True
            return self._release(text, cut)
        return self._release(text, len(text) - self._held_back(text))

    def flush(self) -> str:
        """At the end of generation: whatever was held back for a stop string that never came."""
        if self.stopped:
            return ""
        text = self._text + self._pending()
        return self._release(text, len(text))

    def _pending(self) -> str:
        """Text of the ids not yet complete: the window's decode beyond its context's."""
        decode = self._tokenizer.decode
        context = decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        window = decode(self._ids[self._prefix :], skip_special_tokens=True)
        return window[len(context) :] if len(window) > len(context) else ""

    def _advance(self) -> str:
        """Move complete text into `_text`; return what is still pending (an unfinished character)."""
        pending = self._pending()
        if not pending or pending.endswith(_INCOMPLETE):
            return pending
        self._text += pending
        self._prefix, self._read = self._read, len(self._ids)
        return ""

    def _release(self, text: str, end: int) -> str:
        """Hand out text[released:end] (offsets relative to `_base`) and forget what no stop string
        can reach any more."""
        released = self._released - self._base
        if end <= released:
            return ""
        out = text[released:end]
        self._released += end - released
        keep_from = min(max(0, end - self._max_stop), len(self._text))  # pending text is not in _text
        if keep_from > 0:
            self._text = self._text[keep_from:]
            self._base += keep_from
        return out

    def _stop_position(self, text: str) -> int | None:
        # Only text not yet released can hold a new stop string (it may straddle the boundary).
        start = max(0, self._released - self._base - self._max_stop)
        hits = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
