"""Ask a GGUF the corpus's questions in one process, greedy, and count the right answers.

    python -m splitmoe.demo.check [MODEL.gguf] [--dtype bfloat16|float32]

What the services would answer at temperature 0 (the same runner, tokenizer and chat template), so a
training run can be judged before anything is served: every fact, then the skills' fixed cases
(corpus.skill_checks: tool calls in their markup, sentences from tool results, JSON answers).
"""
from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from splitmoe.demo import corpus, trained_model_path

SKILL_MAX_TOKENS = 48  # the longest expected reply, a call of calculate, is about 25 tokens


class Asker:
    """A GGUF loaded as the services load it, asked greedily in one process."""

    def __init__(self, model: Path, dtype: str = "bfloat16"):
        import torch

        from splitmoe.attention_service.model.runner import DTYPES, ModelRunner, RunnerOptions
        from splitmoe.modelfile.chat_template import ChatTemplate
        from splitmoe.modelfile.tokenizer import Tokenizer

        self.runner = ModelRunner.from_gguf(model, RunnerOptions(dtype=DTYPES[dtype], device=torch.device("cpu"),
                                                                 kv_cache_tokens=512))  # tools: ~300 tokens
        self.tok = Tokenizer.from_gguf_metadata(self.runner.gguf.metadata)
        self.template = ChatTemplate.from_gguf_metadata(self.runner.gguf.metadata, self.tok)

    def reply(self, lesson: corpus.Lesson, max_tokens: int = 24) -> str:
        """The reply to the lesson's chat but its answer, as the decoder writes it (a call's markup included)."""
        from splitmoe.attention_service.model.generate import greedy_tokens

        text = self.template.render(lesson.chat[:-1], tools=lesson.tools)
        prompt = self.tok.encode(text, add_special_tokens=False)
        ids = [t for t in greedy_tokens(self.runner, prompt, max_tokens, self.tok.stop_ids) if t not in self.tok.stop_ids]
        return self.tok.decode(ids, skip_special_tokens=True)

    def expected(self, lesson: corpus.Lesson) -> str:
        """The lesson's answer as the template writes it, up to its <|im_end|>: what the model learned."""
        prompt = self.template.render(lesson.chat[:-1], add_generation_prompt=True, tools=lesson.tools)
        full = self.template.render(lesson.chat, add_generation_prompt=False, tools=lesson.tools)
        return full[len(prompt):].split("<|im_end|>", 1)[0]


def fact_lesson(question: str, answer: str) -> corpus.Lesson:
    return corpus.Lesson([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitmoe.demo.check", description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=str(trained_model_path()))
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--show-wrong", type=int, default=20, help="print at most this many wrong answers")
    args = p.parse_args(argv)
    asker = Asker(Path(args.model), args.dtype)
    facts = [(ways[0], answer) for ways, answer in corpus.facts()]
    wrong = [(q, a, got) for q, a in facts if (got := asker.reply(fact_lesson(q, a))) != a]
    skills = corpus.skill_checks()
    missed = [(kind, f"{kind}: {lesson.chat[-2].get('content')!r}", want, got) for kind, lesson in skills
              if (got := asker.reply(lesson, SKILL_MAX_TOKENS)) != (want := asker.expected(lesson))]
    for q, a, got in [*wrong, *(m[1:] for m in missed)][: args.show_wrong]:
        print(f"{q!r}: wanted {a!r}, got {got!r}")
    counts, misses = Counter(kind for kind, _ in skills), Counter(m[0] for m in missed)
    print("skills: " + ", ".join(f"{kind} {n - misses[kind]} of {n}" for kind, n in counts.items()))
    print(f"{len(skills) - len(missed)} of {len(skills)} skill checks right ({args.dtype})")
    print(f"{len(facts) - len(wrong)} of {len(facts)} right ({args.dtype})")  # last: the line tests read
    return 0 if not wrong and not missed else 1


if __name__ == "__main__":
    raise SystemExit(main())
