"""The handlers' plumbing without a server: SSE framing, OpenAI's chunk and logprob shapes, stream merging."""
import asyncio
import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChunk

from splitmoe.gateway.admission import Admission, Refused
from splitmoe.gateway.attention_client import AttentionError
from splitmoe.gateway.attention_types import GenerateChunk, GenerateParams, TokenLogprob, TopLogprob, Usage
from splitmoe.gateway.handlers.chat import ChatHandler
from splitmoe.gateway.handlers.models import Served
from splitmoe.gateway.logprobs import chat_logprobs, completion_logprobs
from splitmoe.gateway.openai_types import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from splitmoe.gateway.sse import SSE_DONE, sse_line, sse_stream
from splitmoe.gateway.streams import ChoiceState, OpenStream, merge, open_streams, total_usage


def token(text, logprob=-1.0, top=()):
    return TokenLogprob(token=text, token_bytes=text.encode(), logprob=logprob,
                        top=tuple(TopLogprob(token=t, token_bytes=t.encode(), logprob=lp) for t, lp in top))


class FakeCall:
    """An async Generate stream that records whether it was closed (as a gRPC call is cancelled)."""

    def __init__(self, messages, fail_after=None, delay_s=0.0):
        self.messages, self.fail_after, self.delay_s = messages, fail_after, delay_s
        self.closed = False

    async def run(self):
        try:
            for i, m in enumerate(self.messages):
                if self.fail_after == i:
                    raise AttentionError(503, "expert services down", "unavailable")
                await asyncio.sleep(self.delay_s)
                yield m
        finally:
            self.closed = True


def responses(*texts, finish="length", tokens=()):
    """A Generate stream's chunks; the first carries `tokens`, the last the finish and usage."""
    out = [GenerateChunk(text=t) for t in texts]
    out[0] = GenerateChunk(text=texts[0], tokens=tuple(tokens))
    out[-1] = GenerateChunk(text=texts[-1], tokens=out[-1].tokens, finish_reason=finish, usage=Usage(4, len(texts)))
    return out


class FakeClient:
    def __init__(self, calls):
        self.calls = calls

    def generate(self, request):
        return self.calls.pop(0).run()


def collect_sse(stream) -> list[str]:
    async def run():
        return [line async for line in stream]
    return asyncio.run(run())


def test_sse_line_is_one_data_event():
    chunk = ChatCompletionChunk(id="chatcmpl-1", created=1, model="m", choices=[
        ChatCompletionStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])
    line = sse_line(chunk, exclude={"usage"})
    assert line.startswith("data: {") and line.endswith("}\n\n") and line.count("\n") == 2
    body = json.loads(line[len("data: "):])
    assert body["object"] == "chat.completion.chunk" and "usage" not in body
    assert body["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    OpenAIChunk.model_validate(body)


def test_delta_drops_unset_fields():
    assert DeltaMessage(content="x").model_dump() == {"content": "x"}
    assert DeltaMessage().model_dump() == {}


def test_stream_ends_with_done_and_an_error_becomes_a_chunk():
    async def failing():
        yield ChatCompletionChunk(id="c", created=1, model="m", choices=[], usage=UsageInfo.of(1, 2))
        raise AttentionError(503, "expert services down", "unavailable")

    lines = collect_sse(sse_stream(failing(), include_usage=True, request_id="chatcmpl-c"))
    assert lines[-1] == SSE_DONE
    assert json.loads(lines[0][6:])["usage"]["total_tokens"] == 3
    error = json.loads(lines[1][6:])["error"]
    assert error["message"] == "expert services down" and error["type"] == "service_unavailable_error"
    assert error["request_id"] == "chatcmpl-c"


def chat_stream_lines(body: str, *calls: FakeCall) -> list[str]:
    request = ChatCompletionRequest.model_validate_json(body)

    async def run():
        handler = ChatHandler(FakeClient(list(calls)), _Model(), _metrics(), Admission(128, 512))
        stream = await handler.create(request, "chatcmpl-abc")
        return [line async for line in stream]
    return asyncio.run(run())


class _Model:
    async def resolve(self, requested):
        return Served("demo")


def _metrics():
    from splitmoe.gateway.metrics import GatewayMetrics
    return GatewayMetrics()


def test_chat_stream_follows_openai_order():
    lines = chat_stream_lines('{"messages": [{"role": "user", "content": "hi"}], "stream": true,'
                              '"stream_options": {"include_usage": true}}',
                              FakeCall(responses("Hel", "", "lo")))
    assert all(line.startswith("data: ") and line.endswith("\n\n") for line in lines)
    assert lines[-1] == SSE_DONE
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    for c in chunks:
        OpenAIChunk.model_validate(c)
        assert c["id"] == "chatcmpl-abc" and c["object"] == "chat.completion.chunk" and c["model"] == "demo"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [c["choices"][0]["delta"].get("content") for c in chunks[1:-2]]
    assert contents == ["Hel", "lo"]  # an empty message (held-back text) sends nothing
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3,
                                                                   "total_tokens": 7}
    assert all(c["usage"] is None for c in chunks[:-1])


