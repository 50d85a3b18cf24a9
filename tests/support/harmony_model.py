"""A demo model that speaks gpt-oss's harmony format, for the reasoning split's tests."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from splitmoe.attention_service.engine.reasoning import HARMONY_MARKERS
from splitmoe.demo_model import MERGES, SPECIAL_TOKENS, byte_level_vocab, write_demo_model
from splitmoe.modelfile.tokenizer import CONTROL, NORMAL
from tests.support.gguf_edit import rewrite_gguf


def write_harmony_demo_model(folder: Path) -> Path:
    """The demo model with gpt-oss's markers added as control tokens, and a harmony-style template
    whose generation prompt opens the analysis channel. The new tokens' embedding and output rows
    are zero, so the random model never picks them: all it writes lands in the analysis channel."""
    write_demo_model(folder / "demo.gguf")
    tokens = byte_level_vocab() + [a + b for a, b in MERGES] + list(SPECIAL_TOKENS) + list(HARMONY_MARKERS)
    types = [NORMAL] * (len(tokens) - len(SPECIAL_TOKENS) - len(HARMONY_MARKERS)) + [CONTROL] * (
        len(SPECIAL_TOKENS) + len(HARMONY_MARKERS))
    template = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|start|>assistant<|channel|>analysis<|message|>{% endif %}")
    keys = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.chat_template": template, "qwen3moe.vocab_size": len(tokens)}

    def add_rows(name, data, qtype):
        if name in ("token_embd.weight", "output.weight"):
            data = np.concatenate([data, np.zeros((len(HARMONY_MARKERS), data.shape[1]), data.dtype)])
        return data, qtype

    rewrite_gguf(folder / "demo.gguf", folder / "harmony.gguf", drop_keys=tuple(keys), set_keys=keys,
                 edit_tensor=add_rows)
    return folder / "harmony.gguf"
