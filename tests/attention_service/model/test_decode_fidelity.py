"""The decode path held to the fixtures' bfloat16 rule: one token a step, as a server decodes.

test_fixtures holds the prompt path (a whole prompt in one step) to llama.cpp's logits. A server computes
every generated token on the decode path instead: the native attention front, int8 GEMVs, the decode
attention kernel reading the cache that earlier steps wrote. Here each prompt is fed one token a step
(teacher-forced: the prompt's own next id), the logits of every step kept, and the positions moved as a
flipped routing choice moves them (per-position rel-L2 above FLIPPED against the exact-dequant reference)
counted against llama.cpp's on the same file. llama.cpp's decode computes what its prompt computes:
tests/data/decode_mode (its probe, one llama_decode per token) found its logits bit-identical to its
whole-prompt run on every fixture but olmoe q8_0's second prompt (max-abs 0.009) and the MLA families, so the
fixtures' llamacpp_<quant> logits are its decode too.
"""
import json

import numpy as np
import pytest
import torch

from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from tests.attention_service.model.test_fixtures import (
    ARCHS,
    FLIPPED,
    PER_POSITION_ARCHS,
    QUANTS,
    exact_reference,
    per_position_rel_l2,
    prompts,
    references,
)
from tests.support.cpu_paths import PATHS, forced_path


def decode_rel_l2(fixtures_dir, arch, quant):
    """Per-position rel-L2 of the bfloat16 decode path over both prompts, against the exact reference."""
    model = fixtures_dir / arch / f"{arch}-{quant}.gguf"
    runner = ModelRunner.from_gguf(model, RunnerOptions(dtype=torch.bfloat16, device=torch.device("cpu"),
                                                        kv_cache_tokens=256))
    out = []
    for i, (p, ref) in enumerate(zip(prompts(fixtures_dir), references(model.parent, exact_reference(arch, quant)))):
        seq = Sequence(i + 1, list(p["ids"]))
        rows = [runner.step([seq], num_new_tokens=[1]).float()[-1] for _ in p["ids"]]
        out.append(per_position_rel_l2(torch.stack(rows).numpy(), ref))
    return np.concatenate(out)


def llamacpp_rel_l2(fixtures_dir, arch, quant):
    model = fixtures_dir / arch / f"{arch}-{quant}.gguf"
    return np.concatenate([per_position_rel_l2(np.load(model.parent / "ref" / f"llamacpp_{quant}_p{i}.npy"), ref)
                           for i, ref in enumerate(references(model.parent, exact_reference(arch, quant)))])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", PER_POSITION_ARCHS)
def test_bfloat16_decode_moves_no_more_positions_than_llamacpp(fixtures_dir, arch, quant, path):
    """Per file, as test_fixtures holds the prompt path for these families. With the attention projections'
    activations in one int8 term, llama4 q8_0 moved 3 positions here (llama.cpp 0) and dbrx q4_k_m 1 (0)."""
    with forced_path(path):
        ours = decode_rel_l2(fixtures_dir, arch, quant)
    llamacpp = llamacpp_rel_l2(fixtures_dir, arch, quant)
    assert np.median(ours) <= np.median(llamacpp)
    assert (ours > FLIPPED).sum() <= (llamacpp > FLIPPED).sum(), \
        f"moved positions {np.flatnonzero(ours > FLIPPED).tolist()} (rel-L2 {np.round(ours[ours > FLIPPED], 2).tolist()})"


def test_bfloat16_decode_over_every_family_moves_fewer_positions_than_llamacpp(fixtures_dir):
    """All eight families and both quantizations at once, on this CPU's path: the sum of moved positions,
    and each file's median rel-L2 at or under llama.cpp's (its activations are int8 in every mode; ours are
    int8 in the GEMVs, in two terms in the attention projections)."""
    ours_moved = theirs_moved = 0
    medians = {}
    for arch in ARCHS:
        for quant in QUANTS:
            ours, theirs = decode_rel_l2(fixtures_dir, arch, quant), llamacpp_rel_l2(fixtures_dir, arch, quant)
            ours_moved += int((ours > FLIPPED).sum())
            theirs_moved += int((theirs > FLIPPED).sum())
            medians[f"{arch}-{quant}"] = (round(float(np.median(ours)), 4), round(float(np.median(theirs)), 4))
    assert all(o <= t for o, t in medians.values()), json.dumps(medians)
    assert ours_moved < theirs_moved, (ours_moved, theirs_moved)