def test_chat_stream_without_include_usage_has_no_usage_field():
    lines = chat_stream_lines('{"messages": [{"role": "user", "content": "hi"}], "stream": true}',
                              FakeCall(responses("a")))
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all("usage" not in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_n2_gives_each_choice_its_role_and_finish():
    lines = chat_stream_lines('{"messages": [{"role": "user", "content": "hi"}], "stream": true, "n": 2,'
                              '"stream_options": {"include_usage": true}}',
                              FakeCall(responses("a", "b")), FakeCall(responses("c", finish="stop")))
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    by_index = {0: [], 1: []}
    for c in chunks[:-1]:
        by_index[c["choices"][0]["index"]].append(c["choices"][0])
    for i, finish in ((0, "length"), (1, "stop")):
        assert by_index[i][0]["delta"]["role"] == "assistant"
        assert by_index[i][-1]["finish_reason"] == finish
    assert chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def test_chat_stream_mid_stream_failure_sends_an_error_then_done():
    lines = chat_stream_lines('{"messages": [{"role": "user", "content": "hi"}], "stream": true}',
                              FakeCall(responses("a", "b", "c"), fail_after=2))
    assert lines[-1] == SSE_DONE
    assert json.loads(lines[-2][6:])["error"]["code"] == "unavailable"


def test_chat_full_response_validates_as_openai():
    request = ChatCompletionRequest.model_validate_json(
        '{"messages": [{"role": "user", "content": "hi"}], "n": 2, "logprobs": true, "top_logprobs": 1}')
    a = token("a", -0.5, [("a", -0.5)])
    calls = [FakeCall(responses("a", "b", tokens=[a])), FakeCall(responses("c", finish="stop", tokens=[a]))]

    async def run():
        handler = ChatHandler(FakeClient(calls), _Model(), _metrics(), Admission(128, 512))
        return await handler.create(request, "chatcmpl-1")
    body = json.loads(asyncio.run(run()).model_dump_json())
    parsed = ChatCompletion.model_validate(body)
    assert [c.message.content for c in parsed.choices] == ["ab", "c"]
    assert [c.finish_reason for c in parsed.choices] == ["length", "stop"]
    assert parsed.usage.prompt_tokens == 4 and parsed.usage.completion_tokens == 3  # prompt counted once
    assert parsed.choices[0].logprobs.content[0].top_logprobs[0].logprob == -0.5


def test_chat_logprobs_format():
    out = chat_logprobs([token("é", float("-inf"), [("é", -0.1), ("x", -2.0)])], top_n=1).model_dump()
    [entry] = out["content"]
    assert entry["token"] == "é" and entry["logprob"] == -9999.0 and entry["bytes"] == [0xC3, 0xA9]
    assert entry["top_logprobs"] == [{"token": "é", "logprob": pytest.approx(-0.1), "bytes": [0xC3, 0xA9]}]


def test_completion_logprobs_legacy_format():
    tokens = [token("He", 0.0), token("llo", -1.0, [("llo", -1.0), ("y", -2.0)]), token("!", -3.0, [("?", -0.5)])]
    out = completion_logprobs(tokens, top_n=1, text_offset=0, first_unscored=True)
    assert out.tokens == ["He", "llo", "!"]
    assert out.text_offset == [0, 2, 5]
    assert out.token_logprobs == [None, -1.0, -3.0]
    assert out.top_logprobs == [None, {"llo": -1.0}, {"?": -0.5, "!": -3.0}]  # the sampled token is added
    later = completion_logprobs(tokens[1:], top_n=0, text_offset=7)
    assert later.text_offset == [7, 10] and later.top_logprobs == [{"llo": -1.0}, {"!": -3.0}]
    # The openai package types the lists without None (the prompt's first entry), but parses without validating.
    Completion.model_validate({"id": "c", "object": "text_completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "text": "llo!", "finish_reason": "length", "logprobs": later.model_dump()}]})


def test_usage_counts_each_prompt_once_across_its_choices():
    states = [ChoiceState(prompt_tokens=p, completion_tokens=c) for p, c in ((5, 1), (5, 2), (7, 3), (7, 4))]
    assert total_usage(states, n=2) == UsageInfo.of(12, 10)


def test_merge_interleaves_and_closing_it_cancels_every_stream():
    calls = [FakeCall(responses("a", "b", "c"), delay_s=0.01), FakeCall(responses("x", "y", "z"), delay_s=0.01)]

    async def run():
        streams = [OpenStream(await anext(gen), gen) for gen in (c.run() for c in calls)]
        seen = []
        merged = merge(streams)
        async for i, message in merged:
            seen.append(i)
            if len(seen) == 4:
                break
        await merged.aclose()
        return seen
    seen = asyncio.run(run())
    assert sorted(set(seen)) == [0, 1]
    assert all(c.closed for c in calls)


def test_merge_raises_the_first_failure_and_closes_the_rest():
    calls = [FakeCall(responses("a", "b"), fail_after=1), FakeCall(responses("x", "y", "z"), delay_s=0.05)]

    async def run():
        streams = [OpenStream(await anext(gen), gen) for gen in (c.run() for c in calls)]
        with pytest.raises(AttentionError):
            async for _ in merge(streams):
                pass
    asyncio.run(run())
    assert all(c.closed for c in calls)


def test_open_streams_cancels_the_others_when_one_is_rejected():
    calls = [FakeCall(responses("a", "b"), delay_s=0.01), FakeCall(responses("x"), fail_after=0)]
    admission = Admission(128, 512)

    async def run():
        with pytest.raises(AttentionError, match="expert services down"):
            await open_streams(FakeClient(calls), admission, [GenerateParams("r-0", "x", {"max_tokens": 1})] * 2)
    asyncio.run(run())
    assert all(c.closed for c in calls) and admission.in_flight == 0


def test_each_call_holds_its_admission_slot_until_it_ends():
    admission = Admission(max_per_request=4, max_in_flight=3)
    calls = [FakeCall(responses("a", "b")), FakeCall(responses("x", "y", "z"))]
    params = [GenerateParams("r-0", "x", {"max_tokens": 1})] * 2

    async def run():
        streams = await open_streams(FakeClient(calls), admission, params)
        assert admission.in_flight == 2
        with pytest.raises(Refused) as full:  # two more would make four
            await open_streams(FakeClient([]), admission, params)
        assert full.value.error.status_code == 429 and admission.in_flight == 2
        async for _ in streams[0]:  # the first ends: its slot is free
            pass
        assert admission.in_flight == 1
        await streams[1].aclose()
        assert admission.in_flight == 0
    asyncio.run(run())
    with pytest.raises(Refused) as too_many:
        admission.check(5)
    assert too_many.value.error.status_code == 400 and too_many.value.error.error.param == "n"

