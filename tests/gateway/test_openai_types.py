"""Request validation (OpenAI's ranges and types) and conversion to the attention service's call parameters."""
import json
import logging

import pytest
from pydantic import ValidationError

from splitmoe.gateway.attention_types import ChatPrompt, ChatTurn
from splitmoe.gateway.openai_types import (
    INT32_MAX,
    INT64_MAX,
    MAX_STOP_CHARS,
    MAX_STOPS,
    ChatCompletionRequest,
    CompletionRequest,
    UnknownFieldLog,
    error_response,
    validation_error,
)
from splitmoe.proto import attention_pb2 as pb

CHAT = '{"messages": [{"role": "user", "content": "hi"}]'


def chat(extra: str = "") -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(CHAT + (", " + extra if extra else "") + "}")


def completion(body: str) -> CompletionRequest:
    return CompletionRequest.model_validate_json(body)


def error_of(model, body: str):
    with pytest.raises(ValidationError) as e:
        model.model_validate_json(body)
    return validation_error(e.value)


def test_chat_converts_to_one_generate_call_with_openai_defaults():
    [req] = chat().to_generate_params("chatcmpl-1")
    assert req.request_id == "chatcmpl-1"
    assert req.prompt == ChatPrompt(messages=(ChatTurn("user", "hi"),), add_generation_prompt=True)
    s = req.sampling
    assert s["max_tokens"] == 0  # 0: until EOS, a stop or the end of the context
    assert s["temperature"] == 1.0 and s["top_p"] == 1.0 and s["top_k"] == 0 and s["min_p"] == 0.0
    assert "seed" not in s and not s["logprobs"] and s["top_logprobs"] == 0 and s["stop"] == ()


def test_chat_sampling_parameters_reach_the_request():
    body = ('"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 11,'
            '"stop": "END", "presence_penalty": 0.5, "frequency_penalty": -0.5, "logprobs": true,'
            '"top_logprobs": 3, "ignore_eos": true, "num_experts_per_token": 4')
    s = chat(body).to_generate_params("r")[0].sampling
    assert (s["max_tokens"], s["top_k"], s["seed"], s["stop"], s["top_logprobs"]) == (7, 40, 11, ("END",), 3)
    assert s["temperature"] == 0.5 and s["top_p"] == pytest.approx(0.9) and s["min_p"] == pytest.approx(0.05)
    assert s["presence_penalty"] == 0.5 and s["frequency_penalty"] == -0.5
    assert s["logprobs"] and s["ignore_eos"] and s["num_experts_per_token"] == 4


def test_repetition_penalty_template_kwargs_and_names_reach_the_request():
    body = ('"repetition_penalty": 1.1, "chat_template_kwargs": {"enable_thinking": false}, "tool_choice": "none",'
            '"min_tokens": 0, "stop_token_ids": [], "modalities": ["text"]')  # no-op values of unsupported ones
    [req] = chat(body).to_generate_params("r")
    assert req.sampling["repetition_penalty"] == pytest.approx(1.1)
    assert req.prompt.template_kwargs == {"enable_thinking": False}
    named = ChatCompletionRequest.model_validate_json('{"messages": [{"role": "user", "content": "a", "name": "bo"}]}')
    assert named.to_generate_params("r")[0].prompt.messages == (ChatTurn("user", "a", name="bo"),)
    assert chat().to_generate_params("r")[0].sampling["repetition_penalty"] == 1.0
    [strong] = chat('"repetition_penalty": 3.5').to_generate_params("r")  # any positive value, as vLLM takes
    assert strong.sampling["repetition_penalty"] == 3.5


def test_every_sampling_option_the_wire_declares_is_sent():
    """OpenAI's defaults made explicit, never the proto's zeros: a new SamplingParams field needs its mapping."""
    declared = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}
    assert set(chat('"seed": 3').to_generate_params("r")[0].sampling) == declared
    assert set(completion('{"prompt": "a"}').to_generate_params("c")[0].sampling) == declared - {"seed"}


