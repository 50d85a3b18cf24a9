"""engine/token_mask.py, and the sampler on masked rows."""
import json

import pytest
import torch

from splitmoe.attention_service.engine.grammar import GrammarCompiler, StructuredOutput
from splitmoe.attention_service.engine.sampling import RequestSampler, SamplingOptions
from splitmoe.attention_service.engine.token_mask import TokenMasks
from tests.attention_service.engine.test_reasoning import make_tokenizer

DIGITS = {ord(c) for c in "0123456789"}


@pytest.fixture(scope="module")
def compiler():
    tokenizer = make_tokenizer()
    return GrammarCompiler(tokenizer, tokenizer.vocab_size)


def integer_grammar(compiler):
    return compiler.compile(StructuredOutput("json_schema", json.dumps({"type": "integer", "minimum": 0})))


def test_only_constrained_rows_are_masked_and_the_others_untouched(compiler):
    masks = TokenMasks(compiler.vocab_size)
    logits = torch.randn(4, compiler.vocab_size)
    before = logits.clone()
    masked = masks.masked_rows(logits, [(1, integer_grammar(compiler)), (3, integer_grammar(compiler))])
    assert sorted(masked) == [1, 3]
    assert torch.equal(logits, before)  # the batch's logits are left as they were
    for row in masked.values():
        kept = torch.isfinite(row).nonzero().flatten().tolist()
        assert set(kept) == DIGITS  # a first digit
    assert torch.equal(masked[1][sorted(DIGITS)], before[1][sorted(DIGITS)])
    assert masks.masked_rows(logits, []) == {}  # a batch without constraints does no work


def test_rows_of_different_grammars_in_one_batch(compiler):
    masks = TokenMasks(compiler.vocab_size)
    obj = compiler.compile(StructuredOutput("json_object"))
    allowed = masks.allowed([integer_grammar(compiler), obj])
    assert set(allowed[0].nonzero().flatten().tolist()) == DIGITS
    assert set(allowed[1].nonzero().flatten().tolist()) == {ord("{")}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampled_tokens_obey_the_mask_and_their_logprobs_are_the_masked_distribution(compiler, temperature):
    masks = TokenMasks(compiler.vocab_size)
    logits = torch.randn(compiler.vocab_size, generator=torch.Generator().manual_seed(0)) * 5
    logits[ord("x")] = 100.0  # the model's favourite is forbidden
    sampler = RequestSampler(SamplingOptions(temperature=temperature, seed=1, top_logprobs=3), compiler.vocab_size)
    stops = make_tokenizer().stop_ids
    grammar = compiler.compile(StructuredOutput("json_schema", json.dumps({"type": "integer", "minimum": 1})))
    for _ in range(20):
        row = masks.masked_rows(logits[None], [(0, grammar)])[0]
        sampled = sampler(row)
        assert sampled.token_id in DIGITS | stops
        assert sampled.logprob == pytest.approx(float(torch.log_softmax(row, -1)[sampled.token_id]))
        assert all(t in DIGITS | stops for t, _ in sampled.top)
        assert grammar.accept(sampled.token_id)
        if grammar.finished:
            break
