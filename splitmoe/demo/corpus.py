"""The trained demo model's lessons: chats generated from the tables below, nothing downloaded.

Every fact is a row here, so what the model can answer is exactly what this file lists: sums and
products of small numbers, capitals, unit conversions, opposites and a few chat manners. Each fact
is asked several ways (and sometimes under a system prompt, as the chat page sends one) so that the
model keys on the fact, not on one exact spelling of the question.

Besides facts, skills, so that `tools`, `tool_choice` and `response_format` have something to
show: calling `get_weather` or `calculate` when one is offered and the question needs it (and not
otherwise), answering in a sentence once the tool's result comes back, and answering in compact JSON
(the layout a `response_format` grammar allows) when asked to. A few lessons answer a tool question
with the JSON a named or required `tool_choice` forces, and a capital question with its JSON, so
that what a grammar starts the model can finish. Tool results are drawn at random, so the model
learns to copy them rather than to remember one forecast.
"""
from __future__ import annotations

import json
import random
from typing import Any, NamedTuple

from splitmoe.demo.template import TOOLS_INTRO, TOOLS_OUTRO

Message = dict[str, Any]
Chat = list[Message]  # OpenAI-style messages; the last one is the assistant's answer
Tool = dict[str, Any]  # an OpenAI tool definition, as the gateway passes it to the chat template


class Lesson(NamedTuple):
    chat: Chat
    tools: list[Tool] | None = None  # offered to the model (rendered into the system turn)

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


def chats(seed: int, num_chats: int) -> list[Lesson]:
    """`num_chats` lessons: whole rounds of every way of asking every fact and of the skills' lessons,
    shuffled, cut to length. A quarter of the facts come under a system prompt, a tenth after an
    earlier exchange and some (UNNEEDED_TOOLS_SHARE) with tools offered that they do not need, so
    that none of these changes the answer."""
    rng = random.Random(seed)
    every = questions()
    out: list[Lesson] = []
    while len(out) < num_chats:
        for question, answer in every:
            chat: Chat = []
            if rng.random() < 0.25:
                chat.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            if rng.random() < 0.1:
                q0, a0 = rng.choice(every)
                chat += [{"role": "user", "content": q0}, {"role": "assistant", "content": a0}]
            chat += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            tools = unneeded_tools(rng, question) if rng.random() < UNNEEDED_TOOLS_SHARE else None
            out.append(Lesson(chat, tools))
        out += skill_round(rng)
    rng.shuffle(out)
    return out[:num_chats]


def words() -> list[str]:
    """The corpus's text once over (each way of asking, every answer, the tools and the template's
    instructions), for learning the vocabulary."""
    rng = random.Random(0)
    lessons = weather_lessons(rng) + calculate_lessons(rng)
    calls = [c["function"] for lesson in lessons for m in lesson.chat for c in m.get("tool_calls", ())]
    results = [weather_result(city, rng.choice(TEMPERATURES), c) for city in WEATHER_CITIES for c in CONDITIONS]
    return [*(q for ways, _ in facts() for q in ways), *(a for _, a in facts()), *SYSTEM_PROMPTS,
            *(q for ways, _ in json_facts() for q in ways), *(a for _, a in json_facts()),
            *(m["content"] for lesson in lessons for m in lesson.chat), *results,
            *(json.dumps(t) for t in ALL_TOOLS), *(json.dumps(c) for c in calls), TOOLS_INTRO, TOOLS_OUTRO]


# ---------------------------------------------------------------------------------------------- skills

