"""attention_service/engine/reasoning.py: reasoning split from content, token by token, and its plumbing
through the request, the engine, the settings and a real `serve-attention` process."""
import queue
from types import SimpleNamespace

import pytest
import torch

from splitmoe.attention_service.engine.engine import Engine
from splitmoe.attention_service.engine.reasoning import HARMONY_MARKERS, TextDelta, detect_reasoning_format, output_text
from splitmoe.attention_service.engine.request import GenerationRequest
from splitmoe.attention_service.engine.sampling import RequestSampler, Sampled, SamplingOptions
from splitmoe.attention_service.engine.scheduler import Scheduler
from splitmoe.attention_service.model.block_manager import BlockManager
from splitmoe.attention_service.model.runner import RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.attention_service.service import load_serving_model
from splitmoe.attention_service.settings import AttentionSettings
from splitmoe.cli import build_parser
from splitmoe.demo_model import MERGES, SPECIAL_TOKENS, byte_level_vocab
from splitmoe.modelfile.tokenizer import CONTROL, NORMAL, USER_DEFINED, Tokenizer
from splitmoe.proto import attention_pb2 as pb
from splitmoe.proto import attention_pb2_grpc
from tests.support.harmony_model import write_harmony_demo_model
from tests.support.processes import cluster_channel, free_port, grpc_service

THINK_TAGS = ("<think>", "</think>")
HARMONY_PROMPT = "<|start|>user<|message|>Say hi.<|end|><|start|>assistant"
HARMONY_REPLY = ("<|channel|>analysis<|message|>The user wants a greeting. Keep it short: café ☕.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>")
HARMONY_REASONING = "The user wants a greeting. Keep it short: café ☕."
HARMONY_CONTENT = "Hello! How can I help?"
THINK_REPLY = "<think>\nThey ask 2+2. That is <b>4</b>.\n</think>\n\nIt is 4."


# --- vocabularies ------------------------------------------------------------------------------

def make_tokenizer(control=(), user_defined=()) -> Tokenizer:
    """The demo model's byte-level vocabulary (token b is byte b) plus the given added tokens."""
    tokens = byte_level_vocab() + [a + b for a, b in MERGES] + list(SPECIAL_TOKENS) + list(control) + list(user_defined)
    types = ([NORMAL] * (256 + len(MERGES)) + [CONTROL] * (len(SPECIAL_TOKENS) + len(control))
             + [USER_DEFINED] * len(user_defined))
    return Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": [f"{a} {b}" for a, b in MERGES],
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"), "tokenizer.ggml.add_bos_token": False})


@pytest.fixture(scope="module")
def harmony():
    return make_tokenizer(control=HARMONY_MARKERS)


@pytest.fixture(scope="module")
def think():
    return make_tokenizer(user_defined=THINK_TAGS)  # as convert_hf_to_gguf marks Qwen3's tags


def in_bytes(text: str) -> list[int]:
    """One token per byte: every tag arrives in pieces, every non-ASCII character split."""
    return list(text.encode())


def stream(tokenizer, ids, prompt="", stop=(), inline=False) -> list[TextDelta]:
    out = output_text(tokenizer, stop, detect_reasoning_format(tokenizer), tokenizer.encode(prompt) if prompt else [7],
                      parse=True, inline=inline)
    return [out.add(i) for i in ids] + [out.flush()]


def joined(deltas) -> TextDelta:
    return sum(deltas, TextDelta())


# --- choosing the format -----------------------------------------------------------------------

def test_the_format_comes_from_the_vocabulary(harmony, think):
    assert detect_reasoning_format(harmony).name == "harmony"
    assert detect_reasoning_format(think).name == "think"
    assert detect_reasoning_format(make_tokenizer(user_defined=("<think>",))) is None
    assert detect_reasoning_format(make_tokenizer()) is None


def test_raw_completions_and_formatless_models_are_not_parsed(harmony):
    ids = harmony.encode(HARMONY_REPLY)
    out = output_text(harmony, (), detect_reasoning_format(harmony), harmony.encode(HARMONY_PROMPT),
                      parse=False, inline=False)
    total = joined([out.add(i) for i in ids] + [out.flush()])
    assert total == TextDelta("", harmony.decode(ids, skip_special_tokens=True))


# --- harmony -----------------------------------------------------------------------------------

