"""Ask a GGUF the corpus's questions in one process, greedy, and count the right answers.

    python -m splitmoe.demo.check [MODEL.gguf] [--dtype bfloat16|float32]

What the services would answer at temperature 0 (the same runner, tokenizer and chat template), so a
training run can be judged before anything is served.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from splitmoe.demo import corpus, trained_model_path


def answers(model: Path, questions: list[str], dtype: str = "bfloat16", max_tokens: int = 24) -> list[str]:
    import torch

    from splitmoe.attention_service.model.generate import greedy_tokens
    from splitmoe.attention_service.model.runner import DTYPES, ModelRunner, RunnerOptions
    from splitmoe.modelfile.chat_template import ChatTemplate
    from splitmoe.modelfile.tokenizer import Tokenizer

    runner = ModelRunner.from_gguf(model, RunnerOptions(dtype=DTYPES[dtype], device=torch.device("cpu"),
                                                        kv_cache_tokens=256))
    tok = Tokenizer.from_gguf_metadata(runner.gguf.metadata)
    template = ChatTemplate.from_gguf_metadata(runner.gguf.metadata, tok)
    out = []
    for question in questions:
        prompt = tok.encode(template.render([{"role": "user", "content": question}]), add_special_tokens=False)
        ids = [t for t in greedy_tokens(runner, prompt, max_tokens, tok.stop_ids) if t not in tok.stop_ids]
        out.append(tok.decode(ids, skip_special_tokens=True))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitmoe.demo.check", description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=str(trained_model_path()))
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--show-wrong", type=int, default=20, help="print at most this many wrong answers")
    args = p.parse_args(argv)
    facts = [(ways[0], answer) for ways, answer in corpus.facts()]
    got = answers(Path(args.model), [q for q, _ in facts], args.dtype)
    wrong = [(q, a, g) for (q, a), g in zip(facts, got) if g != a]
    for q, a, g in wrong[: args.show_wrong]:
        print(f"{q!r}: wanted {a!r}, got {g!r}")
    print(f"{len(facts) - len(wrong)} of {len(facts)} right ({args.dtype})")
    return 0 if not wrong else 1


if __name__ == "__main__":
    raise SystemExit(main())
