"""modelfile.tokenizer against independent references.

* gpt2 / qwen2: the fixtures' GGUFs (made by llama.cpp's converter) vs the HF tokenizer.json they
  were converted from, and the prompt ids llama.cpp itself produced.
* gpt2 / llama3 regex: a byte-level BPE trained here with `tokenizers`, written out as GGUF keys.
* llama (SentencePiece): a model trained here with `sentencepiece`, written out as GGUF keys the
  way llama.cpp's converter does, vs sentencepiece's own encoder.
"""

from __future__ import annotations

import io
import json
import logging
import random
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from splitmoe.modelfile.chat_template import ChatTemplate  # noqa: E402
from splitmoe.modelfile.tokenizer import Tokenizer, TokenizerMetadataError  # noqa: E402

FIXTURES = ROOT.parent / "shared" / "fixtures"
ARCHS = ["qwen3moe", "qwen2moe", "mixtral", "olmoe", "deepseek2", "deepseek3", "gptoss"]
needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"../shared/fixtures not found: {FIXTURES}")

# Text that stresses the pre-tokenizer: contractions, digits, whitespace runs, unicode.
CASES = [
    "Hello, world! How's it going? I'm fine; you'll see, we'd've DONE it.",
    "IT'S LOUD. She'LL go. 'quoted' \"double\"",
    "The year 2024 had 365 days, 12 months and 1234567890 seconds (roughly).",
    "3.14159 + 2.71828 = 5.85987; 1e-6, -42, 0x1F, 1,000,000",
    "def f(x):\n\treturn x  *  2\n\n\n    # indented comment\t\ttabs\n",
    "    leading spaces and trailing spaces    ",
    "line one\r\nline two\rline three\n\n\n",
    "a  b   c    d\t\te\n \n \t \n",
    "Caf\u00e9 na\u00efve fa\u00e7ade r\u00e9sum\u00e9 \u00fcber stra\u00dfe",
    "Cafe\u0301 nai\u0308ve re\u0301sume\u0301 (decomposed: NFC composes these)",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u4e2d\u6587\u6587\u672c\uff0c\ud55c\uad6d\uc5b4 \u0442\u0435\u043a\u0441\u0442 \u0627\u0644\u0639\u0631\u0628\u064a\u0629",
    "emoji \U0001f600\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 flags \U0001f1ef\U0001f1f5",
    "em\u2014dash en\u2013dash \u2026 \u00ab guillemets \u00bb \u201ccurly\u201d \u2018quotes\u2019",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // C++",
    "x=1;y=22;z=333;w=4444;v=55555",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|><|im_start|>",
    "<|im_start|> spaced <|im_end|>",
    "",
    " ",
    "\n",
    "\u00a0non-breaking\u00a0space and \u3000 ideographic space",
    "zero\u200bwidth and \ufeffBOM and control \x00\x01\x7f chars",
]


def nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


# --- gpt2 / qwen2: the fixtures ---------------------------------------------------------------


@pytest.fixture(scope="module")
def fixture_meta():
    if not FIXTURES.is_dir():
        pytest.skip(f"../shared/fixtures not found: {FIXTURES}")
    from splitmoe.modelfile.gguf_file import GGUFFile

    return {arch: GGUFFile(FIXTURES / arch / f"{arch}-q8_0.gguf").metadata for arch in ARCHS}


@pytest.fixture(scope="module")
def qwen(fixture_meta):
    return Tokenizer.from_gguf_metadata(fixture_meta["qwen3moe"])


@pytest.fixture(scope="module")
def hf_ref():
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(FIXTURES / "qwen3moe" / "hf" / "tokenizer.json"))


@needs_fixtures
@pytest.mark.parametrize("arch", ARCHS)
def test_fixture_prompts_give_llamacpp_ids(fixture_meta, arch):
    tok = Tokenizer.from_gguf_metadata(fixture_meta[arch])
    prompts = json.loads((FIXTURES / "prompts.json").read_text())["prompts"]
    for prompt in prompts:
        ids = tok.encode(prompt["text"])
        assert ids == prompt["ids"]
        assert len(ids) == prompt["n_tokens"]
        assert tok.decode(ids) == prompt["text"]


@needs_fixtures
def test_fixture_vocab_and_special_ids(qwen):
    assert qwen.vocab_size == 2048
    assert (qwen.bos_id, qwen.eos_id, qwen.add_bos, qwen.add_eos) == (None, 2045, False, False)
    assert qwen.stop_ids == {2045, 2047}  # eos = <|endoftext|>, plus ChatML's <|im_end|>
    assert [qwen.token_text(i) for i in (2045, 2046, 2047)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert qwen.token_text(220) == "\u0120"  # byte-level spelling of " "


@needs_fixtures
@pytest.mark.parametrize("text", CASES)
def test_fixture_matches_hf_tokenizer_json(qwen, hf_ref, text):
    ids = qwen.encode(text)
    assert ids == hf_ref.encode(text, add_special_tokens=False).ids
    assert qwen.decode(ids) == nfc(text) == hf_ref.decode(ids, skip_special_tokens=False)


@needs_fixtures
def test_fixture_random_text_matches_hf(qwen, hf_ref):
    # A seeded stream of characters from many scripts, plus the tokenizer's own pieces glued together.
    rng = random.Random(1234)
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
        " \t\n\r   '\".,;:!?-_()[]{}<>/\\|@#$%^&*+=~`",
        "\u00e9\u00e8\u00fc\u00df\u00f1\u0301\u0308\u0327\u4e00\u4e8c\u4e09\u3042\u30a2\uac00\u0416\u03a9\u05d0\u0905",
        "\U0001f600\U0001f680\u2014\u2026\u00a0\u200b\u3000\U00010348",
    ]
    pieces = [qwen.decode([i]) for i in range(2045)]
    for _ in range(300):
        parts = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.3:
                parts.append(rng.choice(pieces))
            else:
                parts.append("".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 8))))
        text = "".join(parts)
        text = text.encode("utf-8", "replace").decode("utf-8", "replace")  # drop lone surrogates, if any
        ids = qwen.encode(text)
        assert ids == hf_ref.encode(text, add_special_tokens=False).ids, repr(text)
        assert qwen.decode(ids) == nfc(text), repr(text)


@needs_fixtures
def test_fixture_special_tokens_are_single_tokens(qwen):
    ids = qwen.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 2046 and ids[-1] == 2047
    assert ids.count(2046) == 1 and ids.count(2047) == 1
    assert qwen.decode(ids, skip_special_tokens=True) == "user\nhi"
    # A partial marker is ordinary text.
    assert 2046 not in qwen.encode("<|im_start")


@needs_fixtures
def test_fixture_every_known_pre_tokenizer_builds_and_round_trips(fixture_meta):
    from splitmoe.modelfile import tokenizer as module

    text = "Hello WORLD, it's 2024-06-01!\n\tdef f(x):  return x**2  # \u00e9\u00e8 \u65e5\u672c\u8a9e \U0001f600 \u2014 done  "
    for name, pre in module._PRE_TOKENIZERS.items():
        tok = Tokenizer.from_gguf_metadata({**fixture_meta["qwen3moe"], "tokenizer.ggml.pre": name})
        expected = nfc(text) if pre.nfc else text
        assert tok.decode(tok.encode(text)) == expected, name


@needs_fixtures
def test_fixture_unknown_pre_falls_back_with_warning(fixture_meta, caplog):
    with caplog.at_level(logging.WARNING, logger="splitmoe.modelfile.tokenizer"):
        tok = Tokenizer.from_gguf_metadata({**fixture_meta["qwen3moe"], "tokenizer.ggml.pre": "no-such-pre"})
    assert "no-such-pre" in caplog.text
    assert tok.decode(tok.encode("fine, it's OK 123")) == "fine, it's OK 123"


# --- gpt2 / llama3 regex: a byte-level BPE trained here ---------------------------------------

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<\uff5cend\u2581of\u2581sentence\uff5c>"]


def corpus(seed: int, n_lines: int) -> list[str]:
    rng = random.Random(seed)
    words = (
        "the of and to in is was for on that with as by at from his her this which an are be or had it not but "
        "were they have one all their been has more two there when who its also into other after only first new "
        "some time would these than can may years most such over up I'm don't we'll it's caf\u00e9 na\u00efve "
        "\u65e5\u672c \u8a9e def return import class self print"
    ).split()
    lines = []
    for _ in range(n_lines):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(3, 14)))
        if rng.random() < 0.3:
            line = line.capitalize() + rng.choice([".", "!", "?", ":", ","])
        if rng.random() < 0.3:
            line += f" {rng.randint(0, 10**rng.randint(1, 7))}"
        if rng.random() < 0.2:
            line = "    " + line.replace(" ", rng.choice([" ", "  ", "\t"]))
        lines.append(line)
    return lines


@pytest.fixture(scope="module")
def llama3_pair():
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    ref = HFTokenizer(models.BPE())
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    ref.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=LLAMA3_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    ref.train_from_iterator(corpus(7, 2000), trainer)
    # Llama 3's tokenizer.json takes a pre-token whole when it is in the vocabulary.
    spec = json.loads(ref.to_str())
    spec["model"]["ignore_merges"] = True
    # A vocabulary word no merge sequence builds: only ignore_merges produces it whole.
    spec["model"]["vocab"]["\u0120quizzical"] = len(spec["model"]["vocab"])
    ref = HFTokenizer.from_str(json.dumps(spec))
    ref.add_tokens([AddedToken("<think>", special=False, normalized=False)])

    vocab = ref.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in LLAMA3_SPECIALS else 4 if t == "<think>" else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": vocab["<|begin_of_text|>"],
        "tokenizer.ggml.eos_token_id": vocab["<|end_of_text|>"],
        "tokenizer.ggml.eot_token_id": vocab["<|eot_id|>"],
        # no add_bos_token key: llama.cpp adds BOS for llama3-style vocabularies by default
    }
    return Tokenizer.from_gguf_metadata(meta), ref, meta


LLAMA3_EXTRA = [
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "answer: <think>hmm</think> 42<\uff5cend\u2581of\u2581sentence\uff5c>",
    "long numbers 1234567 12 123456789012 and I'M SURE it's FINE'S",
    "a quizzical look",
]


@pytest.mark.parametrize("text", CASES + LLAMA3_EXTRA + corpus(99, 40))
def test_llama3_regex_matches_trained_bpe(llama3_pair, text):
    tok, ref, meta = llama3_pair
    expected = ref.encode(text, add_special_tokens=False).ids
    if expected[:1] != [tok.bos_id]:
        expected = [tok.bos_id, *expected]
    assert tok.encode(text) == expected
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False).ids
    for skip in (False, True):
        assert tok.decode(expected, skip_special_tokens=skip) == ref.decode(expected, skip_special_tokens=skip)


def test_llama3_flags_specials_and_no_double_bos(llama3_pair):
    tok, _, meta = llama3_pair
    bos = tok.bos_id
    assert tok.add_bos and not tok.add_eos
    assert tok.stop_ids == {meta["tokenizer.ggml.eos_token_id"], meta["tokenizer.ggml.eot_token_id"]}
    assert tok.encode("<|begin_of_text|>hi").count(bos) == 1
    assert tok.encode("hi")[0] == bos
    assert [tok.token_text(i) for i in tok.encode("a quizzical", add_special_tokens=False)] == ["a", "\u0120quizzical"]
    assert tok.encode("hi", add_special_tokens=False)[0] != bos
    think = tok.encode("a<think>b", add_special_tokens=False)
    assert len(think) == 3 and tok.token_text(think[1]) == "<think>"
    # user-defined tokens are text, not control: skip_special_tokens keeps them
    assert tok.decode(tok.encode("a<think>b"), skip_special_tokens=True) == "a<think>b"
    raw = tok.encode("x<\uff5cend\u2581of\u2581sentence\uff5c>", add_special_tokens=False)
    assert tok.decode(raw) == "x<\uff5cend\u2581of\u2581sentence\uff5c>"
    assert tok.decode(raw, skip_special_tokens=True) == "x"


def test_llama3_add_eos_and_explicit_add_bos_false(llama3_pair):
    _, _, meta = llama3_pair
    tok = Tokenizer.from_gguf_metadata(
        {**meta, "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True}
    )
    ids = tok.encode("hello")
    assert ids[0] != tok.bos_id and ids[-1] == tok.eos_id
    assert tok.encode("hello<|end_of_text|>").count(tok.eos_id) == 1


# --- llama: SentencePiece trained here -------------------------------------------------------


def spm_meta(sp, **extra) -> dict:
    """GGUF keys the way llama.cpp's converter (`_create_vocab_sentencepiece`) writes them."""
    n = sp.get_piece_size()

    def kind(i):
        for test, code in ((sp.is_unknown, 2), (sp.is_control, 3), (sp.is_unused, 5), (sp.is_byte, 6)):
            if test(i):
                return code
        return 1

    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": [kind(i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        **extra,
    }


def train_spm(dummy_prefix: bool):
    import sentencepiece as spm

    model = io.BytesIO()
    lines = corpus(3, 3000)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=500, model_type="bpe", byte_fallback=True,
        # Llama's own settings: no normalization, keep whitespace as written.
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=dummy_prefix,
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


@pytest.fixture(scope="module")
def spm_pair():
    sp = train_spm(dummy_prefix=True)
    return Tokenizer.from_gguf_metadata(spm_meta(sp)), sp


SPM_CASES = [
    c for c in CASES + corpus(5, 60) + [" leading", "  two leading", "trailing  ", "x", "Zebra QUIZ jukebox"]
    if "<|" not in c
]


@pytest.mark.parametrize("text", SPM_CASES)
def test_spm_matches_sentencepiece(spm_pair, text):
    tok, sp = spm_pair
    ids = tok.encode(text)
    assert ids == [1, *sp.encode(text)]
    assert tok.decode(ids, skip_special_tokens=True) == text == sp.decode(ids[1:])


def test_spm_byte_fallback_for_unseen_characters(spm_pair):
    tok, sp = spm_pair
    ids = tok.encode("\u263a\U0001f600", add_special_tokens=False)
    pieces = [tok.token_text(i) for i in ids]
    assert pieces == [sp.id_to_piece(i) for i in sp.encode("\u263a\U0001f600")]
    assert "<0xE2>" in pieces and "<0xF0>" in pieces  # UTF-8 lead bytes of the two characters
    assert tok.decode(ids) == "\u263a\U0001f600"


def test_spm_special_tokens_in_text_and_no_double_bos(spm_pair):
    tok, _ = spm_pair
    ids = tok.encode("<s>hello</s>")
    assert ids[0] == 1 and ids.count(1) == 1 and ids[-1] == 2
    # As llama.cpp does, the text after a special token gets the dummy-prefix space again.
    assert tok.token_text(ids[1]).startswith("\u2581")
    assert tok.decode(ids, skip_special_tokens=True) == "hello"
    assert tok.decode(ids) == "<s> hello</s>"


def test_spm_chat_template_bos_is_not_doubled(spm_pair):
    tok, sp = spm_pair
    meta = spm_meta(sp, **{"tokenizer.chat_template": "{{ bos_token }}[INST] {{ messages[0]['content'] }} [/INST]"})
    prompt = ChatTemplate.from_gguf_metadata(meta, tok).render([{"role": "user", "content": "the time"}])
    assert prompt == "<s>[INST] the time [/INST]"
    ids = tok.encode(prompt)
    assert ids[0] == 1 and ids.count(1) == 1


def test_spm_without_dummy_prefix():
    sp = train_spm(dummy_prefix=False)
    tok = Tokenizer.from_gguf_metadata(spm_meta(sp, **{"tokenizer.ggml.add_space_prefix": False}))
    for text in SPM_CASES[:40]:
        ids = tok.encode(text)
        assert ids == [1, *sp.encode(text)], repr(text)
        assert tok.decode(ids, skip_special_tokens=True) == text


# --- errors ----------------------------------------------------------------------------------


def one_line_error(meta) -> str:
    with pytest.raises(TokenizerMetadataError) as info:
        Tokenizer.from_gguf_metadata(meta)
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, ValueError)
    return message


def test_missing_tokens_is_one_clear_line():
    assert "tokenizer.ggml.tokens" in one_line_error({"tokenizer.ggml.model": "gpt2"})


def test_unknown_model_is_one_clear_line():
    message = one_line_error({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a", "b"]})
    assert "tokenizer.ggml.model" in message and "'rwkv'" in message


def test_missing_model_and_merges_are_named():
    assert "tokenizer.ggml.model" in one_line_error({"tokenizer.ggml.tokens": ["a"]})
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.pre": "qwen2"}
    assert "tokenizer.ggml.merges" in one_line_error(meta)


TOKEN_BYTES_TEXT = "naïve café — 水 and emoji 🙂 end"


def test_token_bytes_spell_the_text_byte_for_byte(llama3_pair, spm_pair):
    for tok in (llama3_pair[0], spm_pair[0]):
        ids = tok.encode(TOKEN_BYTES_TEXT, add_special_tokens=False)
        joined = b"".join(tok.token_bytes(i) for i in ids)
        assert joined.decode().strip() == TOKEN_BYTES_TEXT  # SentencePiece adds its dummy-prefix space
    byte_tokens = [i for i in llama3_pair[0].encode("水", add_special_tokens=False)]
    assert len(byte_tokens) > 1 and any(len(llama3_pair[0].token_bytes(i)) == 1 for i in byte_tokens)
