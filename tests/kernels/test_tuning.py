"""kernels.tuning: the calibration at load that picks, per weight type, which of this CPU's kernels
runs it, and its cache per machine kind. Every kernel it can pick must compute the same product
(the tight reference of tests/kernels/test_native.py), whichever ISA's code it is and whether the
weight is packed or not; the choice must be made once, kept in the cache, and read back by the next
process instead of measured again."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as T

from splitmoe.kernels import native, tuning
from tests.kernels.test_native import check_matmul, qt

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels unavailable: {native.UNAVAILABLE_REASON}")

TYPES = [T.Q4_K, T.Q6_K, T.Q8_0, T.MXFP4, T.IQ2_XXS, T.Q5_0]


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """Tuning on, a cache of its own, no choice made yet; every choice undone afterwards."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SPLITMOE_KERNELS_TUNE", raising=False)
    monkeypatch.delenv("SPLITMOE_KERNELS_ISA", raising=False)
    native._set_isa(native._best_isa())
    tuning.reset()
    yield tmp_path / "splitmoe" / "kernel-tuning.json"
    tuning.reset()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_candidate_kernel_computes_the_same_product(qtype, fresh):
    found = tuning.candidates(int(qtype))
    if native.isa() not in tuning.ISAS:
        assert found == []
        pytest.skip(f"no SIMD kernels on {native.isa()}: nothing to choose")
    assert found[0].isa == native.isa() and len(set(found)) == len(found)
    assert all(c.isa in tuning.ISAS for c in found)
    w = qt(qtype, (48, 512), seed=int(qtype))
    gen = torch.Generator().manual_seed(1)
    for c in found:
        tuning._set(int(qtype), c.isa, c.pack)
        mm = native.WeightMatmul(native.kernel_weight(w, c.pack, tune=False))
        assert mm.packed == (c.pack,), c.label
        for m in (1, 3, 16):
            x = torch.randn(m, 512, generator=gen)
            check_matmul(mm(x), x, w, f"{qtype.name} {c.label}, {m} tokens")


@pytest.mark.stack
def test_the_first_weight_of_a_type_settles_its_kernel_and_the_cache_keeps_it(fresh):
    if len(tuning.candidates(int(T.Q4_K))) < 2:
        pytest.skip(f"one Q4_K kernel on {native.isa()}: nothing to choose")
    w = qt(T.Q4_K, (64, 1024), seed=3)
    native.kernel_weight(w, True)
    choice = tuning.choices()["Q4_K"]
    labels = [c.label for c in tuning.candidates(int(T.Q4_K))]
    assert choice.source == "measured" and choice.label in labels
    assert sorted(choice.us) == sorted(labels)  # every kernel was timed, at one token and at 16
    assert all(len(us) == len(tuning.TOKENS) and all(u > 0 for u in us) for us in choice.us.values())
    own = choice.us[labels[0]]
    if choice.label != labels[0]:  # another kernel only where it is clearly faster
        assert tuning._score(choice.us[choice.label]) <= (1 - tuning.TIE_MARGIN) * tuning._score(own)
    # the kernels now in use are the chosen ones: a packed weight exactly where the choice packs
    assert native.kernel_weight(w, True).packed == choice.pack

    stored = json.loads(fresh.read_text())[tuning.machine_key()][str(int(T.Q4_K))]
    assert (stored["isa"], stored["pack"], stored["type_name"]) == (choice.isa, choice.pack, "Q4_K")

    # the next process on this machine reads it instead of measuring
    code = ("import splitmoe\nfrom splitmoe.kernels import native, tuning\nfrom tests.kernels.test_native import qt\n"
            "from gguf import GGMLQuantizationType as T\n"
            "native.kernel_weight(qt(T.Q4_K, (32, 512), seed=5), True)\n"
            "c = tuning.choices()['Q4_K']\nprint(c.source, c.label)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("SPLITMOE_KERNELS_TUNE", "SPLITMOE_KERNELS_ISA")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={**env, "XDG_CACHE_HOME": str(fresh.parent.parent)})
    assert out.stdout.split("\n")[-2] == f"cache {choice.label}"


def test_a_damaged_cache_is_measured_again_and_rewritten(fresh, caplog):
    if len(tuning.candidates(int(T.Q6_K))) < 2:
        pytest.skip(f"one Q6_K kernel on {native.isa()}: nothing to choose")
    fresh.parent.mkdir(parents=True)
    fresh.write_text("{not json")
    native.kernel_weight(qt(T.Q6_K, (32, 512), seed=4), True)
    assert tuning.choices()["Q6_K"].source == "measured"
    assert "ignoring" in caplog.text and str(fresh) in caplog.text
    assert str(int(T.Q6_K)) in json.loads(fresh.read_text())[tuning.machine_key()]


def test_off_switch_and_a_forced_isa_leave_every_type_to_the_isa(fresh, monkeypatch):
    monkeypatch.setenv("SPLITMOE_KERNELS_TUNE", "0")
    native.kernel_weight(qt(T.Q4_K, (32, 512), seed=6), True)
    assert tuning.choices() == {} and not fresh.exists()
    monkeypatch.delenv("SPLITMOE_KERNELS_TUNE")
    native._set_isa(native.isa())  # what tests and benchmarks do to compare paths
    native.kernel_weight(qt(T.Q4_K, (32, 512), seed=6), True)
    assert tuning.choices() == {} and not fresh.exists()


def test_choices_are_undone_by_reset_and_by_a_new_isa(fresh):
    found = tuning.candidates(int(T.Q4_K))
    if len(found) < 2 or not any(not c.pack for c in found):
        pytest.skip(f"no in-place Q4_K alternative on {native.isa()}")
    in_place = next(c for c in found if not c.pack)
    tuning._set(int(T.Q4_K), in_place.isa, in_place.pack)
    w = qt(T.Q4_K, (32, 512), seed=7)
    assert not native.kernel_weight(w, True, tune=False).packed
    native._set_isa(native.isa())
    assert native.kernel_weight(w, True, tune=False).packed == found[0].pack
