"""Speculative decoding (engine/speculation.py) changes how many tokens a step verifies, never the
tokens: at temperature 0 in float32 every request's output is the one decoding token by token
gives, whatever the drafts (the n-gram lookup's, or garbage), in this process and through expert
services over shared memory; blocks named for prefix caching hold only accepted tokens."""
import random
import threading

import pytest
import torch

from splitmoe.attention_service.engine.sampling import SamplingOptions
from splitmoe.attention_service.engine.speculation import (
    PROBE_EVERY_STEPS,
    DrafterCost,
    DraftLength,
    FunctionDrafter,
    SpeculationSettings,
    SpeculationStats,
    propose_ngram,
)
from splitmoe.attention_service.model.runner import RunnerOptions
from splitmoe.attention_service.service import load_serving_model
from splitmoe.attention_service.settings import AttentionSettings
from tests.support.expert_services import FAST_SETTINGS, ExpertServices

# Prompts that repeat themselves (so that the lookup finds drafts) and ones that do not.
PROMPTS = [[5, 17, 42, 9] * 4, [100, 3, 100, 3, 100, 3, 77], [8, 9, 10, 11, 12, 13], [250, 251, 250, 251, 250],
           [31, 7, 31, 7, 31, 8, 31, 7, 31]]
GREEDY = SamplingOptions(max_tokens=40, temperature=0.0, ignore_eos=True)