def test_logit_bias_keys_become_token_ids_on_both_endpoints():
    assert chat('"logit_bias": {"5": -100, "17": 2.5}').to_generate_params("r")[0].sampling["logit_bias"] == {
        5: -100.0, 17: 2.5}
    assert completion('{"prompt": "a", "logit_bias": {"0": 100}}').to_generate_params("c")[0].sampling["logit_bias"] == {
        0: 100.0}
    assert chat().to_generate_params("r")[0].sampling["logit_bias"] == {}


def test_vllms_stop_token_ids_and_min_tokens_reach_the_request():
    s = chat('"stop_token_ids": [7, 9], "min_tokens": 4, "max_tokens": 8').to_generate_params("r")[0].sampling
    assert (s["stop_token_ids"], s["min_tokens"]) == ((7, 9), 4)
    defaults = completion('{"prompt": "a"}').to_generate_params("c")[0].sampling
    assert (defaults["stop_token_ids"], defaults["min_tokens"]) == ((), 0)


def test_vllms_defaults_are_accepted_where_they_are_what_splitmoe_does():
    body = ('"skip_special_tokens": true, "spaces_between_special_tokens": true, "include_reasoning": true, '
            '"add_special_tokens": false, "priority": 0, "return_tokens_as_token_ids": false')
    chat(body)
    completion('{"prompt": "a", "add_special_tokens": true}')
    assert error_of(CompletionRequest, '{"prompt": "a", "add_special_tokens": false}').error.param == "add_special_tokens"


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat('"max_tokens": 5, "max_completion_tokens": 9').to_generate_params("r")[0].sampling["max_tokens"] == 9


def test_top_p_zero_means_greedy_not_the_protos_default():
    s = chat('"top_p": 0').to_generate_params("r")[0].sampling
    assert (s["temperature"], s["top_p"]) == (0.0, 1.0)


def test_top_k_minus_one_is_off_and_empty_stops_are_dropped():
    s = chat('"top_k": -1, "stop": ["", "a", "b"]').to_generate_params("r")[0].sampling
    assert s["top_k"] == 0 and s["stop"] == ("a", "b")


def test_n_fans_out_with_offset_seeds_and_distinct_ids():
    reqs = chat('"n": 3, "seed": 100').to_generate_params("chatcmpl-x")
    assert [r.request_id for r in reqs] == ["chatcmpl-x-0", "chatcmpl-x-1", "chatcmpl-x-2"]
    assert [r.sampling["seed"] for r in reqs] == [100, 101, 102]
    unseeded = chat('"n": 2').to_generate_params("r")
    assert all("seed" not in r.sampling for r in unseeded)


def test_seed_offset_wraps_within_int64():
    reqs = chat(f'"n": 2, "seed": {INT64_MAX}').to_generate_params("r")
    assert [r.sampling["seed"] for r in reqs] == [INT64_MAX, -INT64_MAX - 1]


def test_message_content_parts_and_developer_role():
    body = ('{"messages": [{"role": "developer", "content": "be brief"},'
            '{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},'
            '{"role": "assistant", "content": null}], "add_generation_prompt": false}')
    [req] = ChatCompletionRequest.model_validate_json(body).to_generate_params("r")
    assert req.prompt.messages == (ChatTurn("system", "be brief"), ChatTurn("user", "a\nb"), ChatTurn("assistant", ""))
    assert not req.prompt.add_generation_prompt


