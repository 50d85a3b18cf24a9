"""engine.py with structured outputs: the demo model (random weights, experts in-process) answers
JSON only under a grammar, stops when the grammar ends, and the rows without one are not changed."""
import json
import queue

import pytest
import torch

from splitmoe.attention_service.engine.grammar import StructuredOutput
from splitmoe.attention_service.engine.sampling import SamplingOptions
from splitmoe.attention_service.model.runner import RunnerOptions
from splitmoe.attention_service.service import load_serving_model
from splitmoe.attention_service.settings import AttentionSettings

SCHEMA = json.dumps({"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "integer",
                     "minimum": 0, "maximum": 999}}, "required": ["k", "v"], "additionalProperties": False})


@pytest.fixture(scope="module")
def model(demo_gguf):
    model = load_serving_model(AttentionSettings(model_path=str(demo_gguf), runner=RunnerOptions(
        device=torch.device("cpu"), dtype=torch.float32, kv_cache_tokens=1024)))
    model.engine.start()
    yield model
    model.engine.stop()


def generate(model, *requests) -> list[tuple[str, str, list[int]]]:
    """(text, finish_reason, token ids) of each (request id, options, structured output), run as one batch."""
    outputs: queue.Queue = queue.Queue()
    prompt = model.tokenizer.encode("Describe it as JSON.")
    for request_id, options, constraint in requests:
        grammar = None if constraint is None else model.grammars.compile(constraint)
        model.engine.submit(model.new_request(request_id, prompt, options, outputs.put, grammar=grammar))
    results = {rid: ["", "", []] for rid, _, _ in requests}
    done = 0
    while done < len(requests):
        out = outputs.get(timeout=120)
        assert not out.error, out.error
        result = results[out.request_id]
        result[0] += out.text
        result[2] += [t.token_id for t in out.tokens]
        if out.finish_reason:
            result[1] = out.finish_reason
            done += 1
    return [tuple(results[rid]) for rid, _, _ in requests]


def test_constrained_rows_answer_json_and_free_rows_are_unchanged(model):
    free = SamplingOptions(max_tokens=24, temperature=0.0, logprobs=True, ignore_eos=True)
    alone = generate(model, ("free-alone", free, None))[0]
    schema = StructuredOutput("json_schema", SCHEMA)
    results = generate(model, ("json-0", SamplingOptions(max_tokens=64, temperature=1.0, seed=0), schema),
                       ("free", free, None),
                       ("json-1", SamplingOptions(max_tokens=64, temperature=0.0), StructuredOutput("json_object")))
    for text, finish, _ in (results[0], results[2]):
        assert finish == "stop"
        assert isinstance(json.loads(text), dict)
    answer = json.loads(results[0][0])
    assert answer["k"] in ("a", "b") and 0 <= answer["v"] <= 999
    assert results[1] == alone  # a free row beside constrained ones samples exactly as alone


def test_an_answer_cut_by_max_tokens_is_length(model):
    forced = '{"k":"'  # the schema forces this much, then an enum value, a comma, ...
    short = generate(model, ("cut", SamplingOptions(max_tokens=len(forced), temperature=0.0),
                             StructuredOutput("json_schema", SCHEMA)))[0]
    assert short[1] == "length" and forced.startswith(short[0])
