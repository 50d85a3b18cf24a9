"""Train the demo model that answers in words, on one CPU core, and write its GGUF.

    python -m splitmoe.demo.train --out chat.gguf            # the shipped model: DEFAULT_STEPS steps
    python -m splitmoe.demo.train --out /tmp/t.gguf --steps 5

The corpus (corpus.py), the vocabulary (vocab.py) and the initial weights all come from the seed,
and torch runs on one thread, so the same seed, torch version and CPU give the same file. The
loss counts only the assistant's answer and its closing <|im_end|>: the model learns to answer,
not to predict the questions.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from splitmoe.demo import corpus, vocab
from splitmoe.demo.gguf_out import write_trained_gguf
from splitmoe.demo.net import NetShape, TinyQwen3Moe
from splitmoe.modelfile.chat_template import ChatTemplate
from splitmoe.modelfile.tokenizer import Tokenizer

DEFAULT_STEPS = 1200  # the skills' copying (a city, a number) comes late: 600 steps learn the facts only
MAX_MERGES = 2000  # more than the corpus needs: every word of it becomes one token
# Batches are cut from this many batches' worth of chats sorted by length (see length_batches).
WINDOW_BATCHES = 16


@dataclass(frozen=True)
class TrainSettings:
    steps: int = DEFAULT_STEPS
    seed: int = 0
    batch_chats: int = 64
    lr: float = 3e-3
    warmup_steps: int = 50
    balance_coef: float = 0.01  # weight of the load-balancing term: every expert keeps getting tokens
    quant: str = "q8_0"         # or "f32" (exact, for comparing with the services' float32 path)


@dataclass(frozen=True)
class Example:
    ids: list[int]
    answer_start: int  # the first position whose next token is part of the answer


def encode_chat(chat: corpus.Chat, template: ChatTemplate, tok: Tokenizer, tools: list | None = None) -> Example:
    """The chat's ids up to the answer's <|im_end|>, and where the answer starts."""
    prompt = tok.encode(template.render(chat[:-1], add_generation_prompt=True, tools=tools), add_special_tokens=False)
    full = tok.encode(template.render(chat, add_generation_prompt=False, tools=tools), add_special_tokens=False)
    end = full.index(tok.eos_id, len(prompt)) + 1
    if full[: len(prompt)] != prompt:  # ChatML's turns start with a special token, so this holds
        raise ValueError(f"the prompt's tokens are not a prefix of the chat's: {chat!r}")
    return Example(full[:end], len(prompt) - 1)


def length_batches(examples: list[Example], batch_chats: int, seed: int) -> list[list[Example]]:
    """The examples in batches of about one length, in about their order: a batch pads to its
    longest chat, and a chat with tools is ten times longer than one without. Each window of
    WINDOW_BATCHES batches is sorted by length, cut, and its batches shuffled."""
    rng = random.Random(seed)
    window = batch_chats * WINDOW_BATCHES
    out = []
    for start in range(0, len(examples), window):
        chunk = sorted(examples[start : start + window], key=lambda e: len(e.ids))
        batches = [chunk[i : i + batch_chats] for i in range(0, len(chunk), batch_chats)]
        rng.shuffle(batches)
        out += batches
    return out


def batch(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [B, T] and targets [B, T] (-100 where no loss: the question and the padding)."""
    width = max(len(e.ids) for e in examples) - 1
    inputs = torch.full((len(examples), width), pad_id)
    targets = torch.full((len(examples), width), -100)
    for row, e in enumerate(examples):
        ids = torch.tensor(e.ids)
        inputs[row, : len(ids) - 1] = ids[:-1]
        targets[row, e.answer_start : len(ids) - 1] = ids[e.answer_start + 1 :]
    return inputs, targets


def learning_rate(step: int, s: TrainSettings) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(s: TrainSettings, log=print) -> tuple[TinyQwen3Moe, dict]:
    """The trained model and its tokenizer metadata."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # minutes on one core leave a shared machine's others free
    try:
        return _train(s, log)
    finally:
        torch.set_num_threads(threads)


def _train(s: TrainSettings, log) -> tuple[TinyQwen3Moe, dict]:
    meta = vocab.tokenizer_metadata(vocab.learn_merges(corpus.words(), MAX_MERGES))
    tok = vocab.tokenizer(meta)
    template = ChatTemplate.from_gguf_metadata(meta, tok)
    lessons = corpus.chats(s.seed, s.steps * s.batch_chats)
    batches = length_batches([encode_chat(c.chat, template, tok, c.tools) for c in lessons], s.batch_chats, s.seed)
    model = TinyQwen3Moe(NetShape(vocab_size=len(meta["tokenizer.ggml.tokens"])), s.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.98), weight_decay=0.0)
    pad_id = meta["tokenizer.ggml.padding_token_id"]
    start = time.monotonic()
    for step in range(s.steps):
        inputs, targets = batch(batches[step], pad_id)
        logits, balance = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, s)
        opt.zero_grad(set_to_none=True)
        (loss + s.balance_coef * balance).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == s.steps - 1:
            log(f"step {step:5d}  answer loss {loss.item():.4f}  balance {balance.item():.3f}  "
                f"{time.monotonic() - start:.0f} s")
    return model, meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitmoe.demo.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the GGUF file to write")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps (default {DEFAULT_STEPS})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quant", choices=["q8_0", "f32"], default="q8_0")
    args = p.parse_args(argv)
    s = TrainSettings(steps=args.steps, seed=args.seed, quant=args.quant)
    model, meta = train(s)
    write_gguf(Path(args.out), model, meta, s)
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.1f} MB)")
    return 0


def write_gguf(path: Path, model: TinyQwen3Moe, meta: dict, s: TrainSettings) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    write_trained_gguf(tmp, model, meta, s.quant, name=f"SplitMoE demo (trained, seed {s.seed}, {s.steps} steps)")
    tmp.replace(path)


if __name__ == "__main__":
    raise SystemExit(main())