def _tool(name: str, description: str, parameter: str, parameter_description: str) -> Tool:
    """Key order as the gateway passes a tool on (type, function: name, description, parameters)."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {parameter: {"type": "string",
                                                                    "description": parameter_description}},
                       "required": [parameter]}}}


def _bare(tool: Tool) -> Tool:
    """The tool without descriptions: clients send either, and the model must call it both ways."""
    function = tool["function"]
    parameters = function["parameters"]
    properties = {k: {"type": v["type"]} for k, v in parameters["properties"].items()}
    return {"type": "function", "function": {"name": function["name"], "parameters": {
        "type": "object", "properties": properties, "required": parameters["required"]}}}


WEATHER_TOOL = _tool("get_weather", "Get the current weather in a city", "city", "The city, e.g. Paris")
CALCULATE_TOOL = _tool("calculate", "Evaluate an arithmetic expression", "expression", "The expression, e.g. 12 * 7")
WEATHER_TOOLS = (WEATHER_TOOL, _bare(WEATHER_TOOL))
CALCULATE_TOOLS = (CALCULATE_TOOL, _bare(CALCULATE_TOOL))
ALL_TOOLS = WEATHER_TOOLS + CALCULATE_TOOLS

# What the README's and the checks' get_weather returns; the lessons draw forecasts at random.
WEATHER = {"Paris": (18, "sunny"), "London": (12, "rainy"), "Tokyo": (22, "cloudy"), "Berlin": (9, "windy"),
           "Oslo": (-3, "snowy"), "Cairo": (31, "sunny"), "Lima": (17, "foggy"), "Ottawa": (5, "cloudy")}
WEATHER_CITIES = tuple(city for city in CAPITALS.values() if "," not in city)
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy")
TEMPERATURES = range(-10, 36)
WEATHER_QUESTIONS = ("What is the weather in {}?", "How is the weather in {}?", "Weather in {}?")
NO_WEATHER_TOOL = "I cannot check the weather without a weather tool."
OPERATORS = {"+": "plus", "-": "minus", "*": "times"}
OPERANDS = (range(0, 10), range(10, 100))
# Lessons per round (chats): the copying a call needs is learned from many examples, not a few.
WEATHER_CALLS_PER_CITY, WEATHER_RESULTS_PER_CITY, WEATHER_FORCED_PER_CITY = 3, 5, 1
CALCULATE_CALLS, CALCULATE_RESULTS, CALCULATE_FORCED = 80, 60, 20
UNNEEDED_TOOLS_SHARE = 0.08
JSON_ASKS = ("{} Answer in JSON.", "{} Reply with JSON.")
JSON_ARITHMETIC_PER_ROUND = 40


def compact_json(value) -> str:
    """JSON as a response_format grammar lets the model write it (no whitespace between tokens)."""
    return json.dumps(value, separators=(",", ":"))


def tool_call(name: str, arguments: dict) -> Message:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": arguments}}]}


def forced_call(name: str, arguments: dict, required: bool) -> Message:
    """The reply a forcing tool_choice constrains the model to (gateway/tools.py), compact as its
    grammar writes it: the arguments alone for a named function, a JSON array of calls for required.
    The prompt is the same as without forcing, so these lessons are a minority: unforced, the model
    still writes <tool_call> first, and under the grammar it knows what follows the forced `{`."""
    if required:
        return _assistant(compact_json([{"name": name, "parameters": arguments}]))
    return _assistant(compact_json(arguments))


def weather_call(city: str) -> Message:
    return tool_call("get_weather", {"city": city})


def calculate_call(a: int, op: str, b: int) -> Message:
    return tool_call("calculate", {"expression": f"{a} {op} {b}"})


def weather_result(city: str, temperature: int, condition: str) -> str:
    return f"It is {temperature} degrees and {condition} in {city}."


def weather_report(temperature: int, condition: str) -> str:
    """What get_weather returns, as a client would send it back (json.dumps)."""
    return json.dumps({"temperature": temperature, "condition": condition})


def _expression(rng: random.Random) -> tuple[int, str, int]:
    """Operands of one digit as often as of two: both kinds must be copied digit for digit."""
    return rng.choice(rng.choice(OPERANDS)), rng.choice(list(OPERATORS)), rng.choice(rng.choice(OPERANDS))


def calculation_questions(a: int, op: str, b: int) -> list[str]:
    return [f"What is {a} {op} {b}?", f"What is {a} {OPERATORS[op]} {b}?", f"Calculate {a} {op} {b}."]


def calculation(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def calculation_report(a: int, op: str, b: int) -> str:
    """What calculate returns, as a client would send it back (json.dumps)."""
    return json.dumps({"result": calculation(a, op, b)})


def calculation_result(a: int, op: str, b: int) -> str:
    return f"The result is {calculation(a, op, b)}."


def _offer(rng: random.Random, *tools: tuple[Tool, ...]) -> list[Tool]:
    """One spelling of each kind of tool, in a random order."""
    offered = [rng.choice(kind) for kind in tools]
    rng.shuffle(offered)
    return offered


def _with_weather(rng: random.Random) -> list[Tool]:
    return _offer(rng, WEATHER_TOOLS, CALCULATE_TOOLS) if rng.random() < 0.5 else _offer(rng, WEATHER_TOOLS)


def _with_calculate(rng: random.Random) -> list[Tool]:
    return _offer(rng, WEATHER_TOOLS, CALCULATE_TOOLS) if rng.random() < 0.5 else _offer(rng, CALCULATE_TOOLS)


def _is_arithmetic(question: str) -> bool:
    return any(f" {op} " in question or f" {word} " in question for op, word in OPERATORS.items())


def unneeded_tools(rng: random.Random, question: str) -> list[Tool]:
    """Tools a fact's question does not need (arithmetic would go to calculate: only get_weather)."""
    return _offer(rng, WEATHER_TOOLS) if _is_arithmetic(question) else _with_calculate(rng)


