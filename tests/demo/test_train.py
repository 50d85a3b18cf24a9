"""splitmoe/demo/train.py: a few real training steps, the GGUF they write, and what the services make of it.

The torch model that trains (demo/net.py) must compute what the services compute from its GGUF,
or the answers it learns are not the ones served: written in float32, its logits and the runner's
float32 ones agree to rounding.
"""
from __future__ import annotations

import torch

from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.demo import corpus, vocab
from splitmoe.demo.train import TrainSettings, encode_chat, main, train, write_gguf
from splitmoe.modelfile.chat_template import ChatTemplate
from splitmoe.modelfile.gguf_file import GGUFFile


def test_the_script_writes_a_gguf_the_runner_loads(tmp_path, capsys):
    out = tmp_path / "t.gguf"
    assert main(["--out", str(out), "--steps", "2"]) == 0
    g = GGUFFile(out)
    assert g.metadata["general.architecture"] == "qwen3moe"
    assert int(g.arch_require("expert_count")) == 8 and int(g.arch_require("expert_used_count")) == 2
    assert "answer loss" in capsys.readouterr().out
    runner = ModelRunner.from_gguf(out, RunnerOptions(dtype=torch.bfloat16, device=torch.device("cpu")))
    assert runner.step([Sequence(0, [1, 2, 3])]).isfinite().all()


def test_the_trained_net_and_the_runner_compute_the_same_logits(tmp_path):
    settings = TrainSettings(steps=3, quant="f32")
    model, meta = train(settings, log=lambda line: None)
    path = tmp_path / "f32.gguf"
    write_gguf(path, model, meta, settings)
    tok = vocab.tokenizer(meta)
    ids = tok.encode("<|im_start|>user\nWhat is 7 + 5?<|im_end|>\n<|im_start|>assistant\n")
    with torch.no_grad():
        expected = model(torch.tensor([ids]))[0][0]
    runner = ModelRunner.from_gguf(path, RunnerOptions(dtype=torch.float32, device=torch.device("cpu")))
    got = runner.step([Sequence(0, ids)], all_logits=True)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < 1e-4 * expected.abs().max()


def test_training_is_a_function_of_the_seed(tmp_path):
    files = []
    for name in ("a", "b"):
        s = TrainSettings(steps=2)
        model, meta = train(s, log=lambda line: None)
        write_gguf(tmp_path / f"{name}.gguf", model, meta, s)
        files.append((tmp_path / f"{name}.gguf").read_bytes())
    assert files[0] == files[1]


def test_every_word_of_the_corpus_is_one_token_and_any_text_encodes():
    meta = vocab.tokenizer_metadata(vocab.learn_merges(corpus.words(), 2000))
    tok = vocab.tokenizer(meta)
    for word in ("What", " Paris", " Buenos", " centimeters", " capital", " opposite"):
        assert len(tok.encode(word)) == 1, word
    text = "ünïcode, emoji 🙂 and words it never saw"
    assert tok.decode(tok.encode(text)) == text  # byte-level: nothing is unknown


def test_only_the_answer_and_its_end_are_learned():
    meta = vocab.tokenizer_metadata(vocab.learn_merges(corpus.words(), 2000))
    tok = vocab.tokenizer(meta)
    template = ChatTemplate.from_gguf_metadata(meta, tok)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 + 5?"},
            {"role": "assistant", "content": "12"}]
    example = encode_chat(chat, template, tok)
    learned = example.ids[example.answer_start + 1:]
    assert tok.decode(learned) == "12<|im_end|>"
    assert tok.decode(example.ids[: example.answer_start + 1]).endswith("<|im_start|>assistant\n")