@pytest.mark.parametrize("spell", ["tokens", "bytes"])
def test_harmony_analysis_is_reasoning_and_final_is_content(harmony, spell):
    # The markers are always whole tokens; the text between them comes whole or byte by byte.
    ids = harmony.encode(HARMONY_REPLY) if spell == "tokens" else _harmony_bytes(harmony, HARMONY_REPLY)
    deltas = stream(harmony, ids, HARMONY_PROMPT)
    assert joined(deltas) == TextDelta(HARMONY_REASONING, HARMONY_CONTENT)
    assert all("\ufffd" not in d.reasoning + d.content for d in deltas)  # split characters never leak
    assert deltas[-1] == TextDelta()  # everything streamed as it came: nothing waited for the end


def _harmony_bytes(tokenizer, text):
    """Markers as their tokens, everything else one byte per token."""
    ids = []
    for piece in tokenizer.encode(text):
        ids += [piece] if tokenizer.token_text(piece) in HARMONY_MARKERS else list(tokenizer.token_bytes(piece))
    return ids


def test_harmony_reasoning_streams_before_the_answer(harmony):
    ids = harmony.encode(HARMONY_REPLY)
    deltas = stream(harmony, ids, HARMONY_PROMPT)
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert joined(deltas[:first_content]).reasoning == HARMONY_REASONING


def test_harmony_without_reasoning(harmony):
    ids = harmony.encode("<|channel|>final<|message|>Hi there.<|return|>")
    assert joined(stream(harmony, ids, HARMONY_PROMPT)) == TextDelta("", "Hi there.")


def test_harmony_commentary_is_content_for_now(harmony):
    reply = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.weather"
             "<|channel|>commentary <|constrain|>json<|message|>{\"city\": \"Oslo\"}<|call|>")
    assert joined(stream(harmony, harmony.encode(reply), HARMONY_PROMPT)) == TextDelta(
        "Need the weather.", '{"city": "Oslo"}')


def test_harmony_unterminated_analysis_is_all_reasoning(harmony):
    ids = harmony.encode(HARMONY_REPLY)[:30]  # cut by max_tokens inside the analysis message
    total = joined(stream(harmony, ids, HARMONY_PROMPT))
    assert total.content == "" and HARMONY_REASONING.startswith(total.reasoning) and total.reasoning


def test_harmony_prompt_that_opens_a_channel(harmony):
    prompt = HARMONY_PROMPT + "<|channel|>final<|message|>"
    assert joined(stream(harmony, harmony.encode("Hi.<|return|>"), prompt)) == TextDelta("", "Hi.")
    prompt = HARMONY_PROMPT + "<|channel|>analysis<|message|>"
    assert joined(stream(harmony, harmony.encode("Hmm.<|end|>"), prompt)) == TextDelta("Hmm.", "")


def test_harmony_inline_writes_the_markers_out(harmony):
    total = joined(stream(harmony, harmony.encode(HARMONY_REPLY), HARMONY_PROMPT, inline=True))
    assert total == TextDelta("", HARMONY_REPLY.removesuffix("<|return|>"))


# --- think tags --------------------------------------------------------------------------------

@pytest.mark.parametrize("tags", ["user-defined", "control"])
@pytest.mark.parametrize("spell", ["tokens", "bytes"])
def test_think_tags_split_reasoning_from_content(tags, spell):
    # Converters mark Qwen3's tags user-defined (decoded as text); a control tag is skipped by decode.
    tokenizer = make_tokenizer(**{"user_defined" if tags == "user-defined" else "control": THINK_TAGS})
    ids = tokenizer.encode(THINK_REPLY) if spell == "tokens" else in_bytes(THINK_REPLY)
    deltas = stream(tokenizer, ids)
    assert joined(deltas) == TextDelta("They ask 2+2. That is <b>4</b>.", "It is 4.")
    assert all("think" not in d.reasoning + d.content for d in deltas)  # no tag, whole or in part
    assert deltas[-1] == TextDelta()


def test_think_reasoning_streams_while_the_tag_is_incomplete(think):
    ids = in_bytes(THINK_REPLY)
    cut = THINK_REPLY.encode().index(b"</think>") + 3  # fed up to "</t"
    assert joined(stream(think, ids[:cut])[:-1]).reasoning == "They ask 2+2. That is <b>4</b>."


def test_a_prompt_that_opens_think_makes_a_lone_close_tag_end_reasoning(think):
    # Qwen3-Thinking, DeepSeek-R1-0528 and QwQ templates end the generation prompt with <think>.
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ids = in_bytes("Greet back.\n</think>\n\nHi!")
    assert joined(stream(think, ids, prompt)) == TextDelta("Greet back.", "Hi!")