@pytest.mark.parametrize("body, param", [
    ('{"messages": []}', "messages"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "messages.0.role"),
    (CHAT + ', "max_tokens": -1}', "max_tokens"),
    (CHAT + ', "max_tokens": 0}', "max_tokens"),
    (CHAT + ', "max_tokens": "10"}', "max_tokens"),
    (CHAT + ', "max_tokens": 1.5}', "max_tokens"),
    (CHAT + ', "temperature": 2.5}', "temperature"),
    (CHAT + ', "temperature": -0.1}', "temperature"),
    (CHAT + ', "temperature": "hot"}', "temperature"),
    (CHAT + ', "top_p": 1.5}', "top_p"),
    (CHAT + ', "n": 0}', "n"),
    (CHAT + ', "logprobs": true, "top_logprobs": 21}', "top_logprobs"),
    (CHAT + ', "presence_penalty": 3}', "presence_penalty"),
    (CHAT + ', "stream": "yes"}', "stream"),
    (CHAT + ', "stop": 5}', "stop"),
    (CHAT + ', "seed": 1e30}', "seed"),
    (CHAT + f', "seed": {INT64_MAX + 1}}}', "seed"),
    (CHAT + f', "max_tokens": {INT32_MAX + 1}}}', "max_tokens"),
    (CHAT + f', "max_completion_tokens": {2**64}}}', "max_completion_tokens"),
    (CHAT + f', "top_k": {INT32_MAX + 1}}}', "top_k"),
    (CHAT + ', "top_k": -2}', "top_k"),
    (CHAT + f', "num_experts_per_token": {INT32_MAX + 1}}}', "num_experts_per_token"),
    (CHAT + f', "n": {2**40}}}', "n"),
    (CHAT + f', "logprobs": true, "top_logprobs": {2**63}}}', "top_logprobs"),
    (CHAT + ', "temperature": NaN}', "temperature"),
    (CHAT + ', "repetition_penalty": 0}', "repetition_penalty"),
    (CHAT + ', "repetition_penalty": 1e400}', "repetition_penalty"),
    (CHAT + ', "chat_template_kwargs": [1]}', "chat_template_kwargs"),
    (CHAT + ', "tool_choice": "required"}', "tool_choice"),
    (CHAT + ', "logit_bias": {"a5": 1}}', "logit_bias"),
    (CHAT + ', "logit_bias": {"-5": 1}}', "logit_bias"),
    (CHAT + ', "logit_bias": {"5": 100.5}}', "logit_bias"),
    (CHAT + ', "logit_bias": {"5": "1"}}', "logit_bias.5"),
    (CHAT + f', "logit_bias": {{"{2**31}": 1}}}}', "logit_bias"),
    (CHAT + ', "min_tokens": 3, "stop": "x"}', "min_tokens"),
    (CHAT + ', "min_tokens": -1}', "min_tokens"),
    (CHAT + ', "stop_token_ids": [-1]}', "stop_token_ids"),
    (CHAT + ', "skip_special_tokens": false}', "skip_special_tokens"),
    (CHAT + ', "include_stop_str_in_output": true}', "include_stop_str_in_output"),
    (CHAT + ', "add_special_tokens": true}', "add_special_tokens"),
    (CHAT + ', "guided_json": {"type": "object"}}', "guided_json"),
    (CHAT + ', "repeat_penalty": 1.3}', "repeat_penalty"),
    (CHAT + f', "stop": {json.dumps(["s"] * (MAX_STOPS + 1))}}}', "stop"),
    (CHAT + f', "stop": "{"s" * (MAX_STOP_CHARS + 1)}"}}', "stop"),
])
def test_out_of_range_and_wrong_types_are_400_naming_the_parameter(body, param):
    error = error_of(ChatCompletionRequest, body)
    assert error.status_code == 400
    assert error.error.type == "invalid_request_error"
    assert error.error.param == param
    assert error.error.message.startswith(param)


@pytest.mark.parametrize("body, words", [
    (CHAT + ', "top_logprobs": 2}', "requires logprobs"),
    (CHAT + ', "stream_options": {"include_usage": true}}', "only allowed when stream"),
    (CHAT + ', "tools": [{"type": "function"}]}', "tools"),
    (CHAT + ', "response_format": {"type": "json_schema"}}', "needs json_schema"),
    (CHAT + ', "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 1}}}}',
     "invalid JSON schema"),
])
def test_unsupported_combinations_are_400(body, words):
    error = error_of(ChatCompletionRequest, body)
    assert error.status_code == 400 and words in error.error.message


def test_malformed_json_is_400_invalid_json():
    error = error_of(ChatCompletionRequest, '{"messages": [')
    assert error.status_code == 400 and error.error.code == "invalid_json"
    assert error_of(ChatCompletionRequest, "[]").status_code == 400
    assert error_of(ChatCompletionRequest, "").status_code == 400


def test_unknown_fields_are_accepted_and_logged_once_per_name(caplog):
    with caplog.at_level(logging.WARNING, logger="splitmoe.gateway.openai_types"):
        req = chat('"frobnicate": 1, "store": true')
        chat('"frobnicate": 2')
    assert req.model_extra == {"frobnicate": 1, "store": True}
    assert caplog.text.count("frobnicate") == 1


