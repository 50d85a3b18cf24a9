"""The attention service as a real process: generation, batching, scoring, cancellation, limits."""
import threading
import time

import grpc
import numpy as np
import pytest

from splitmoe.attention_service.model.generate import greedy_tokens
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.proto import attention_pb2 as pb
from splitmoe.proto import attention_pb2_grpc
from tests.support.processes import (
    assert_refused_but_probes_pass,
    cluster_channel,
    free_port,
    grpc_service,
    stranger_channel,
)

pytestmark = pytest.mark.stack  # `splitmoe serve-attention` as a real process

PROMPTS = [[5 + i, 40 + 3 * i, 100 + i, 7, 200 - i, 33 + i][: 3 + i % 4] for i in range(8)]


@pytest.fixture(scope="module")
def service_address(demo_gguf, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("logs") / "attention.log"
    args = ["serve-attention", str(demo_gguf), "--port", str(port), "--max-waiting", "32", "--max-batch-tokens", "64",
            "--dtype", "float32"]  # compared with the float32 runner token for token
    with grpc_service(args, port, log):
        yield f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def service(service_address):
    with cluster_channel(service_address) as channel:
        yield attention_pb2_grpc.AttentionServiceStub(channel)


@pytest.fixture(scope="module")
def runner(demo_gguf):
    return ModelRunner.from_gguf(demo_gguf, RunnerOptions(kv_cache_tokens=512))


def generate(stub, ids, max_tokens=12, **sampling):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, logprobs=True, **sampling))
    responses = list(stub.Generate(request, timeout=60))
    assert responses[-1].finish_reason == "length"
    assert responses[-1].usage.completion_tokens == max_tokens
    return [t.token_id for r in responses for t in r.tokens]


@pytest.mark.parametrize("secret", [None, "a-wrong-cluster-secret-0123456789"], ids=["no-secret", "wrong-secret"])
def test_every_rpc_without_the_cluster_secret_is_unauthenticated(service_address, secret):
    with stranger_channel(service_address, secret) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        assert_refused_but_probes_pass(channel, {
            "Generate": lambda: next(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6])), timeout=10)),
            "Score": lambda: stub.Score(pb.ScoreRequest(token_ids=pb.TokenIds(ids=[5, 6])), timeout=10),
            "ModelInfo": lambda: stub.ModelInfo(pb.ModelInfoRequest(), timeout=10),
            "GetStats": lambda: stub.GetStats(pb.AttentionStatsRequest(), timeout=10),
        })


def test_greedy_generation_equals_the_single_process_reference(service, runner):
    for ids in PROMPTS[:3]:
        alone = list(greedy_tokens(runner, ids, 12))
        assert generate(service, ids) == alone


def test_concurrent_streams_are_batched_and_each_gets_its_own_tokens(service, runner):
    expected = [list(greedy_tokens(runner, ids, 12)) for ids in PROMPTS]
    results = [None] * len(PROMPTS)

    def client(i):
        results[i] = generate(service, PROMPTS[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected
    assert service.GetStats(pb.AttentionStatsRequest()).max_batch_seqs_seen > 1


def test_seeded_sampling_is_reproducible(service):
    a = generate(service, PROMPTS[0], temperature=1.0, seed=3)
    assert a == generate(service, PROMPTS[0], temperature=1.0, seed=3)


def test_score_returns_log_softmax_of_the_logits(service, runner):
    ids = PROMPTS[5]
    response = service.Score(pb.ScoreRequest(token_ids=pb.TokenIds(ids=ids), top_logprobs=3))
    logits = runner.step([Sequence(99, ids)], all_logits=True).double()
    logprobs = torch_log_softmax(logits.numpy())
    got = [t.logprob for t in response.tokens[1:]]
    want = [logprobs[i, ids[i + 1]] for i in range(len(ids) - 1)]
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert [t.token_id for t in response.tokens] == ids
    assert len(response.tokens[1].top) == 3


def torch_log_softmax(x):
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def test_cancelled_stream_stops_its_generation(service):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPTS[1]),
                                 sampling=pb.SamplingParams(max_tokens=1500, ignore_eos=True))
    call = service.Generate(request, timeout=60)
    next(call)
    call.cancel()
    deadline = time.monotonic() + 10
    while service.GetStats(pb.AttentionStatsRequest()).num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.GetStats(pb.AttentionStatsRequest()).num_running == 0


