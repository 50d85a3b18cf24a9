"""Streamed text: stop strings held back across token boundaries, partial UTF-8 never released."""
import pytest

from splitmoe.attention_service.engine.detokenizer import Detokenizer
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(demo_gguf):
    return Tokenizer.from_gguf_metadata(GGUFFile(demo_gguf).metadata)


def stream(tokenizer, text, stop=()):
    d = Detokenizer(tokenizer, stop)
    pieces = []
    for token in tokenizer.encode(text):
        pieces.append(d.add(token))
        if d.stopped:
            break
    pieces.append(d.flush())
    return pieces, d.stopped


def test_without_stop_strings_the_text_comes_back_whole(tokenizer):
    text = "the thing — in the water: 水 ok"
    pieces, stopped = stream(tokenizer, text)
    assert "".join(pieces) == text and not stopped
    assert all("\ufffd" not in p for p in pieces)  # multi-byte characters wait for their last byte


def test_stop_string_is_cut_and_never_streamed(tokenizer):
    pieces, stopped = stream(tokenizer, "hello world STOP and more", stop=("STOP",))
    assert stopped
    assert "".join(pieces) == "hello world "
    assert not any("S" in p for p in pieces)


def test_prefix_of_a_stop_string_is_held_back_then_released(tokenizer):
    pieces, stopped = stream(tokenizer, "an Sx that is not it", stop=("STOP",))
    assert not stopped and "".join(pieces) == "an Sx that is not it"
    released_before_x = "".join(pieces[: pieces.index(next(p for p in pieces if "x" in p))])
    assert not released_before_x.endswith("S")


def test_earliest_of_several_stop_strings_wins(tokenizer):
    pieces, stopped = stream(tokenizer, "one two three", stop=("three", "two"))
    assert stopped and "".join(pieces) == "one "


class WholeTextDetokenizer:
    """The definition the incremental Detokenizer must match: decode every id each time."""

    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids, self.released, self.stopped = [], 0, False

    def add(self, token_id):
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        start = max(0, self.released - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._release(text, min(hits))
        end = len(text.rstrip("\ufffd"))
        held = max([n for s in self.stop for n in range(1, len(s)) if text[:end].endswith(s[:n])], default=0)
        return self._release(text, end - held)

    def flush(self):
        if self.stopped:
            return ""
        return self._release(self.tokenizer.decode(self.ids, skip_special_tokens=True), 10**9)

    def _release(self, text, end):
        out = text[self.released:end] if end > self.released else ""
        self.released = max(self.released, min(end, len(text)))
        return out


def test_incremental_decoding_matches_decoding_everything(tokenizer):
    rng = __import__("random").Random(0)
    texts = ["the thing — in the water: 水 ok", "naïve café 🙂 déjà vu, STOP here", "a\nb\n\nc  d\t e",
             "ééé 水水 🙂🙂"]
    vocab = tokenizer.encode("".join(texts))
    for trial in range(60):
        ids = tokenizer.encode(rng.choice(texts)) if trial % 2 else [rng.choice(vocab) for _ in range(30)]
        stop = rng.choice([(), ("STOP",), ("水",), ("e", "ca"), (" d", "🙂")])
        new, old = Detokenizer(tokenizer, stop), WholeTextDetokenizer(tokenizer, stop)
        pieces_new, pieces_old = [], []
        for token in ids:
            pieces_new.append(new.add(token))
            pieces_old.append(old.add(token))
            if new.stopped or old.stopped:
                break
        pieces_new.append(new.flush())
        pieces_old.append(old.flush())
        assert new.stopped == old.stopped
        assert "".join(pieces_new) == "".join(pieces_old), (ids, stop)
        assert pieces_new == pieces_old, (ids, stop)


def test_a_long_stream_costs_the_same_per_token(tokenizer):
    """Each token decodes a window of a few ids, not the whole output."""
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens=False):
            calls.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    d = Detokenizer(Counting(), ("never",))
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 40)
    text = "".join(d.add(t) for t in ids) + d.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(calls) <= 8
