"""Prefix caching changes what is computed, never what comes out: the engine run with it and without.

Each test runs the same requests through two engines on the same model, prefix caching on and
off, and compares every request's tokens and logprobs. Token ids must be equal. Logprobs are
compared to 2e-5: float32 results are not bit-identical across batch shapes (MKL's sgemm takes
another kernel for fewer than 4 rows, so a token computed in a smaller chunk can differ in the
last bits), and a hit changes the shapes exactly as chunked prefill does; a wrong block or
position would be off by orders of magnitude more. Every test also checks that the cache was hit,
so none passes by never using it.
"""
import logging
import random
import threading

import pytest
import torch

from splitmoe.attention_service.engine.sampling import SamplingOptions
from splitmoe.attention_service.model.runner import RunnerOptions
from splitmoe.attention_service.service import load_serving_model
from splitmoe.attention_service.settings import AttentionSettings

LOGPROB_ATOL = 2e-5


def run_engine(model_path, requests, caching, concurrent, kv_cache_tokens=4096, max_batch_tokens=64,
               kv_block_tokens=16, dtype=torch.float32):
    """requests: (prompt ids, SamplingOptions). Returns each request's [(token id, logprob)], and
    the prefix cache's (queries, hits)."""
    runner = RunnerOptions(dtype=dtype, device=torch.device("cpu"), kv_cache_tokens=kv_cache_tokens,
                           kv_block_tokens=kv_block_tokens, prefix_caching=caching)
    model = load_serving_model(AttentionSettings(model_path=str(model_path), runner=runner,
                                                 max_batch_tokens=max_batch_tokens))
    outputs = [[] for _ in requests]
    errors, done = [], threading.Semaphore(0)

    def sink_for(i):
        def sink(out):
            outputs[i].extend((t.token_id, t.logprob) for t in out.tokens)
            errors.extend([out.error] if out.error else [])
            if out.finished:
                done.release()
        return sink

    model.engine.start()
    try:
        for i, (ids, options) in enumerate(requests):
            model.engine.submit(model.new_request(f"r{i}", list(ids), options, sink_for(i)))
            if not concurrent:
                assert done.acquire(timeout=120)
        for _ in range(len(requests) if concurrent else 0):
            assert done.acquire(timeout=120)
    finally:
        model.engine.stop()
    assert not errors
    stats = model.runner.blocks.prefix_stats
    return outputs, (stats.queries, stats.hits)


def assert_same_outputs(model_path, requests, concurrent, **engine):
    cached, (queries, hits) = run_engine(model_path, requests, True, concurrent, **engine)
    plain, (plain_queries, _) = run_engine(model_path, requests, False, concurrent, **engine)
    assert hits > 0 and plain_queries == 0
    for i, (a, b) in enumerate(zip(cached, plain)):
        assert [t for t, _ in a] == [t for t, _ in b], f"request {i}: other tokens with prefix caching"
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) <= LOGPROB_ATOL, f"request {i}: other logprobs"
    return queries, hits


def shared_prefix_prompts(vocab_size, prefix_tokens=100, num=6, seed=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(5, vocab_size) for _ in range(prefix_tokens)]
    prompts = [prefix + [rng.randrange(5, vocab_size) for _ in range(rng.randrange(1, 20))] for _ in range(num)]
    return prompts + [prefix[:48]]  # whole blocks only: its last block is computed all the same


def greedy(max_tokens=8):
    return SamplingOptions(max_tokens=max_tokens, temperature=0.0, logprobs=True, ignore_eos=True)


def seeded(seed, max_tokens=8):
    return SamplingOptions(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=seed, logprobs=True,
                           ignore_eos=True)


DEMO_VOCAB = 275


@pytest.mark.parametrize("concurrent", [False, True], ids=["one-after-another", "concurrent"])
def test_greedy_requests_sharing_a_prefix(demo_gguf, concurrent, caplog):
    requests = [(ids, greedy()) for ids in shared_prefix_prompts(DEMO_VOCAB)]
    with caplog.at_level(logging.INFO, logger="splitmoe.attention_service.engine.engine"):
        queries, hits = assert_same_outputs(demo_gguf, requests, concurrent)
    if not concurrent:  # each after the first finds the 96 tokens of the prefix's six full blocks
        assert hits == 5 * 96 + 32 and queries == sum(len(ids) for ids, _ in requests)
        assert f"prefix cache: hit rate {100 * hits / queries:.1f}% ({hits} of {queries} tokens" in caplog.text


def test_seeded_sampling_and_the_same_prompt_several_times(demo_gguf):
    """As `n` > 1 sends them: one prompt, several seeds, at once (and again after them)."""
    prompts = shared_prefix_prompts(DEMO_VOCAB, num=2, seed=1)
    requests = [(prompts[0], seeded(seed)) for seed in range(4)] + [(prompts[1], seeded(7))]
    assert_same_outputs(demo_gguf, requests, concurrent=True)
    assert_same_outputs(demo_gguf, requests, concurrent=False)


def test_eviction_and_preemption_in_a_small_cache(demo_gguf):
    """12 blocks for requests needing 8 each: running requests are preempted and named blocks evicted."""
    prompts = shared_prefix_prompts(DEMO_VOCAB, prefix_tokens=80, num=5, seed=2)
    requests = [(ids, greedy(max_tokens=24)) for ids in prompts]
    assert_same_outputs(demo_gguf, requests, concurrent=True, kv_cache_tokens=192)
    assert_same_outputs(demo_gguf, requests, concurrent=False, kv_cache_tokens=192)


def test_requests_with_other_experts_per_token_do_not_share_blocks(demo_gguf):
    ids = shared_prefix_prompts(DEMO_VOCAB, num=1)[0]
    one_expert = SamplingOptions(max_tokens=4, temperature=0.0, logprobs=True, num_experts_per_token=1)
    requests = [(ids, greedy(4)), (ids, one_expert), (ids, one_expert)]
    _, hits = assert_same_outputs(demo_gguf, requests, concurrent=False)
    assert hits == 96  # the third from the second; the second found nothing of the first's


@pytest.mark.parametrize("arch, quant", [("gptoss", "q8_0"), ("deepseek2", "q8_0"), ("qwen3moe", "q8_0")],
                         ids=["sliding-window", "mla", "qwen3moe"])
def test_fixture_models(fixtures_dir, arch, quant):
    """gpt-oss's sliding-window layers (prefixes past the window) and DeepSeek's MLA latent cache."""
    path = fixtures_dir / arch / f"{arch}-{quant}.gguf"
    vocab = int(load_vocab_size(path))
    requests = [(ids, greedy(6)) for ids in shared_prefix_prompts(vocab, prefix_tokens=70, num=3, seed=3)]
    assert_same_outputs(path, requests, concurrent=False, kv_block_tokens=8)
    assert_same_outputs(path, requests, concurrent=True, kv_block_tokens=8)


def load_vocab_size(path):
    from splitmoe.modelfile.architectures import arch_spec
    from splitmoe.modelfile.gguf_file import GGUFFile

    g = GGUFFile(path)
    return arch_spec(g.arch, g.path.name).architecture.config(g).vocab_size