def test_think_without_reasoning_streams_content_at_once(think):
    deltas = stream(think, in_bytes("Hello </think> world"))  # a close tag with none open is text
    assert joined(deltas) == TextDelta("", "Hello </think> world")
    assert deltas[0] == TextDelta("", "H")


def test_a_prompt_that_closes_think_means_no_reasoning(think):
    prompt = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3 with enable_thinking=False
    assert joined(stream(think, in_bytes("Hi."), prompt)) == TextDelta("", "Hi.")


def test_unterminated_think_is_all_reasoning(think):
    total = joined(stream(think, in_bytes("<think>\nStill thinking about </thi")))
    assert total == TextDelta("Still thinking about </thi", "")


def test_think_inline_keeps_the_tags(think):
    assert joined(stream(think, think.encode(THINK_REPLY), inline=True)) == TextDelta("", THINK_REPLY)


# --- stop strings, through GenerationRequest.accept ---------------------------------------------

def run_request(tokenizer, prompt, reply_ids, stop=(), max_tokens=200, inline=False):
    prompt_ids = tokenizer.encode(prompt)
    request = GenerationRequest(
        request_id="r", seq=Sequence(0, list(prompt_ids)), options=SamplingOptions(max_tokens=max_tokens, stop=stop),
        sampler=None, sink=None, stop_ids=tokenizer.stop_ids, max_context_tokens=4096,
        detokenizer=output_text(tokenizer, stop, detect_reasoning_format(tokenizer), prompt_ids, parse=True,
                                inline=inline))
    outputs = []
    for token_id in reply_ids:
        outputs.append(request.accept(Sampled(token_id, 0.0, ())))
        if outputs[-1].finished:
            break
    return "".join(o.reasoning_text for o in outputs), "".join(o.text for o in outputs), outputs[-1].finish_reason


def test_generation_ends_on_the_harmony_return_token(harmony):
    assert run_request(harmony, HARMONY_PROMPT, harmony.encode(HARMONY_REPLY + "junk")) == (
        HARMONY_REASONING, HARMONY_CONTENT, "stop")


def test_a_stop_string_in_the_reasoning_does_not_stop(harmony, think):
    assert run_request(harmony, HARMONY_PROMPT, harmony.encode(HARMONY_REPLY), stop=("greeting",)) == (
        HARMONY_REASONING, HARMONY_CONTENT, "stop")  # stopped by <|return|>, not by the string
    ids = in_bytes(THINK_REPLY)
    assert run_request(think, "", ids, stop=("2+2",), max_tokens=len(ids)) == (
        "They ask 2+2. That is <b>4</b>.", "It is 4.", "length")


def test_a_stop_string_in_the_content_stops_and_is_cut(harmony, think):
    assert run_request(harmony, HARMONY_PROMPT, harmony.encode(HARMONY_REPLY), stop=("How",)) == (
        HARMONY_REASONING, "Hello! ", "stop")
    assert run_request(think, "", in_bytes(THINK_REPLY), stop=(" 4",)) == (
        "They ask 2+2. That is <b>4</b>.", "It is", "stop")


def test_max_tokens_inside_reasoning_returns_the_reasoning_so_far(think):
    reasoning, content, finish = run_request(think, "", in_bytes(THINK_REPLY), max_tokens=22)
    assert (reasoning, content, finish) == ("They ask 2+2.", "", "length")  # 22 bytes: "<think>\nThey ask 2+2. "



# --- the engine, with a scripted model ---------------------------------------------------------

class ScriptedRunner:
    """Stands in for the model runner: the next token of each sequence comes from a script."""

    def __init__(self, script: list[int], vocab_size: int):
        self.script, self.vocab_size = script, vocab_size
        self.cfg = SimpleNamespace(vocab_size=vocab_size)  # the engine sizes its token masks by it
        self.emitted: dict[int, int] = {}

    def step(self, seqs, num_new_tokens):
        rows = []
        for seq, n in zip(seqs, num_new_tokens):
            seq.num_cached_tokens += n
            i = self.emitted.get(seq.seq_id, 0)
            self.emitted[seq.seq_id] = i + 1
            rows.append(torch.nn.functional.one_hot(torch.tensor(self.script[i]), self.vocab_size).float() * 10)
        return torch.stack(rows)


