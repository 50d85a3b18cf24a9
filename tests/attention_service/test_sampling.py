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
                                 dict(repetition_penalty=0.0), dict(repetition_penalty=2.5)])
def test_out_of_range_options_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingOptions(**bad)


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