def weather_lessons(rng: random.Random) -> list[Lesson]:
    """Per city: the call, the sentence from a random forecast, and the refusal without the tool."""
    out = []
    for city in WEATHER_CITIES:
        for _ in range(WEATHER_CALLS_PER_CITY):
            out.append(Lesson([_user(rng.choice(WEATHER_QUESTIONS).format(city)), weather_call(city)],
                              _with_weather(rng)))
        for _ in range(WEATHER_RESULTS_PER_CITY):
            temperature, condition = rng.choice(TEMPERATURES), rng.choice(CONDITIONS)
            out.append(Lesson([_user(rng.choice(WEATHER_QUESTIONS).format(city)), weather_call(city),
                               _tool_result("call_get_weather", weather_report(temperature, condition)),
                               _assistant(weather_result(city, temperature, condition))], _with_weather(rng)))
        for _ in range(WEATHER_FORCED_PER_CITY):
            out.append(Lesson([_user(rng.choice(WEATHER_QUESTIONS).format(city)),
                               forced_call("get_weather", {"city": city}, rng.random() < 0.5)], _with_weather(rng)))
        without = _offer(rng, CALCULATE_TOOLS) if rng.random() < 0.5 else None
        out.append(Lesson([_user(rng.choice(WEATHER_QUESTIONS).format(city)), _assistant(NO_WEATHER_TOOL)], without))
    return out


def calculate_lessons(rng: random.Random) -> list[Lesson]:
    """Sums, differences and products of numbers below 100: the call, the sentence from its result,
    and the forced call."""
    out = []
    for n in range(CALCULATE_CALLS + CALCULATE_RESULTS + CALCULATE_FORCED):
        a, op, b = _expression(rng)
        question = _user(rng.choice(calculation_questions(a, op, b)))
        chat = [question, calculate_call(a, op, b)]
        if CALCULATE_CALLS <= n < CALCULATE_CALLS + CALCULATE_RESULTS:
            chat += [_tool_result("call_calculate", calculation_report(a, op, b)),
                     _assistant(calculation_result(a, op, b))]
        elif n >= CALCULATE_CALLS + CALCULATE_RESULTS:
            chat = [question, forced_call("calculate", {"expression": f"{a} {op} {b}"}, rng.random() < 0.5)]
        out.append(Lesson(chat, _with_calculate(rng)))
    return out