def test_the_engine_streams_reasoning_and_content_apart(harmony):
    script, prompt_ids = harmony.encode(HARMONY_REPLY), harmony.encode(HARMONY_PROMPT)
    engine = Engine(ScriptedRunner(script, harmony.vocab_size), Scheduler(BlockManager(64, 16), 64, 4, 4),
                    lambda e: "internal")
    outputs: queue.Queue = queue.Queue()
    options = SamplingOptions(max_tokens=200, temperature=0.0)
    engine.submit(GenerationRequest(
        request_id="r", seq=Sequence(0, list(prompt_ids)), options=options,
        sampler=RequestSampler(options, harmony.vocab_size), sink=outputs.put, stop_ids=harmony.stop_ids,
        max_context_tokens=4096, detokenizer=output_text(harmony, (), detect_reasoning_format(harmony), prompt_ids,
                                                         parse=True, inline=False)))
    engine.start()
    try:
        got = [outputs.get(timeout=10)]
        while not got[-1].finished:
            got.append(outputs.get(timeout=10))
    finally:
        engine.stop()
    assert "".join(o.reasoning_text for o in got) == HARMONY_REASONING
    assert "".join(o.text for o in got) == HARMONY_CONTENT
    assert got[-1].finish_reason == "stop" and got[-1].num_output_tokens == len(script)


# --- settings and the service ------------------------------------------------------------------

def test_the_switch_is_parsed_at_the_edge():
    args = build_parser().parse_args(["serve-attention", "m.gguf", "--reasoning-format", "none"])
    assert args.reasoning_format == "none"
    assert build_parser().parse_args(["serve-attention"]).reasoning_format == "auto"
    with pytest.raises(ValueError):
        AttentionSettings(model_path="m.gguf", reasoning_format="deepseek")


@pytest.fixture(scope="module")
def harmony_gguf(tmp_path_factory):
    return write_harmony_demo_model(tmp_path_factory.mktemp("harmony"))


def test_reasoning_format_none_returns_the_reasoning_inline(harmony_gguf, harmony):
    model = load_serving_model(AttentionSettings(model_path=str(harmony_gguf), reasoning_format="none",
                                                 runner=RunnerOptions(device=torch.device("cpu"), kv_cache_tokens=256)))
    assert model.reasoning.name == "harmony"  # found all the same: inline writes the markers out
    request = model.new_request("r", harmony.encode(HARMONY_PROMPT), SamplingOptions(max_tokens=200), None, chat=True)
    text = "".join(request.accept(Sampled(t, 0.0, ())).text for t in harmony.encode(HARMONY_REPLY))
    assert text == HARMONY_REPLY.removesuffix("<|return|>")


@pytest.fixture(scope="module")
def service(harmony_gguf, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("logs") / "attention.log"
    with grpc_service(["serve-attention", str(harmony_gguf), "--port", str(port), "--kv-cache-tokens", "512"],
                      port, log):
        with cluster_channel(f"127.0.0.1:{port}") as channel:
            yield attention_pb2_grpc.AttentionServiceStub(channel)


def chat(stub, **fields):
    request = pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")],
                                                    add_generation_prompt=True),
                                 sampling=pb.SamplingParams(max_tokens=16, temperature=0, logprobs=True), **fields)
    responses = list(stub.Generate(request, timeout=60))
    return ("".join(r.reasoning_text for r in responses), "".join(r.text for r in responses),
            [t.token_id for r in responses for t in r.tokens], responses[-1].finish_reason)


@pytest.mark.stack
def test_a_chat_reply_carries_its_reasoning_apart(service, harmony):
    reasoning, content, ids, finish = chat(service)
    assert reasoning and content == "" and finish == "length"
    assert reasoning == harmony.decode(ids)  # every generated token was in the analysis channel


@pytest.mark.stack
def test_a_request_may_ask_for_the_reasoning_inline(service):
    reasoning, content, ids, _ = chat(service)
    inline_reasoning, inline_content, inline_ids, _ = chat(service, reasoning_inline=True)
    assert inline_ids == ids  # the same greedy tokens, only returned differently
    assert (inline_reasoning, inline_content) == ("", reasoning)


@pytest.mark.stack
def test_raw_text_prompts_are_not_parsed(service):
    request = pb.GenerateRequest(text="<|start|>assistant<|channel|>analysis<|message|>",
                                 sampling=pb.SamplingParams(max_tokens=8, temperature=0))
    responses = list(service.Generate(request, timeout=60))
    assert all(r.reasoning_text == "" for r in responses) and "".join(r.text for r in responses)