def test_the_ngram_lookup_takes_the_longest_latest_match():
    assert propose_ngram([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert propose_ngram([1, 2, 9, 1, 2, 7, 1, 2], 2) == [7, 1]  # the latest occurrence of [1, 2]
    assert propose_ngram([5, 6, 1, 2, 3, 7, 6, 2, 3], 2) == [7, 6]  # [2, 3] beats [3]'s later match
    assert propose_ngram([1, 2, 3], 2) == [] and propose_ngram([4], 2) == []
    # token boundaries: 256 and 1 share bytes (00 01 00 00 / 01 00 00 00); no match across two tokens
    assert propose_ngram([256, 1, 256], 2) == [1, 256]
    assert propose_ngram([256, 0, 1], 1) == []  # the bytes of 1 occur in those of 256 and 0, unaligned only
    assert propose_ngram([3, 4, 3, 4, 3], 4, ngram_max=1) == [4, 3]


def test_stats_count_drafts_and_acceptance_per_position():
    stats = SpeculationStats()
    stats.add(4, 2)
    stats.add(2, 2)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 4)
    assert stats.accepted_per_position == [2, 2, 0, 0]
    with pytest.raises(ValueError, match="--speculative"):
        SpeculationSettings(method="medusa")


def run(model_path, prompts, speculation, concurrent=True, experts=None, drafter=None, options=GREEDY,
        dtype=torch.float32, stats_of=None):
    """Each prompt's output tokens, and the engine's speculation stats."""
    runner = RunnerOptions(dtype=dtype, device=torch.device("cpu"), kv_cache_tokens=4096, kv_block_tokens=16)
    model = load_serving_model(AttentionSettings(model_path=str(model_path), runner=runner, experts=experts,
                                                 speculation=speculation))
    if drafter is not None:
        model.engine.drafter = FunctionDrafter(drafter)
    requests, errors, done = [], [], threading.Semaphore(0)

    def sink(out):
        errors.extend([out.error] if out.error else [])
        if out.finished:
            done.release()

    model.engine.start()
    try:
        for i, ids in enumerate(prompts):
            request = model.new_request(f"r{i}", list(ids), options, sink)
            requests.append(request)
            model.engine.submit(request)
            if not concurrent:
                assert done.acquire(timeout=120)
        for _ in range(len(prompts) if concurrent else 0):
            assert done.acquire(timeout=120)
    finally:
        model.engine.stop()
        model.experts.close()
    assert not errors, errors
    if stats_of is not None:
        stats_of(model)
    return [r.seq.token_ids[r.num_prompt_tokens:] for r in requests], model.engine.spec_stats


NGRAM = SpeculationSettings("ngram", num_tokens=4)


@pytest.mark.parametrize("concurrent", [True, False], ids=["batched", "one-by-one"])
def test_ngram_speculation_gives_exactly_the_tokens_of_plain_decoding(demo_gguf, concurrent):
    expected, none = run(demo_gguf, PROMPTS, SpeculationSettings(), concurrent)
    got, stats = run(demo_gguf, PROMPTS, NGRAM, concurrent)
    assert got == expected
    assert none.num_drafts == 0 and all(len(o) == GREEDY.max_tokens for o in got)
    # it did speculate, and some drafts held (the demo model repeats itself at temperature 0)
    assert stats.num_draft_tokens > 20 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens


def test_in_bfloat16_a_verification_row_computes_as_a_decode_step(demo_gguf):
    """The fast path: a stream's drafts are verified on the decode layer's native path, row by row
    as one-token steps compute, so even bfloat16's rounding gives the same tokens (one stream at a
    time: a batch of other size may round a near-tie otherwise, speculation or not)."""
    expected, _ = run(demo_gguf, PROMPTS, SpeculationSettings(), concurrent=False, dtype=torch.bfloat16)
    always = SpeculationSettings("ngram", num_tokens=6, fixed_length=True)  # every step drafts what it can
    got, stats = run(demo_gguf, PROMPTS, always, concurrent=False, dtype=torch.bfloat16)
    assert got == expected and stats.num_accepted_tokens > 0


def test_garbage_drafts_change_nothing_and_soon_stop_being_drafted(demo_gguf):
    expected, _ = run(demo_gguf, PROMPTS, SpeculationSettings())
    rng = random.Random(0)
    got, stats = run(demo_gguf, PROMPTS, NGRAM, drafter=lambda tokens, k: [rng.randrange(250) for _ in range(k)])
    assert got == expected
    # each request drafts until its acceptance says drafts do not pay, then only a probe every 16 steps
    assert len(PROMPTS) <= stats.num_drafts <= len(PROMPTS) * (3 + GREEDY.max_tokens // PROBE_EVERY_STEPS)
    assert stats.num_accepted_tokens <= stats.num_drafts // 4


def test_the_draft_length_follows_the_measured_acceptance():
    length = DraftLength()
    assert length.next(4, 0.4) == 1  # a = 0.5 before anything is measured
    for _ in range(10):
        length.update(4, 4)  # every draft held
    assert length.next(4, 0.4) == 4 and length.next(2, 0.4) == 2
    for _ in range(20):
        length.update(length.next(4, 0.4) or 1, 0)  # none held
    assert [length.next(4, 0.4) for _ in range(PROBE_EVERY_STEPS)].count(1) == 1  # a probe, else nothing


def test_the_drafters_own_cost_is_measured_in_one_token_steps():
    cost = DrafterCost()
    assert cost.steps_per_token == 0.0  # nothing measured: only the verification's cost counts
    cost.add_proposal(0.004, 4)  # 1 ms a drafted token
    cost.add_step(0.020, num_seqs=2, num_drafted=8, draft_token_cost=0.25)  # 2 streams of 4 drafts: 2 steps' work
    assert cost.step_s == pytest.approx(0.010) and cost.steps_per_token == pytest.approx(0.1)
    cost.add_step(0.030, num_seqs=1, num_drafted=0, draft_token_cost=0.25)
    assert cost.step_s == pytest.approx(0.012)  # decayed: recent steps weigh a tenth each


def test_a_continuation_reuses_blocks_named_from_speculative_steps(demo_gguf):
    first, _ = run(demo_gguf, PROMPTS[:1], NGRAM)
    continued = [PROMPTS[0] + first[0]]  # 16 + 40 tokens: three blocks of 16 named from the first run
    expected, _ = run(demo_gguf, continued, SpeculationSettings())
    # one engine: the first request names its blocks, the second takes them (a wrong one would show)
    runner = RunnerOptions(dtype=torch.float32, device=torch.device("cpu"), kv_cache_tokens=4096, kv_block_tokens=16)
    model = load_serving_model(AttentionSettings(model_path=str(demo_gguf), runner=runner, speculation=NGRAM))
    done = threading.Semaphore(0)
    model.engine.start()
    try:
        outputs = []
        for i, ids in enumerate([PROMPTS[0], continued[0]]):
            request = model.new_request(f"r{i}", list(ids), GREEDY, lambda out: out.finished and done.release())
            model.engine.submit(request)
            assert done.acquire(timeout=120)
            outputs.append(request.seq.token_ids[request.num_prompt_tokens:])
    finally:
        model.engine.stop()
    assert outputs == [first[0], expected[0]]
    assert model.runner.blocks.prefix_stats.hits >= 48


def test_a_draft_model_drafts_and_the_output_is_the_targets(demo_gguf, tmp_path):
    from splitmoe.demo_model import DemoShape, write_demo_model

    expected, _ = run(demo_gguf, PROMPTS, SpeculationSettings())
    # the target itself as its own draft: every drafted token is the one the target would choose
    held = []
    itself, stats = run(demo_gguf, PROMPTS, SpeculationSettings("draft", 4, draft_model=str(demo_gguf), fixed_length=True),
                        stats_of=lambda model: held.append(len(model.engine.drafter._seqs)))
    assert itself == expected and stats.num_accepted_tokens == stats.num_draft_tokens > 100
    assert held == [0]  # every finished request's draft sequence was let go
    # left to choose, the engine measures that a drafted token costs it about a step of its own:
    # drafts that always hold do not pay then, and it soon drafts little
    costs = []
    adaptive, few = run(demo_gguf, PROMPTS, SpeculationSettings("draft", 4, draft_model=str(demo_gguf)),
                        stats_of=lambda model: costs.append(model.engine.drafter_cost.steps_per_token))
    assert adaptive == expected and costs[0] > 0.3 and few.num_draft_tokens < stats.num_draft_tokens / 2
    # another model of the same vocabulary (other weights, one layer): drafts often wrong, output the same
    other = tmp_path / "draft.gguf"
    write_demo_model(other, DemoShape(num_layers=1, seed=7))
    got, stats = run(demo_gguf, PROMPTS, SpeculationSettings("draft", 4, draft_model=str(other)))
    assert got == expected and stats.num_drafts > 0 and stats.num_accepted_tokens < stats.num_draft_tokens


def test_a_draft_model_of_another_vocabulary_is_refused_in_one_line(demo_gguf):
    from splitmoe.demo import trained_model_path

    runner = RunnerOptions(dtype=torch.float32, device=torch.device("cpu"), kv_cache_tokens=1024)
    with pytest.raises(ValueError, match=r"--model-draft .*vocabulary of 1118 tokens, the model served has 275"):
        load_serving_model(AttentionSettings(model_path=str(demo_gguf), runner=runner, speculation=SpeculationSettings(
            "draft", draft_model=str(trained_model_path()))))
    with pytest.raises(ValueError, match="--model-draft"):
        SpeculationSettings("draft")


def sample_many(model_path, prompt, n, speculation=SpeculationSettings(), drafter=None):
    """n sampled 4-token continuations of `prompt` (seeds 0..n-1, temperature 0.3), all submitted at once."""
    runner = RunnerOptions(dtype=torch.float32, device=torch.device("cpu"), kv_cache_tokens=65536, kv_block_tokens=16)
    model = load_serving_model(AttentionSettings(model_path=str(model_path), runner=runner, speculation=speculation,
                                                 max_running_seqs=128, max_waiting_requests=n, max_batch_tokens=1024))
    if drafter is not None:
        model.engine.drafter = FunctionDrafter(drafter)
    done = threading.Semaphore(0)
    requests = [model.new_request(f"s{i}", list(prompt), SamplingOptions(max_tokens=4, temperature=0.3, seed=i, ignore_eos=True),
                                  lambda out: out.finished and done.release()) for i in range(n)]
    model.engine.start()
    try:
        for request in requests:
            model.engine.submit(request)
        for _ in requests:
            assert done.acquire(timeout=300)
    finally:
        model.engine.stop()
    return [r.seq.token_ids[r.num_prompt_tokens:] for r in requests], model.engine.spec_stats


def chi_square_p(a: list[int], b: list[int]) -> float:
    """Two samples of categories from one distribution? The p-value of the 2 x C contingency test
    (categories seen fewer than 10 times in all pooled into one)."""
    counts = {}
    for which, sample in enumerate((a, b)):
        for x in sample:
            counts.setdefault(x, [0, 0])[which] += 1
    table, pooled = [], [0, 0]
    for pair in counts.values():
        if sum(pair) >= 10:
            table.append(pair)
        else:
            pooled = [pooled[0] + pair[0], pooled[1] + pair[1]]
    if sum(pooled):
        table.append(pooled)
    t = torch.tensor(table, dtype=torch.float64)
    expected = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    statistic = float(((t - expected) ** 2 / expected).sum())
    dof = t.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.mark.stack  # a few thousand sampled tokens: seconds, not milliseconds
def test_rejection_sampling_keeps_the_distribution_and_the_test_sees_a_biased_verifier(demo_gguf, monkeypatch):
    from splitmoe.attention_service.engine.sampling import RequestSampler

    prompt, n = PROMPTS[1], 600
    plain, _ = sample_many(demo_gguf, prompt, n)
    # drafts for the 2nd and 3rd tokens: the most frequent ones there, so that both branches
    # (kept, and drawn from the rest) are taken often
    modes = [max(set(col), key=col.count) for col in ([o[1] for o in plain], [o[2] for o in plain])]
    draft_at_second = lambda tokens, k: modes[:k] if len(tokens) == len(prompt) + 1 else []  # noqa: E731
    always = SpeculationSettings("ngram", num_tokens=2, max_batch_seqs=10_000, fixed_length=True)
    speculated, stats = sample_many(demo_gguf, prompt, n, always, draft_at_second)
    assert stats.num_drafts == n and stats.num_draft_tokens == 2 * n
    assert 0.1 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.9, stats
    for position in (1, 2):
        assert chi_square_p([o[position] for o in plain], [o[position] for o in speculated]) > 1e-3, position

    # a verifier that keeps every draft: the test must see it
    monkeypatch.setattr(RequestSampler, "verify", lambda self, logits, drafted: self._took(logits, drafted))
    biased, _ = sample_many(demo_gguf, prompt, n, always, draft_at_second)
    assert chi_square_p([o[1] for o in plain], [o[1] for o in biased]) < 1e-6


def through_two_services(model_path, log_dir, speculation):
    """(plain outputs, speculated outputs, stats), the experts of `model_path` (8 of them) split
    between two expert services reached over shared memory."""
    from splitmoe.attention_service.expert_backends.remote import RemoteExpertsSettings

    services = ExpertServices(log_dir)
    services.start("low", model_path, "--experts", "0-3")
    services.start("high", model_path, "--experts", "4-7")
    try:
        services.wait()
        experts = RemoteExpertsSettings(addresses=(services.address("low"), services.address("high")),
                                        transport="shm", **FAST_SETTINGS)
        expected, _ = run(model_path, PROMPTS, SpeculationSettings(), experts=experts)
        got, stats = run(model_path, PROMPTS, speculation, experts=experts)
    finally:
        services.stop_all()
    return expected, got, stats


@pytest.mark.stack
def test_through_two_expert_services_over_shared_memory(demo_gguf, tmp_path):
    expected, got, stats = through_two_services(demo_gguf, tmp_path, NGRAM)
    assert got == expected and stats.num_accepted_tokens > 0


def test_each_verifying_step_span_counts_its_drafted_and_accepted_tokens(demo_gguf, monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from splitmoe.attention_service.engine import engine as engine_module

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(engine_module, "_tracer", provider.get_tracer("test"))
    _, stats = run(demo_gguf, PROMPTS[:2], NGRAM)
    steps = [s.attributes for s in exporter.get_finished_spans() if s.name == "attention.decode_step"]
    verifying = [a for a in steps if "splitmoe.num_draft_tokens" in a]
    assert verifying and len(verifying) < len(steps)  # not every step drafts
    assert sum(a["splitmoe.num_draft_tokens"] for a in verifying) == stats.num_draft_tokens
    assert sum(a["splitmoe.num_accepted_tokens"] for a in verifying) == stats.num_accepted_tokens > 0


FAMILIES = ["qwen3moe", "qwen2moe", "mixtral", "olmoe", "deepseek", "deepseek2", "deepseek3", "gptoss", "glm4moe",
            "dbrx", "llama4"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_decodes_the_same_tokens_whatever_the_drafter(fixtures_dir, family):
    """Float32, greedy, the llama.cpp-made fixture of each family: the n-gram lookup's drafts,
    random ones (always K of them), and the file itself as its own draft model give the tokens of
    plain decoding; the self-draft's are all accepted."""
    path = fixtures_dir / family / f"{family}-q8_0.gguf"
    prompts = [[5, 17, 42, 9] * 4, [100, 3, 100, 3, 100, 3, 77], [31, 7, 31, 7, 31, 8, 31, 7, 31]]
    expected, _ = run(path, prompts, SpeculationSettings())
    got, _ = run(path, prompts, NGRAM)
    assert got == expected
    rng = random.Random(1)
    got, stats = run(path, prompts, SpeculationSettings("ngram", 4, fixed_length=True),
                     drafter=lambda tokens, k: [rng.randrange(2000) for _ in range(k)])
    assert got == expected and stats.num_draft_tokens > 100
    got, stats = run(path, prompts, SpeculationSettings("draft", 3, draft_model=str(path), fixed_length=True))
    assert got == expected and stats.num_accepted_tokens == stats.num_draft_tokens > 50
