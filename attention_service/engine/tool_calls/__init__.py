"""Tool calls in the model's reply, parsed into OpenAI's `tool_calls` as the reply streams.

One module per family's syntax (hermes.py: Qwen; deepseek.py: DeepSeek V3/R1/V3.1; kimi_k2.py;
mistral.py; harmony.py: gpt-oss; glm45.py: GLM-4.5/4.6), chosen once per model from its vocabulary and chat template
(`detect_tool_format`; `--tool-call-parser` overrides it), as vLLM's `--tool-call-parser` picks
one, but automatically; forced.py reads replies that `tool_choice` forced into a JSON shape.
`ToolCallText` runs a parser over the content a request releases (after reasoning is split off and
stop strings applied).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Mapping

from splitmoe.attention_service.engine.reasoning import HARMONY, OutputText, ReasoningFormat, TextDelta
from splitmoe.attention_service.engine.tool_calls import deepseek, glm45, harmony, hermes, kimi_k2, mistral
from splitmoe.attention_service.engine.tool_calls.base import ToolCallParser
from splitmoe.attention_service.engine.tool_calls.forced import NamedCall, RequiredCalls
from splitmoe.modelfile.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# name -> (parser, the format's markers: written out by the decoder even when they are control tokens)
FORMATS: dict[str, tuple[Callable[[], ToolCallParser], tuple[str, ...]]] = {
    "hermes": (hermes.HermesParser, hermes.MARKERS),
    "deepseek": (deepseek.DeepSeekParser, deepseek.MARKERS),
    "kimi_k2": (kimi_k2.KimiK2Parser, kimi_k2.MARKERS),
    "mistral": (mistral.MistralParser, mistral.MARKERS),
    "harmony": (harmony.HarmonyToolParser, harmony.MARKERS),
    "glm45": (glm45.Glm45Parser, glm45.MARKERS),
}
FALLBACK = "hermes"  # what ChatML-style models (and llama.cpp's generic fallback) mostly write
# A format is recognised by a marker that is one token of the vocabulary (the first match wins).
_SIGNATURES = (
    ("kimi_k2", kimi_k2.SECTION_BEGIN),
    ("deepseek", deepseek.CALLS_BEGIN),
    ("mistral", mistral.TOOL_CALLS),
    ("glm45", glm45.KEY_OPEN),  # before hermes: GLM's calls open with <tool_call> too
    ("hermes", hermes.OPEN),
)
AUTO, NAMED, REQUIRED = "auto", "named", "required"


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """What a request asks of its reply's calls."""
    mode: str                # AUTO: in the model's syntax | NAMED: all of it is `function`'s arguments | REQUIRED
    function: str = ""       # NAMED
    single: bool = False     # parallel_tool_calls false: the first call only
    # (function, its string-typed parameters) of the request's tools: formats that write strings
    # bare (glm45) read those as strings, whatever they look like
    string_parameters: tuple[tuple[str, frozenset[str]], ...] = ()


def string_parameters(tools: list) -> tuple[tuple[str, frozenset[str]], ...]:
    """`ToolCalling.string_parameters` of OpenAI `tools` (malformed entries contribute nothing)."""
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        parameters = function.get("parameters") if isinstance(function, dict) else None
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if isinstance(properties, dict) and isinstance(function.get("name"), str):
            names = {k for k, v in properties.items() if isinstance(v, dict) and v.get("type") == "string"}
            out.append((function["name"], frozenset(names)))
    return tuple(out)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    markers: Mapping[str, int]  # marker text -> token id, for those that are single tokens

    def parser(self, calling: ToolCalling) -> ToolCallParser:
        if calling.mode == NAMED:
            return NamedCall(calling.function)
        if calling.mode == REQUIRED:
            return RequiredCalls()
        if self.name == "glm45":  # its values carry no quotes: the schemas tell strings apart
            return glm45.Glm45Parser(dict(calling.string_parameters))
        return FORMATS[self.name][0]()


def detect_tool_format(tokenizer: Tokenizer, template_source: str, reasoning: ReasoningFormat | None,
                       override: str = "auto") -> ToolFormat | None:
    """The model's call syntax: `override` when it names one ("none": no parsing), else harmony for
    gpt-oss, else the family whose marker is a token, else glm45 or hermes when the template speaks
    of <arg_key> or <tool_call>, else hermes as a fallback."""
    if override == "none":
        return None
    name = override if override != "auto" else _detect(tokenizer, template_source, reasoning)
    return ToolFormat(name, _single_tokens(tokenizer, FORMATS[name][1]))


def _detect(tokenizer: Tokenizer, template_source: str, reasoning: ReasoningFormat | None) -> str:
    if reasoning is not None and reasoning.name == HARMONY:
        return "harmony"
    tokens = _single_tokens(tokenizer, tuple(marker for _, marker in _SIGNATURES))
    for name, marker in _SIGNATURES:
        if marker in tokens:
            return name
    if glm45.KEY_OPEN in template_source:
        return "glm45"
    if hermes.OPEN in template_source:
        return "hermes"
    log.info("no tool-call syntax recognised in the vocabulary or chat template; reading calls as %s", FALLBACK)
    return FALLBACK


def _single_tokens(tokenizer: Tokenizer, texts: tuple[str, ...]) -> dict[str, int]:
    """Marker text -> id, for the markers that are tokens: looked up in the vocabulary, not encoded
    (a SentencePiece encoder may put its dummy-prefix piece before a token)."""
    wanted, found = set(texts), {}
    for i in range(tokenizer.vocab_size):
        if (text := tokenizer.token_text(i)) in wanted:
            found.setdefault(text, i)
    return found


class ToolCallText:
    """A request's output text with its tool calls parsed out of the content."""

    def __init__(self, inner: OutputText, parser: ToolCallParser, single: bool = False) -> None:
        self._inner = inner
        self._parser = parser
        self._max_calls = 1 if single else None
        self.has_tool_calls = False

    @property
    def stopped(self) -> bool:
        return self._inner.stopped

    def add(self, token_id: int) -> TextDelta:
        return self._split(self._inner.add(token_id), final=False)

    def flush(self) -> TextDelta:
        return self._split(self._inner.flush(), final=True)

    def _split(self, delta: TextDelta, final: bool) -> TextDelta:
        parsed = self._parser.feed(delta.content)
        if final:
            parsed += self._parser.finish()
        # parallel_tool_calls false: later calls are dropped, as vLLM drops them
        calls = tuple(c for c in parsed.calls if self._max_calls is None or c.index < self._max_calls)
        self.has_tool_calls = self.has_tool_calls or bool(calls)
        return TextDelta(delta.reasoning, parsed.content, calls)
