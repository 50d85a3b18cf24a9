"""The trained demo's chat template: ChatML, and tools rendered the way Qwen3's own template renders them.

Qwen's layout because the demo is a qwen3moe and the gateway reads its calls with the hermes parser
(attention_service/engine/tool_calls/hermes.py), chosen because <tool_call> is a token of its
vocabulary: the tool definitions go into the system turn inside <tools></tools> under Qwen's
instruction, a call is `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, and tool
results come back as a user turn of <tool_response> blocks. Without tools every message renders as
plain ChatML, byte for byte, so the chats the demo learned before tools existed read as they did.
Compact: Qwen3's reasoning (<think>) and multi-step bookkeeping are left out, as the demo has neither.
"""
from __future__ import annotations

# Added tokens, as in Qwen's vocabulary: matched whole in text, written out by the decoder (not special).
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
               '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
               "<args-json-object>}\n</tool_call>")

# Jinja string literals below are written with Python's escapes doubled where Jinja must see them.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- " + repr(TOOLS_INTRO) + " }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- " + repr(TOOLS_OUTRO + "<|im_end|>\n") + " }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if call.function %}{%- set call = call.function %}{%- endif %}"
    "{%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif not (tools and loop.first and message.role == 'system') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
