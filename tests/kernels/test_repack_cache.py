"""kernels.repack_cache: the int4 repack on disk (hit, miss, corrupt, key per shard)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from splitmoe.kernels import int4pack, repack_cache
from splitmoe.kernels.moe import ExpertFFN
from splitmoe.kernels.quants import QuantTensor
from splitmoe.kernels.repack_cache import RepackCache, cache_key, load_or_repack, tensor_digest
from tests.kernels.test_expert_kernels import realistic_blocks

pytestmark = pytest.mark.skipif(not int4pack.available(), reason="this torch has no CPU int4 kernels")


def experts(seed: int, ids=(0, 1, 2)) -> dict[int, ExpertFFN]:
    rng = np.random.default_rng(seed)

    def w(name, qtype, shape):
        return QuantTensor(name, int(qtype), shape, realistic_blocks(qtype, shape, rng))

    return {e: ExpertFFN(w(f"g{e}", T.Q4_K, (64, 256)), w(f"u{e}", T.Q4_K, (64, 256)), w(f"d{e}", T.Q4_0, (256, 64)))
            for e in ids}


@pytest.fixture
def counted(monkeypatch):
    """How many experts get repacked (rather than read from the cache)."""
    calls = []
    real = repack_cache.repack_expert

    def repack(ffn):
        calls.append(ffn)
        return real(ffn)
    monkeypatch.setattr(repack_cache, "repack_expert", repack)
    return calls


def same(a, b) -> bool:
    return all(torch.equal(x.gate_up.packed, y.gate_up.packed) and torch.equal(x.down.packed, y.down.packed)
               and torch.equal(x.gate_up.scales_and_zeros, y.gate_up.scales_and_zeros)
               for x, y in zip(a.values(), b.values())) and a.keys() == b.keys()


def test_second_load_hits_the_cache(tmp_path, counted, caplog):
    cache = RepackCache(tmp_path)
    layers = {0: experts(1), 3: experts(2)}
    ids = {0: "model.gguf:123|a", 3: "model.gguf:123|b"}
    first = load_or_repack(layers, ids, "model.gguf", cache, progress=False)
    assert len(counted) == 6
    files = sorted(p.name for p in (tmp_path / "model.gguf").iterdir())
    assert len(files) == 2 and files[0].startswith("L000-") and files[1].startswith("L003-")
    with caplog.at_level(logging.INFO, logger="splitmoe.kernels"):
        second = load_or_repack(layers, ids, "model.gguf", RepackCache(tmp_path), progress=False)
    assert len(counted) == 6  # nothing repacked
    assert "2 from the cache, 0 repacked" in caplog.text
    for layer in layers:
        assert same(first[layer], second[layer])
        x = torch.randn(2, 256).bfloat16()
        assert torch.equal(first[layer][0].gate_up.matmul(x), second[layer][0].gate_up.matmul(x))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "other key"])
def test_a_damaged_file_is_ignored_and_rewritten(tmp_path, counted, damage, caplog):
    cache = RepackCache(tmp_path)
    layers, ids = {0: experts(3)}, {0: "m:1|x"}
    good = load_or_repack(layers, ids, "m", cache, progress=False)
    (path,) = (tmp_path / "m").iterdir()
    data = path.read_bytes()
    # A new file in its place, as a crashed writer or a bad disk leaves it (`good` still maps the
    # old one: rewriting that inode in place would pull the pages from under it).
    bad = tmp_path / "bad"
    if damage == "garbage":
        bad.write_bytes(b"not a torch file" * 100)
    elif damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        bad.write_bytes(b"")
    else:  # a valid file whose contents belong to another key
        torch.save({"format": repack_cache.FORMAT_VERSION, "key": "nope", "experts": [0, 1, 2]}, bad)
    bad.replace(path)
    with caplog.at_level(logging.WARNING, logger="splitmoe.kernels"):
        again = load_or_repack(layers, ids, "m", cache, progress=False)
    assert len(counted) == 6 and "ignoring" in caplog.text
    assert same(good[0], again[0])
    load_or_repack(layers, ids, "m", cache, progress=False)
    assert len(counted) == 6  # rewritten: the third load hits
    assert [p.name for p in (tmp_path / "m").iterdir()] == [path.name]  # no temporary files left


def test_keys_differ_by_shard_file_and_layer():
    base = cache_key("m:1|x", 0, [0, 1, 2])
    assert base == cache_key("m:1|x", 0, [2, 1, 0])
    assert len({base, cache_key("m:1|x", 0, [0, 1]), cache_key("m:1|x", 1, [0, 1, 2]),
                cache_key("m:2|x", 0, [0, 1, 2]), cache_key("m:1|y", 0, [0, 1, 2])}) == 5


def test_a_different_shard_gets_its_own_file(tmp_path, counted):
    cache = RepackCache(tmp_path)
    all3 = experts(4)
    load_or_repack({0: all3}, {0: "m:1|x"}, "m", cache, progress=False)
    load_or_repack({0: {e: all3[e] for e in (0, 1)}}, {0: "m:1|x"}, "m", cache, progress=False)
    assert len(counted) == 5 and len(list((tmp_path / "m").iterdir())) == 2


def test_digest_sees_content_not_just_layout():
    a = experts(5, ids=(0,))[0].gate
    b_raw = a.data.copy()
    b_raw[0, 100] ^= 1
    b = QuantTensor(a.name, a.ggml_type, a.shape, b_raw)
    assert tensor_digest([a]) == tensor_digest([QuantTensor(a.name, a.ggml_type, a.shape, a.data.copy())])
    assert tensor_digest([a]) != tensor_digest([b])


def test_an_unwritable_cache_still_repacks(tmp_path, counted, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="splitmoe.kernels"):
        got = load_or_repack({0: experts(6)}, {0: "m:1|x"}, "m", RepackCache(blocker / "sub"), progress=False)
    assert len(got[0]) == 3 and len(counted) == 3 and "cannot write" in caplog.text


def test_progress_bar_goes_to_stderr_when_asked(tmp_path, capsys):
    load_or_repack({0: experts(7)}, {0: "m:1|x"}, "m", RepackCache(tmp_path), progress=True)
    err = capsys.readouterr().err
    assert "int4 repack" in err and "3/3" in err
    load_or_repack({0: experts(8)}, {0: "m:1|y"}, "m", None, progress=False)
    assert capsys.readouterr().err == ""
