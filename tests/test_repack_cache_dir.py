"""The kernels keep repacked experts where their caller says; the services say the runtime's cache
directory (`XDG_CACHE_HOME`/splitmoe/int4pack), the tests and benchmarks a place of their own."""
from __future__ import annotations

from pathlib import Path

from splitmoe.attention_service.service import build_expert_backend
from splitmoe.attention_service.settings import AttentionSettings
from splitmoe.commands.serve_experts import _hosted_shard
from splitmoe.expert_service.settings import ExpertServiceSettings
from splitmoe.modelfile.gguf_file import GGUFFile


def test_the_services_keep_repacked_experts_in_the_runtimes_cache(demo_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    want = tmp_path / "splitmoe" / "int4pack"
    g = GGUFFile(demo_gguf)
    in_process = build_expert_backend(g, AttentionSettings(model_path=str(demo_gguf)))
    assert in_process.shard.repack_cache.directory == want
    hosted = _hosted_shard(ExpertServiceSettings(model_path=Path(demo_gguf), port=0))
    assert hosted.repack_cache.directory == want
