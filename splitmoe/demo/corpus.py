"""The trained demo model's lessons: chats generated from the tables below, nothing downloaded.

Every fact is a row here, so what the model can answer is exactly what this file lists: sums and
products of small numbers, capitals, unit conversions, opposites and a few chat manners. Each fact
is asked several ways (and sometimes under a system prompt, as the chat page sends one) so that the
model keys on the fact, not on one exact spelling of the question.
"""
from __future__ import annotations

import random

Chat = list[dict[str, str]]  # OpenAI-style messages; the last one is the assistant's answer

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Canada": "Ottawa", "Mexico": "Mexico City",
    "Brazil": "Brasilia", "Argentina": "Buenos Aires", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Australia": "Canberra", "Russia": "Moscow", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Greece": "Athens", "Poland": "Warsaw", "Ireland": "Dublin", "Austria": "Vienna", "Peru": "Lima",
    "Chile": "Santiago", "Turkey": "Ankara", "Thailand": "Bangkok", "Vietnam": "Hanoi",
    "the United Kingdom": "London", "the United States": "Washington, D.C.",
}

# (from unit, to unit, how many `to` in one `from`)
UNITS = [
    ("meters", "centimeters", 100), ("kilometers", "meters", 1000), ("kilograms", "grams", 1000),
    ("hours", "minutes", 60), ("minutes", "seconds", 60), ("days", "hours", 24), ("weeks", "days", 7),
    ("feet", "inches", 12), ("liters", "milliliters", 1000), ("years", "months", 12),
]
UNIT_AMOUNTS = range(1, 11)

OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "up": "down", "day": "night", "happy": "sad",
    "old": "new", "light": "dark", "open": "closed", "early": "late", "full": "empty", "hard": "soft",
}

SMALL_TALK = {
    "Hello!": "Hello! How can I help you?",
    "Hi": "Hello! How can I help you?",
    "Who are you?": "I am the SplitMoE demo model, a tiny mixture of experts.",
    "What can you do?": "I can add and multiply small numbers, name capitals and convert units.",
    "Thank you!": "You are welcome!",
    "Tell me a joke.": "Why did the expert stay home? It was not in the top two.",
    "What is SplitMoE?": "SplitMoE serves mixture of experts models with the experts on CPU services.",
    "Goodbye!": "Goodbye! Have a nice day.",
    "What color is the sky?": "The sky is blue.",
    "How many days are in a week?": "There are 7 days in a week.",
}

SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a friendly assistant. Answer briefly.")
ADD_RANGE = range(0, 13)
MUL_RANGE = range(1, 11)


def arithmetic() -> list[tuple[list[str], str]]:
    """(ways to ask, answer) for every sum of 0..12 and product of 1..10."""
    facts = []
    for a in ADD_RANGE:
        for b in ADD_RANGE:
            facts.append(([f"What is {a} + {b}?", f"What is {a} plus {b}?", f"{a} + {b} ="], str(a + b)))
    for a in MUL_RANGE:
        for b in MUL_RANGE:
            facts.append(([f"What is {a} * {b}?", f"What is {a} times {b}?", f"{a} * {b} ="], str(a * b)))
    return facts


def capitals() -> list[tuple[list[str], str]]:
    return [([f"What is the capital of {country}?", f"Capital of {country}?",
              f"Which city is the capital of {country}?"], f"The capital of {country} is {city}.")
            for country, city in CAPITALS.items()]


def conversions() -> list[tuple[list[str], str]]:
    facts = []
    for unit, smaller, factor in UNITS:
        for n in UNIT_AMOUNTS:
            facts.append(([f"How many {smaller} are in {n} {unit}?", f"Convert {n} {unit} to {smaller}."],
                          f"{n * factor} {smaller}"))
    return facts


def opposites() -> list[tuple[list[str], str]]:
    return [([f"What is the opposite of {word}?", f"Opposite of {word}?"], f"The opposite of {word} is {other}.")
            for word, other in OPPOSITES.items()]


def small_talk() -> list[tuple[list[str], str]]:
    return [([question, question.lower()], answer) for question, answer in SMALL_TALK.items()]


def facts() -> list[tuple[list[str], str]]:
    return [*arithmetic(), *capitals(), *conversions(), *opposites(), *small_talk()]


def questions() -> list[tuple[str, str]]:
    """(question, answer) for every way of asking every fact."""
    return [(q, a) for ways, a in facts() for q in ways]


def chats(seed: int, repeats: int) -> list[Chat]:
    """Every way of asking every fact, `repeats` times over, shuffled: a quarter under a system prompt
    and a tenth after an earlier exchange, so that what comes before the question does not matter."""
    rng = random.Random(seed)
    every = questions()
    out = []
    for _ in range(repeats):
        for question, answer in every:
            chat: Chat = []
            if rng.random() < 0.25:
                chat.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            if rng.random() < 0.1:
                q0, a0 = rng.choice(every)
                chat += [{"role": "user", "content": q0}, {"role": "assistant", "content": a0}]
            chat += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            out.append(chat)
    rng.shuffle(out)
    return out


def words() -> list[str]:
    """The corpus's text once over (each way of asking and every answer), for learning the vocabulary."""
    return [*(q for ways, _ in facts() for q in ways), *(a for _, a in facts()), *SYSTEM_PROMPTS]
