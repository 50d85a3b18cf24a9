import pytest
import torch

from splitmoe.attention_service.engine.sampling import RequestSampler, SamplingOptions


def logits():
    return torch.tensor([0.0, 3.0, 2.9, 1.0, -1.0])


def draws(options, n=200):
    sampler = RequestSampler(options, 5)
    return [sampler(logits()).token_id for _ in range(n)]


def test_greedy_and_logprobs_of_the_raw_distribution():
    s = RequestSampler(SamplingOptions(temperature=0.0, top_logprobs=2), 5)(logits())
    expected = torch.log_softmax(logits(), -1)
    assert s.token_id == 1
    assert s.logprob == pytest.approx(float(expected[1]))
    assert [t for t, _ in s.top] == [1, 2]


def test_same_seed_same_tokens_and_other_seed_differs():
    a = draws(SamplingOptions(temperature=1.0, seed=7))
    assert a == draws(SamplingOptions(temperature=1.0, seed=7))
    assert a != draws(SamplingOptions(temperature=1.0, seed=8))


def test_top_k_top_p_min_p_restrict_the_support():
    assert set(draws(SamplingOptions(temperature=1.5, top_k=2, seed=1))) == {1, 2}
    assert set(draws(SamplingOptions(temperature=1.0, top_p=0.5, seed=1))) == {1, 2}  # 1 alone has < 0.5
    assert set(draws(SamplingOptions(temperature=1.0, min_p=0.5, seed=1))) == {1, 2}


def test_frequency_penalty_moves_away_from_repeats():
    sampler = RequestSampler(SamplingOptions(temperature=0.0, frequency_penalty=1.5, presence_penalty=1.0), 5)
    assert [sampler(logits()).token_id for _ in range(3)] == [1, 2, 3]


@pytest.mark.parametrize("bad", [dict(max_tokens=-1), dict(temperature=2.5), dict(top_p=0.0),
                                 dict(top_logprobs=21), dict(presence_penalty=3.0), dict(top_k=-2),
                                 dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0),
                                 dict(repetition_penalty=float("inf")), dict(repetition_penalty=float("nan"))])
def test_out_of_range_options_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingOptions(**bad)


def test_any_positive_repetition_penalty_is_taken_as_vllm_and_llama_cpp_take_it():
    for penalty in (0.05, 2.5, 10.0):
        assert SamplingOptions(repetition_penalty=penalty).repetition_penalty == penalty


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    options = SamplingOptions(temperature=0.0, repetition_penalty=1.2)
    sampler = RequestSampler(options, 5, prompt_ids=[1])
    # 3 / 1.2 = 2.5 < 2.9: the prompt's token loses to 2; then 2.9 / 1.2 < 2.5, so 1 is back on top.
    assert [sampler(logits()).token_id for _ in range(3)] == [2, 1, 1]
    negative = torch.tensor([-1.0, -1.1])
    assert RequestSampler(options, 2, prompt_ids=[0])(negative).token_id == 1  # -1.2 < -1.1
    assert RequestSampler(SamplingOptions(temperature=0.0), 2, prompt_ids=[0])(negative).token_id == 0


def test_no_logprob_work_unless_asked():
    s = RequestSampler(SamplingOptions(temperature=0.0), 5)(logits())
    assert (s.token_id, s.logprob, s.top) == (1, None, ())
    asked = RequestSampler(SamplingOptions(temperature=0.0, logprobs=True), 5)(logits())
    assert asked.logprob == pytest.approx(float(torch.log_softmax(logits(), -1)[1]))


def test_logit_bias_is_added_before_sampling_and_leaves_the_logprobs_the_models():
    forced = RequestSampler(SamplingOptions(temperature=0.0, logprobs=True, logit_bias=((4, 100.0),)), 5)(logits())
    assert forced.token_id == 4  # -1 + 100 beats 3
    assert forced.logprob == pytest.approx(float(torch.log_softmax(logits(), -1)[4]))
    banned = RequestSampler(SamplingOptions(temperature=0.0, logit_bias=((1, -100.0), (3, 1.5))), 5)(logits())
    assert banned.token_id == 2  # 1 is banned; 3 + 1.5 = 2.5 stays under 2.9
    assert set(draws(SamplingOptions(temperature=1.0, seed=3, logit_bias=((1, -100.0), (2, -100.0))))) <= {0, 3, 4}


def test_logit_bias_is_added_after_the_repetition_penalty():
    """Penalty then bias: -1 * 2 + 2 = 0 < 0.25; the other order would give (-1 + 2) / 2 = 0.5 and pick token 1."""
    options = SamplingOptions(temperature=0.0, repetition_penalty=2.0, logit_bias=((1, 2.0),))
    assert RequestSampler(options, 2, prompt_ids=[1])(torch.tensor([0.25, -1.0])).token_id == 0


@pytest.mark.parametrize("bias", [((5, 1.0),), ((-1, 1.0),)])
def test_logit_bias_outside_the_vocabulary_is_refused_naming_it(bias):
    with pytest.raises(ValueError, match=r"logit_bias: token ids must lie in \[0, 5\)"):
        RequestSampler(SamplingOptions(logit_bias=bias), 5)


@pytest.mark.parametrize("value", [100.5, -101.0])
def test_logit_bias_values_are_bounded_as_openai_bounds_them(value):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingOptions(logit_bias=((1, value),))


def test_min_tokens_masks_the_models_stop_tokens_and_stop_token_ids_until_enough_are_out():
    """Token 1 (the favourite) is EOS, 2 a stop_token_id: the first two draws must take neither."""
    sampler = RequestSampler(SamplingOptions(temperature=0.0, min_tokens=2, stop_token_ids=(2,)), 5,
                             eos_ids=frozenset({1}))
    assert [sampler(logits()).token_id for _ in range(3)] == [3, 3, 1]


def test_min_tokens_beyond_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingOptions(max_tokens=3, min_tokens=4)
