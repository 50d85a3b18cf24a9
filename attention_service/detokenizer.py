"""Generated tokens -> streamed text, with stop strings held back across token boundaries.

Text is released only when it can no longer change: not while the tail is an incomplete UTF-8
sequence, and not while it could still be the start of a stop string.
"""
from __future__ import annotations

from typing import Sequence

from modelfile.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._released = 0  # characters of the text already handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append one token; return the text that became final (may be empty)."""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        cut = self._stop_position(text)
        if cut is not None:
            self.stopped = True
            return self._release(text, cut)
        end = len(text)
        if text.endswith(_INCOMPLETE):
            end = len(text.rstrip(_INCOMPLETE))
        return self._release(text, end - self._held_back(text[:end]))

    def flush(self) -> str:
        """At the end of generation: whatever was held back for a stop string that never came."""
        if self.stopped:
            return ""
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        return self._release(text, len(text))

    def _release(self, text: str, end: int) -> str:
        if end <= self._released:
            return ""
        out = text[self._released : end]
        self._released = end
        return out

    def _stop_position(self, text: str) -> int | None:
        # Only text not yet released can hold a new stop string (it may straddle the boundary).
        start = max(0, self._released - max((len(s) for s in self._stop), default=0))
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
