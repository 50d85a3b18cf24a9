"""DBRX (132B, 16 experts, top-4), GGUF arch `dbrx`: q/k/v in one `attn_qkv` weight, clamped, and
LayerNorms.

The fused weight is split by rows at load, and the clamp `attention.clamp_kqv` (required of these
files, as llama.cpp's reader requires it) bounds all of q, k and v before rope. Rope is NeoX over
the whole head. The norm before the FFN is stored as `attn_output_norm` (HF `norm_2`), which is not
applied to the attention output. Its LayerNorms without bias and its softmax routing whose top-k
llama.cpp always renormalises (the converter writes no key for `moe_normalize_expert_weights`:
DBRX's is 1.0) are facts of its files that the file does not state.
"""
from typing import Any, Mapping

from splitmoe.modelfile.architectures.base import Architecture, ArchSpec
from splitmoe.modelfile.hparams import NORM_LAYER, ModelConfig, Reader


def read_hparams(r: Reader, cfg: ModelConfig) -> Mapping[str, Any]:
    return {"clamp_kqv": r.non_negative("attention.clamp_kqv", None)}


ARCHITECTURE = Architecture("dbrx", hparam_defaults={"norm": NORM_LAYER, "expert_weights_norm": True},
                            read_hparams=read_hparams)
SPEC = ArchSpec(ARCHITECTURE, fused_qkv=True, ffn_norm="attn_output_norm")