def test_unknown_field_names_are_logged_cut_short_and_only_so_many(caplog):
    names = UnknownFieldLog()
    with caplog.at_level(logging.WARNING, logger="splitmoe.gateway.openai_types"):
        names.report("M", ["x" * 5000] + [f"field{i}" for i in range(5000)])
        names.report("M", ["late"])
    cut = UnknownFieldLog.MAX_NAME_CHARS
    assert "x" * cut + "..." in caplog.text and "x" * (cut + 1) not in caplog.text
    assert f"and {UnknownFieldLog.MAX_NAMES - 10} more" in caplog.text and "late" not in caplog.text
    assert len(caplog.text) < 1000


def test_error_response_shape():
    body = error_response(429, "queue full", code="resource_exhausted").model_dump()
    assert body == {"error": {"message": "queue full", "type": "rate_limit_error", "param": None,
                              "code": "resource_exhausted", "request_id": None}}  # app.py fills in the id


# ------------------------------------------------------------------------------------- completions

@pytest.mark.parametrize("prompt, expected", [
    ('"hello"', ["hello"]),
    ('["a", "b"]', ["a", "b"]),
    ("[1, 2, 3]", [[1, 2, 3]]),
    ("[[1, 2], [3]]", [[1, 2], [3]]),
])
def test_completion_prompt_forms(prompt, expected):
    assert completion(f'{{"prompt": {prompt}}}').prompts() == expected


def test_completion_requests_are_prompt_major_with_seeds_per_choice():
    req = completion('{"prompt": [[1, 2], [3]], "n": 2, "seed": 5, "max_tokens": 4, "logprobs": 2}')
    gens = req.to_generate_params("cmpl-1")
    assert [g.prompt for g in gens] == [(1, 2), (1, 2), (3,), (3,)]
    assert [g.sampling["seed"] for g in gens] == [5, 6, 5, 6]
    assert len({g.request_id for g in gens}) == 4
    sent = [g.sampling for g in gens]
    assert all(s["max_tokens"] == 4 and s["logprobs"] and s["top_logprobs"] == 2 for s in sent)
    scores = req.to_score_params("cmpl-1")
    assert [s.prompt for s in scores] == [(1, 2), (3,)] and scores[0].top_logprobs == 2


def test_completion_text_prompt_and_defaults():
    [gen] = completion('{"prompt": "once"}').to_generate_params("c")
    assert gen.prompt == "once" and gen.sampling["max_tokens"] == 16 and not gen.sampling["logprobs"]


@pytest.mark.parametrize("body, scores", [
    ('{"prompt": "x", "max_tokens": 0}', True),            # usage needs the prompt's length
    ('{"prompt": "x", "echo": true, "logprobs": 0}', True),
    ('{"prompt": [1, 2], "echo": true}', True),             # echoed ids need their text
    ('{"prompt": "x", "echo": true}', False),
    ('{"prompt": "x", "logprobs": 3}', False),
])
def test_which_completions_score_their_prompt(body, scores):
    assert completion(body).needs_prompt_scores is scores


@pytest.mark.parametrize("body, param", [
    ('{"prompt": []}', None),
    ('{"prompt": [[]]}', None),
    ('{"prompt": [1, -2]}', "prompt"),
    (f'{{"prompt": [1, {INT32_MAX + 1}]}}', "prompt"),
    (f'{{"prompt": [[1], [{2**70}]]}}', "prompt"),
    (f'{{"prompt": "x", "max_tokens": {INT32_MAX + 1}}}', "max_tokens"),
    (f'{{"prompt": "x", "best_of": {2**31}}}', "best_of"),
    ('{"prompt": [1, "a"]}', "prompt"),
    ('{"prompt": "x", "max_tokens": -1}', "max_tokens"),
    ('{"prompt": "x", "logprobs": 21}', "logprobs"),
    ('{"prompt": "x", "logprobs": true}', "logprobs"),
    ('{"prompt": "x", "best_of": 3}', None),
    ('{"prompt": "x", "suffix": "y"}', None),
    ('{"max_tokens": 3}', "prompt"),
])
def test_bad_completion_requests_are_400(body, param):
    error = error_of(CompletionRequest, body)
    assert error.status_code == 400
    if param:
        assert error.error.param == param
