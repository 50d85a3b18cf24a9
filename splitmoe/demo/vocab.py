"""The trained demo's vocabulary: byte-level BPE (GGUF `gpt2`, `qwen2` pre-tokenizer) learned from its corpus.

Byte-level BPE because it is what the served families use and what modelfile/tokenizer.py rebuilds
exactly: every byte has a token, so any text a user types encodes, and the merges learned here make
the corpus's words single tokens, which keeps sequences short and the training cheap. The learner
is a plain greedy BPE with ties broken by the pair's spelling, so the vocabulary is a pure function
of the corpus. Training then encodes with the project's own tokenizer built from this metadata, so
the model learns exactly the ids the services will feed it. The tool-call markers (template.py)
are added tokens, as in Qwen's vocabulary, so a call opens with one token and the server recognises
the hermes syntax from the vocabulary.
"""
from __future__ import annotations

import re
from collections import Counter

from splitmoe.demo.template import CHAT_TEMPLATE, TOOL_TOKENS
from splitmoe.demo_model import SPECIAL_TOKENS, byte_level_vocab
from splitmoe.modelfile.tokenizer import CONTROL, NORMAL, USER_DEFINED, Tokenizer

# Close to the qwen2 pre-tokenizer's split (letters with one leading non-letter, single digits,
# punctuation runs, whitespace): merges across its boundaries would be learned but never applied.
# `_` counts as a non-letter there ("_weather" is one piece), where Python's \w would count it a letter.
_PRE_TOKEN = re.compile(r"(?:[^\r\n\w]|_)?[^\W\d_]+|\d| ?(?:[^\s\w]|_)+[\r\n]*|\s+")


def learn_merges(texts: list[str], max_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE merges over the byte-level pre-tokens of `texts`, most frequent pair first."""
    alphabet = byte_level_vocab()
    counts = Counter(pre for text in texts for pre in _PRE_TOKEN.findall(text))
    words = {tuple(alphabet[b] for b in pre.encode()): n for pre, n in counts.items()}
    merges: list[tuple[str, str]] = []
    while len(merges) < max_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        words = {_merge(word, best): n for word, n in words.items()}
    return merges


def _merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def tokenizer_metadata(merges: list[tuple[str, str]]) -> dict:
    """The `tokenizer.*` GGUF keys of this vocabulary, as GGUFFile.metadata holds them."""
    merged = list(dict.fromkeys(a + b for a, b in merges))  # two merges may spell the same token
    normal = list(dict.fromkeys(byte_level_vocab() + [t for t in merged if len(t) > 1]))
    tokens = normal + list(TOOL_TOKENS) + list(SPECIAL_TOKENS)
    types = [NORMAL] * len(normal) + [USER_DEFINED] * len(TOOL_TOKENS) + [CONTROL] * len(SPECIAL_TOKENS)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def tokenizer(meta: dict) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(meta)