@pytest.mark.parametrize("request_", [
    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 3000)),        # over the context
    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[100000])),          # not in the vocabulary
    pb.GenerateRequest(),                                             # no prompt
    pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=5.0)),
    pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(repetition_penalty=-1.0)),
    pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")],
                                          template_kwargs='{"messages": []}')),
    pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")],
                                          template_kwargs="[1, 2]")),
    pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")],
                                          template_kwargs="[" * 100_000)),
], ids=["over-context", "unknown-token", "no-prompt", "bad-temperature", "bad-repetition-penalty",
        "template-kwargs-set-messages", "template-kwargs-not-an-object", "template-kwargs-too-deep"])
def test_bad_requests_are_invalid_argument_and_the_service_goes_on(service, request_):
    with pytest.raises(grpc.RpcError) as e:
        list(service.Generate(request_, timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert generate(service, PROMPTS[0], max_tokens=2)


def test_chat_prompt_and_stop_string(service):
    request = pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")],
                                                    add_generation_prompt=True),
                                 sampling=pb.SamplingParams(max_tokens=20, temperature=0))
    text = "".join(r.text for r in service.Generate(request, timeout=30))
    assert text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    request.sampling.stop.append(stop)
    responses = list(service.Generate(request, timeout=30))
    cut = "".join(r.text for r in responses)
    assert cut == text[: text.index(stop)] and responses[-1].finish_reason == "stop"


def test_a_request_may_ask_for_fewer_experts_per_token(service, demo_gguf):
    top1 = ModelRunner.from_gguf(demo_gguf, RunnerOptions(kv_cache_tokens=512, experts_per_token=1))
    ids = PROMPTS[2]
    assert generate(service, ids, num_experts_per_token=1) == list(greedy_tokens(top1, ids, 12))
    with pytest.raises(grpc.RpcError) as e:
        generate(service, ids, num_experts_per_token=99)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "experts per token" in e.value.details()


def test_prompt_and_max_tokens_over_the_context_are_refused_as_vllm_words_it(service):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 2000), sampling=pb.SamplingParams(max_tokens=100))
    with pytest.raises(grpc.RpcError) as e:
        list(service.Generate(request, timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == ("This model's maximum context length is 2048 tokens. However, you requested 2100 "
                                 "tokens (2000 in the messages, 100 in the completion). Please reduce the length "
                                 "of the messages or completion.")
    request.sampling.max_tokens = 48  # exactly the context: allowed
    assert list(service.Generate(request, timeout=60))[-1].usage.completion_tokens <= 48


def test_a_huge_prompt_is_refused_by_its_size_at_once_and_stalls_no_other_stream(service):
    """8 MB of text is refused before tokenizing (seconds of work), and the stream beside it goes on."""
    arrivals = []
    stream = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPTS[0]),
                                sampling=pb.SamplingParams(max_tokens=600, ignore_eos=True))

    def consume():
        for _ in service.Generate(stream, timeout=60):
            arrivals.append(time.monotonic())

    streamer = threading.Thread(target=consume)
    streamer.start()
    while len(arrivals) < 5:
        time.sleep(0.01)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(service.Generate(pb.GenerateRequest(text="hello world " * 700_000), timeout=30))
    refused = time.monotonic()
    streamer.join()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in e.value.details()
    assert refused - started < 2.0
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if started <= b <= refused + 0.5]
    assert during and max(during) < 1.0, during
