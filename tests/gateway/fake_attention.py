"""A fake AttentionService on a real gRPC port: scripted by the prompt, so every status and shape is reachable.

Prompt words steer it: TOO_LONG -> INVALID_ARGUMENT, BUSY -> RESOURCE_EXHAUSTED, DOWN -> UNAVAILABLE,
CRASH -> INTERNAL, MIDFAIL -> UNAVAILABLE after two messages, SLOW -> 20 ms per token (for disconnects).
Otherwise it answers " t0 t1 ..." one token per message, honouring max_tokens (0: 8) and stop strings.
"""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc

from proto import attention_pb2 as pb
from proto import attention_pb2_grpc

CONTEXT_TOKENS = 64
ABORTS = {"TOO_LONG": (grpc.StatusCode.INVALID_ARGUMENT, "This model's maximum context length is 64 tokens."),
          "BUSY": (grpc.StatusCode.RESOURCE_EXHAUSTED, "the request queue is full"),
          "DOWN": (grpc.StatusCode.UNAVAILABLE, "no expert service answered"),
          "CRASH": (grpc.StatusCode.INTERNAL, "Traceback: secret internals")}


def prompt_words(request) -> list[str]:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return request.text.split()
    if kind == "token_ids":
        return [f"<{i}>" for i in request.token_ids.ids]
    return [w for m in request.chat.messages for w in m.content.split()]


class FakeAttention(attention_pb2_grpc.AttentionServiceServicer):
    def __init__(self) -> None:
        self.ready = True
        self.unhealthy: list[str] = []
        self.requests: list = []
        self.cancelled = threading.Event()
        self.traceparents: list[str | None] = []  # the W3C trace context each call carried

    def _check(self, request, context) -> list[str]:
        self.requests.append(request)
        self.traceparents.append(dict(context.invocation_metadata()).get("traceparent"))
        if not self.ready:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        words = prompt_words(request)
        for word, (code, detail) in ABORTS.items():
            if word in words:
                context.abort(code, detail)
        return words

    def Generate(self, request, context):
        words = self._check(request, context)
        s = request.sampling
        n_tokens = s.max_tokens or 8
        emitted = ""
        for i in range(n_tokens):
            if "SLOW" in words:
                time.sleep(0.02)
            if not context.is_active():  # the client cancelled the call
                self.cancelled.set()
                return
            if "MIDFAIL" in words and i == 2:
                context.abort(grpc.StatusCode.UNAVAILABLE, "expert service 127.0.0.1:7001 died")
            piece = f" t{i}"
            candidate = emitted + piece
            cut = min((candidate.find(st) for st in s.stop if st in candidate), default=-1)
            response = pb.GenerateResponse(text=candidate[len(emitted):cut] if cut >= 0 else piece)
            if s.logprobs:
                top = [pb.TopLogprob(token_id=i, token=piece, token_bytes=piece.encode(), logprob=-0.5 - i)][: s.top_logprobs]
                response.tokens.append(pb.TokenOut(token_id=i, token=piece, token_bytes=piece.encode(), logprob=-0.5 - i, top=top))
            done = cut >= 0 or i == n_tokens - 1
            if done:
                response.finish_reason = "stop" if cut >= 0 else "length"
                response.usage.prompt_tokens, response.usage.completion_tokens = len(words), i + 1
            yield response
            if done:
                return
            emitted = candidate

    def Score(self, request, context):
        words = self._check(request, context)
        pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
        tokens = [pb.TokenOut(token_id=i, token=pieces[i], token_bytes=pieces[i].encode(), logprob=0.0 if i == 0 else -1.0 * i,
                              top=[pb.TopLogprob(token="x", token_bytes=b"x", logprob=-0.25)][: request.top_logprobs])
                  for i, w in enumerate(words)]
        return pb.ScoreResponse(tokens=tokens, usage=pb.Usage(prompt_tokens=len(words)),
                                text="".join(t.token for t in tokens))

    def ModelInfo(self, request, context):
        if not self.ready:
            return pb.ModelInfoResponse(ready=False)
        return pb.ModelInfoResponse(model_id="fake-moe", arch="qwen3moe", context_tokens=CONTEXT_TOKENS,
                                    vocab_size=100, ready=True)

    def GetStats(self, request, context):
        if not self.ready:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        hops = [pb.HopStats(expert_address=a, num_hops=10, hop_s_total=0.01, bytes_total=1000,
                            healthy=a not in self.unhealthy) for a in ("127.0.0.1:7001", "127.0.0.1:7002")]
        return pb.AttentionStats(num_running=1, num_waiting=0, kv_cache_usage=0.5, max_batch_seqs_seen=4, hops=hops,
                                 expert_tokens=[pb.ExpertTokenCount(layer=0, expert=3, tokens=17)])


def start(port: int = 0) -> tuple[grpc.Server, FakeAttention, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    fake = FakeAttention()
    attention_pb2_grpc.add_AttentionServiceServicer_to_server(fake, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, fake, port
