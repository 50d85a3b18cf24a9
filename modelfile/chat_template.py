"""Chat templates: the Jinja program a model ships to turn a list of messages into its prompt.

Rendered the way transformers' `apply_chat_template` renders them (`utils/chat_template_utils.py`),
so a prompt is byte-identical to what the model's own tooling produces. Templates come from
downloaded files, so they are untrusted code: they run in Jinja's immutable sandbox, and everything
they can see is rebuilt from plain JSON-like values first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# llama.cpp falls back to ChatML when a file has no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Names a message's reasoning may come under; transformers fills in the first two from any of them.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateError(ValueError):
    """A chat template failed to compile or render (or called raise_exception)."""


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template does not compile: line {exc.lineno}: {exc.message}") from None

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], tokenizer) -> ChatTemplate:
        source = meta.get("tokenizer.chat_template") or CHATML_TEMPLATE
        bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
        eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
        return cls(source, bos_token=bos, eos_token=eos)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
               **extra) -> str:
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **_plain(extra),  # as in transformers, caller values override the special tokens
            "messages": _alias_reasoning(_plain(list(messages))),
            "tools": _plain(tools),
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(_one_line(f"chat template error: {exc}")) from None
        except Exception as exc:  # a template bug (e.g. str + None) surfaces as a python error
            raise TemplateError(_one_line(f"chat template failed: {type(exc).__name__}: {exc}")) from None


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _raise_exception(message: str):
    raise TemplateError(_one_line(f"chat template raised: {message}"))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; prompts need the plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """`dict(...)` for templates without exposing the dict type itself (no `dict.__subclasses__`)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore names so a template cannot plant dunder attributes."""

    def __init__(*args, **kwargs):  # noqa: N805 -- Jinja's signature, so namespace(self=...) works
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant spans with it for
    training masks; for a prompt it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj, attribute):
        # Jinja returns an undefined that fails only when used, so `{{ x.__class__ }}` prints ''.
        # No honest template reads such attributes: fail at the attempt.
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace
    )
    return env


def _plain(value: Any) -> Any:
    """A copy made only of JSON-like python values. The sandbox guards attribute access, but a
    rich object (an array, an image) may still have methods it does not know to be dangerous."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (str enums, numpy float64) lose their extra methods; `str(enum)` would also
    # change the text, the base-class conversion does not.
    for convert, kind in ((str.__str__, str), (int.__int__, int), (float.__float__, float)):
        if isinstance(value, kind):
            return convert(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalar types that are not int/float
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _alias_reasoning(messages: list) -> list:
    # Templates read a message's reasoning as `reasoning_content` (Qwen, DeepSeek) or `thinking`
    # (gpt-oss); transformers fills both from whichever the caller used, and so do we.
    aliased = []
    for message in messages:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased
