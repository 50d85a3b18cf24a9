"""`--speculative mtp` (engine/mtp.py, model/nextn.py): the file's own NextN block drafts.

Against transformers (float32, eager) on two tiny files made by llama.cpp's converter with a NextN
block (tests/data/mtp/: glm4moe without the block's own embedding and head, deepseek2 / MLA with
them): the hidden states the block reads and its draft logits at every position; the drafter's
bookkeeping (rows handed over step by step, drafts past the first, rejected rows) against the
reference's top tokens; and the output of greedy requests identical with and without MTP drafts,
in float32, bfloat16 and through two expert services over shared memory."""
from pathlib import Path

import numpy as np
import pytest
import torch

from splitmoe.attention_service.engine.mtp import MTPDrafter
from splitmoe.attention_service.engine.speculation import SpeculationSettings
from splitmoe.attention_service.expert_backends.backend import InProcessExperts
from splitmoe.attention_service.model.batch import SeqSlice, StepBatch
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.attention_service.service import load_serving_model
from splitmoe.attention_service.settings import AttentionSettings
from splitmoe.modelfile.gguf_file import GGUFError, GGUFFile
from tests.attention_service.engine.test_speculation import PROMPTS, run, through_two_services

DATA = Path(__file__).parents[2] / "data" / "mtp"
FILES = ["glm4moe-mtp", "deepseek2-mtp"]
REFS = np.load(DATA / "references.npz")
MTP = SpeculationSettings("mtp", num_tokens=3, fixed_length=True)  # every step drafts what it can


def f32_runner(name: str) -> ModelRunner:
    g = GGUFFile(DATA / f"{name}.gguf")
    options = RunnerOptions(dtype=torch.float32, device=torch.device("cpu"), kv_cache_tokens=512, kv_block_tokens=16)
    return ModelRunner.from_gguf(g, options, InProcessExperts(g, nextn=True))


def reference(name: str, prompt: int, key: str) -> torch.Tensor:
    return torch.from_numpy(REFS[f"{name}/p{prompt}/{key}"])


def prompt_ids(prompt: int) -> list[int]:
    return REFS[f"prompts/p{prompt}"].tolist()


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("prompt", [0, 1])
def test_the_blocks_draft_logits_match_transformers(name, prompt):
    runner = f32_runner(name)
    drafter = MTPDrafter(runner)
    seen = []
    runner.hidden_sink = lambda seq, start, hidden: seen.append((start, hidden.clone()))
    ids = prompt_ids(prompt)
    runner.step([Sequence(1, ids)])
    assert [start for start, _ in seen] == [0]
    hidden = seen[0][1]
    assert (hidden - reference(name, prompt, "hidden")).abs().max() < 1e-4
    # every row i: (hidden i, token i+1) -> token i+2, in one pass over the block's own cache
    rows = len(ids) - 1
    batch_seq = Sequence(2, ids[1:])
    drafter.blocks.reserve(batch_seq.seq_id, rows)
    context = drafter.blocks.slots(batch_seq.seq_id, 0, rows)
    batch = StepBatch(token_ids=torch.tensor(ids[1:]), positions=torch.arange(rows), new_slots=context,
                      seqs=(SeqSlice(0, rows, context),), logits_rows=torch.arange(rows))
    _, logits = drafter.block.forward(hidden[:rows], batch.token_ids, batch, drafter.kv)
    expected = reference(name, prompt, "mtp_logits")
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max() < 1e-4, (logits - expected).abs().max()


def clear_top1(logits: torch.Tensor) -> torch.Tensor:
    """Rows whose best token leads the second by more than float32 noise could flip."""
    top2 = logits.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1] > 1e-3


@pytest.mark.parametrize("name", FILES)
def test_the_drafter_fed_step_by_step_drafts_the_references_tokens(name):
    """A prompt decoded token by token as if the model had chosen it (teacher forcing): after
    each step the first draft is the block's top token of the row before the last token; drafting
    3 tokens now and then (rows the next step replaces) leaves the next first draft unharmed; a
    second draft is the block run once more on its own output (checked by recomputing it)."""
    ids = prompt_ids(1)
    top1, clear = reference(name, 1, "mtp_top1"), clear_top1(reference(name, 1, "mtp_logits"))
    runner = f32_runner(name)
    drafter = MTPDrafter(runner)
    seq = Sequence(7, ids[:5])
    runner.step([seq])  # a prompt of 5
    checked = 0
    for n in range(5, len(ids)):
        seq.token_ids.append(ids[n])  # the "sampled" token
        drafts = drafter.propose(seq.seq_id, seq.token_ids, 3 if n % 4 == 0 else 1)
        if clear[n - 1]:
            assert drafts[0] == top1[n - 1], n
            checked += 1
        if n % 4 == 0 and n + 1 < len(ids):  # the next step verifies these drafts: all rejected here
            seq.token_ids.extend(drafts)
            runner.step([seq], logits_tokens=[1 + len(drafts)], commit=False)
            del seq.token_ids[n + 1:]
            seq.num_cached_tokens = n + 1
        else:
            runner.step([seq])
    assert checked >= len(ids) // 2
    drafter.release(seq.seq_id)
    assert not drafter._requests and drafter.blocks.num_free_blocks == drafter.kv.num_blocks


def test_a_second_draft_feeds_the_block_its_own_output():
    runner = f32_runner("deepseek2-mtp")
    drafter = MTPDrafter(runner)
    ids = prompt_ids(0)
    seq = Sequence(3, ids[:-1])
    runner.step([seq])
    seq.token_ids.append(ids[-1])
    d1, d2 = drafter.propose(seq.seq_id, seq.token_ids, 2)
    # recomputed from scratch on a fresh block cache: rows 0..T-2 from the main model, then (g, d1)
    fresh = MTPDrafter(f32_runner("deepseek2-mtp"))
    hidden = reference("deepseek2-mtp", 0, "hidden")
    g, logits = fresh._run(99, 0, hidden[:len(ids) - 1], ids[1:])
    assert int(logits[-1].argmax()) == d1
    _, logits = fresh._run(99, len(ids) - 1, g[-1:], [d1])
    assert int(logits[-1].argmax()) == d2


@pytest.mark.parametrize("name", FILES)
def test_mtp_drafts_change_no_greedy_token_float32(name):
    path = DATA / f"{name}.gguf"
    expected, none = run(path, PROMPTS, SpeculationSettings())
    got, stats = run(path, PROMPTS, MTP)
    assert got == expected and none.num_drafts == 0
    assert stats.num_drafts > 50 and stats.num_draft_tokens > stats.num_drafts


def test_mtp_drafts_change_no_greedy_token_bfloat16():
    path = DATA / "deepseek2-mtp.gguf"
    expected, _ = run(path, PROMPTS, SpeculationSettings(), concurrent=False, dtype=torch.bfloat16)
    got, stats = run(path, PROMPTS, MTP, concurrent=False, dtype=torch.bfloat16)
    assert got == expected and stats.num_drafts > 50


@pytest.mark.stack
def test_mtp_through_two_expert_services_over_shared_memory(tmp_path):
    """The block's MoE layer is one more layer on the services (they host its experts by default)."""
    expected, got, stats = through_two_services(DATA / "glm4moe-mtp.gguf", tmp_path, MTP)
    assert got == expected and stats.num_drafts > 50


def test_a_file_without_a_nextn_block_is_refused_in_one_line(demo_gguf):
    runner = RunnerOptions(dtype=torch.float32, device=torch.device("cpu"), kv_cache_tokens=1024)
    with pytest.raises(GGUFError, match=r"^[^\n]*\.gguf: no NextN/MTP block \(\w+\.nextn_predict_layers is 0 or absent\)"):
        load_serving_model(AttentionSettings(model_path=str(demo_gguf), runner=runner,
                                             speculation=SpeculationSettings("mtp")))
