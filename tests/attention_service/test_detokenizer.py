"""Streamed text: stop strings held back across token boundaries, partial UTF-8 never released."""
import pytest

from attention_service.detokenizer import Detokenizer
from modelfile.gguf_file import GGUFFile
from modelfile.tokenizer import Tokenizer


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
