"""The demo model that answers in words: a tiny qwen3moe trained on CPU (train.py) and shipped here.

`splitmoe up`, `serve-attention`, `logits`/`generate` and the Docker image use it when no model is
given. splitmoe/demo_model.py's random-weights model stays for the tests that need any model.
"""
from __future__ import annotations

from pathlib import Path

TRAINED_GGUF = "demo-chat-qwen3moe.gguf"


def trained_model_path() -> Path:
    """The shipped GGUF (package data: see setup.py), written by `python -m splitmoe.demo.train`."""
    return Path(__file__).resolve().parent / TRAINED_GGUF
