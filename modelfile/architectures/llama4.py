"""Llama-4 Scout / Maverick, GGUF arch `llama4`: iRoPE attention (attention_service/model/irope.py:
NoPE every 4th layer with attention temperature, chunked attention with interleaved rope and an
L2 q/k norm on the others), MoE every `interleave_moe_layer_step`-th layer (required, as llama.cpp
requires it) with a plain shared expert, top-1 sigmoid routing whose weight scales the expert's
input; `expert_feed_forward_length` is required too.

llama.cpp hard-codes the iRoPE numbers (NoPE interval 4, chunk 8192, temperature floor 8192 and
scale 0.1): `read_hparams` reads them, where SplitMoE's own `llama4.splitmoe.*` keys (never written
by a converter) can replace them for tests.
"""
from typing import Any, Mapping

from splitmoe.modelfile.architectures.base import ATTENTION_IROPE, SHARED_EXPERT_PLAIN, Architecture, ArchSpec
from splitmoe.modelfile.hparams import GATING_SIGMOID, MAX_CONTEXT, ModelConfig, Reader

NOPE_LAYER_INTERVAL = 4
ATTENTION_CHUNK_TOKENS = 8192
ATTENTION_TEMPERATURE_FLOOR_TOKENS = 8192
ATTENTION_TEMPERATURE_SCALE = 0.1


def read_hparams(r: Reader, cfg: ModelConfig) -> Mapping[str, Any]:
    return {"moe_layer_interval": r.integer("interleave_moe_layer_step", hi=cfg.num_layers),
            **_irope(r, cfg.num_layers)}


def _irope(r: Reader, num_layers: int) -> Mapping[str, Any]:
    """The NoPE interval, chunk and temperature: llama.cpp's constants, except that a file stating
    `attention.sliding_window` = 0 (a config whose every layer is full attention) has no chunks and
    no temperature, and only its last layer is NoPE, as llama.cpp reads it. SplitMoE's own
    `splitmoe.*` keys, which no converter writes, replace the constants: tests use them to reach
    chunk and floor in a few tokens."""
    if r.g.arch_get("attention.sliding_window") == 0:
        return {"nope_layer_interval": num_layers}
    return {
        "nope_layer_interval": NOPE_LAYER_INTERVAL,
        "attention_chunk_tokens": r.integer("splitmoe.attention_chunk_tokens", ATTENTION_CHUNK_TOKENS,
                                            lo=1, hi=MAX_CONTEXT),
        "attention_temperature_floor_tokens": r.integer(
            "splitmoe.attention_temperature_floor_tokens", ATTENTION_TEMPERATURE_FLOOR_TOKENS, lo=1, hi=MAX_CONTEXT),
        "attention_temperature_scale": r.positive("splitmoe.attention_temperature_scale",
                                                  ATTENTION_TEMPERATURE_SCALE),
    }


ARCHITECTURE = Architecture("llama4", hparam_defaults={"expert_gating": GATING_SIGMOID, "expert_weights_norm": False,
                                                       "expert_ffn": None},
                            read_hparams=read_hparams)
SPEC = ArchSpec(
    ARCHITECTURE,
    rope_interleaved=True,
    shared_expert=SHARED_EXPERT_PLAIN,
    attention=ATTENTION_IROPE,
    expert_input_weighted=True,
)
