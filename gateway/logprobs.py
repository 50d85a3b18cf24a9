"""The attention service's token logprobs in OpenAI's two shapes: chat's and the legacy completions'."""
from __future__ import annotations

from collections.abc import Sequence

from splitmoe.gateway.attention_types import TokenLogprob, TopLogprob
from splitmoe.gateway.openai_types import (
    ChatChoiceLogprobs,
    ChatCompletionLogProb,
    ChatCompletionLogProbsContent,
    CompletionLogprobs,
)

MIN_LOGPROB = -9999.0  # -inf is not JSON; vLLM clamps to the same value


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def token_str(t: TokenLogprob | TopLogprob) -> str:
    """The token as OpenAI spells it: its text, or `bytes:\\xNN` when it holds part of a character."""
    try:
        return t.token_bytes.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in t.token_bytes)


def chat_logprobs(tokens: Sequence[TokenLogprob], top_n: int) -> ChatChoiceLogprobs:
    def top(t: TokenLogprob) -> list[ChatCompletionLogProb]:
        return [ChatCompletionLogProb(token=token_str(c), logprob=_logprob(c.logprob), bytes=list(c.token_bytes))
                for c in t.top[:top_n]]
    return ChatChoiceLogprobs(content=[
        ChatCompletionLogProbsContent(token=token_str(t), logprob=_logprob(t.logprob), bytes=list(t.token_bytes),
                                      top_logprobs=top(t))
        for t in tokens])


def completion_logprobs(tokens: Sequence[TokenLogprob], top_n: int, text_offset: int,
                        first_unscored: bool = False) -> CompletionLogprobs:
    """The legacy format. `first_unscored`: tokens[0] opens a prompt, so nothing predicts it."""
    out = CompletionLogprobs()
    for i, t in enumerate(tokens):
        out.tokens.append(token_str(t))
        out.text_offset.append(text_offset)
        text_offset += len(t.token)
        if i == 0 and first_unscored:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_logprob(t.logprob))
        top = {token_str(c): _logprob(c.logprob) for c in t.top[:top_n]}
        top.setdefault(token_str(t), _logprob(t.logprob))  # the sampled token, as vLLM includes it
        out.top_logprobs.append(top)
    return out


def join_logprobs(a: CompletionLogprobs | None, b: CompletionLogprobs) -> CompletionLogprobs:
    if a is None:
        return b
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              tokens=a.tokens + b.tokens, top_logprobs=a.top_logprobs + b.top_logprobs)


def text_length(tokens: Sequence[TokenLogprob]) -> int:
    return sum(len(t.token) for t in tokens)
