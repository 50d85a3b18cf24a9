"""engine/grammar.py: a structured output compiled for the demo vocabulary (token b is byte b)."""
import json

import pytest

from splitmoe.attention_service.engine.grammar import GrammarCompiler, StructuredOutput
from splitmoe.attention_service.engine.token_mask import TokenMasks
from tests.attention_service.engine.test_reasoning import make_tokenizer

SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
                     "required": ["n", "s"], "additionalProperties": False})


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, tokenizer.vocab_size + 8)  # the model pads its vocabulary


def allowed(compiler, grammar) -> set[int]:
    return set(TokenMasks(compiler.vocab_size).allowed([grammar])[0].nonzero().flatten().tolist())


def feed(grammar, text: str) -> None:
    for b in text.encode():
        assert grammar.accept(b), text


def test_a_valid_answer_is_accepted_and_ends_the_grammar(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutput("json_schema", SCHEMA))
    assert allowed(compiler, grammar) == {ord("{")}
    feed(grammar, '{"n":12,"s":"h')
    assert not grammar.finished
    feed(grammar, 'i"}')
    assert grammar.finished  # nothing may follow: the request stops here
    assert allowed(compiler, grammar) <= tokenizer.stop_ids


def test_a_token_the_grammar_forbids_is_refused(compiler):
    grammar = compiler.compile(StructuredOutput("json_schema", SCHEMA))
    assert not grammar.accept(ord("["))
    assert grammar.error


def test_end_of_sequence_only_when_the_answer_is_complete(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutput("json_schema", json.dumps({"type": "integer"})))
    assert not allowed(compiler, grammar) & tokenizer.stop_ids
    feed(grammar, "42")
    assert allowed(compiler, grammar) >= tokenizer.stop_ids | {ord("0")}  # more digits, or the end


def test_markers_and_padding_are_never_text(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutput("json_schema", json.dumps({"type": "string"})))
    feed(grammar, '"')
    inside = allowed(compiler, grammar)
    assert ord("a") in inside and ord('"') in inside
    assert not inside & (tokenizer.special_ids | tokenizer.stop_ids)
    assert not inside & set(range(tokenizer.vocab_size, compiler.vocab_size))


def test_json_object_is_any_object(compiler):
    grammar = compiler.compile(StructuredOutput("json_object"))
    feed(grammar, '{"a":[1,{"b":null}],"c":"d"}')
    assert grammar.finished


@pytest.mark.parametrize("schema, words", [
    ("{", "not valid JSON"),
    ("[1]", "must be an object"),
    ('{"type": "strin"}', "Invalid type"),
    ('{"$ref": "#/nowhere"}', "nowhere"),
    ('{"type": "string", "pattern": "(?<=a)b"}', "look-around"),
])
def test_a_schema_the_engine_cannot_use_is_a_value_error(compiler, schema, words):
    with pytest.raises(ValueError, match=words):
        compiler.compile(StructuredOutput("json_schema", schema))