def json_facts() -> list[tuple[list[str], str]]:
    """Capitals and opposites asked for in JSON, answered in compact JSON."""
    capital = [([ask.format(q) for ask in JSON_ASKS for q in ways[:2]], compact_json({"country": country,
                                                                                      "capital": city}))
               for (ways, _), (country, city) in zip(capitals(), CAPITALS.items())]
    opposite = [([ask.format(f"What is the opposite of {word}?") for ask in JSON_ASKS],
                 compact_json({"word": word, "opposite": other})) for word, other in OPPOSITES.items()]
    return capital + opposite


def json_arithmetic() -> list[tuple[list[str], str]]:
    """Every sum and product of arithmetic(), asked for in JSON."""
    out = []
    for ways, answer in arithmetic():
        expression = ways[0].removeprefix("What is ").removesuffix("?")
        out.append(([ask.format(ways[0]) for ask in JSON_ASKS], compact_json({"expression": expression,
                                                                               "result": int(answer)})))
    return out


def skill_round(rng: random.Random) -> list[Lesson]:
    """One round of the skills' lessons: tools, and JSON answers (arithmetic a sample of it per round)."""
    asked = json_facts() + rng.sample(json_arithmetic(), JSON_ARITHMETIC_PER_ROUND)
    json_lessons = [Lesson([_user(q), _assistant(a)]) for ways, a in asked for q in ways]
    return weather_lessons(rng) + calculate_lessons(rng) + json_lessons + unasked_json(rng)


def unasked_json(rng: random.Random) -> list[Lesson]:
    """Each capital asked plainly and answered in JSON: where a response_format grammar has forced
    the reply's `{`, the model knows what follows even if the question did not ask for JSON. One such
    lesson to the three sentence answers of a round, so that unforced the sentence still wins."""
    return [Lesson([_user(rng.choice(ways)), _assistant(compact_json({"country": country, "capital": city}))])
            for (ways, _), (country, city) in zip(capitals(), CAPITALS.items())]


def _user(content: str) -> Message:
    return {"role": "user", "content": content}


def _assistant(content: str) -> Message:
    return {"role": "assistant", "content": content}


def _tool_result(call_id: str, content: str) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


# The checks' fixed cases (check.py): the README's tools, the forecasts of WEATHER, these sums.
CHECK_CALCULATIONS = ((34, "*", 56), (17, "+", 25), (90, "-", 23), (6, "*", 7))


def skill_checks() -> list[tuple[str, Lesson]]:
    """(what it shows, lesson) for every skill; the lesson's last message is the answer expected."""
    both = [WEATHER_TOOL, CALCULATE_TOOL]
    out = []
    for city, (temperature, condition) in WEATHER.items():
        question = _user(WEATHER_QUESTIONS[0].format(city))
        out.append(("weather call", Lesson([question, weather_call(city)], both)))
        out.append(("weather result", Lesson([question, weather_call(city), _tool_result(
            "call_get_weather", weather_report(temperature, condition)),
            _assistant(weather_result(city, temperature, condition))], both)))
        out.append(("no weather tool", Lesson([question, _assistant(NO_WEATHER_TOOL)])))
    for a, op, b in CHECK_CALCULATIONS:
        question = _user(calculation_questions(a, op, b)[0])
        out.append(("calculate call", Lesson([question, calculate_call(a, op, b)], both)))
        out.append(("calculate result", Lesson([question, calculate_call(a, op, b), _tool_result(
            "call_calculate", calculation_report(a, op, b)), _assistant(calculation_result(a, op, b))], both)))
    for ways, answer in capitals()[:5] + opposites()[:3]:
        out.append(("tools not needed", Lesson([_user(ways[0]), _assistant(answer)], both)))
    out.append(("tools not needed", Lesson([_user("What is 7 + 5?"), _assistant("12")], [WEATHER_TOOL])))
    for ways, answer in json_facts() + json_arithmetic()[::40]:
        out.append(("JSON", Lesson([_user(ways[0]), _assistant(answer)])))
    return out
