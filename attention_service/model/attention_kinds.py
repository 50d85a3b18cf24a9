"""The attention class of each kind an ArchSpec names (modelfile/architectures/base.py): each loads its layer's weights,
declares its KV cache entries and computes a layer."""
from __future__ import annotations

from splitmoe.attention_service.model.attention import MultiHeadAttention
from splitmoe.attention_service.model.irope import IRopeAttention
from splitmoe.attention_service.model.mla import MultiLatentAttention
from splitmoe.modelfile.architectures.base import ATTENTION_IROPE, ATTENTION_MHA, ATTENTION_MLA, ArchSpec

ATTENTION_CLASSES = {ATTENTION_MHA: MultiHeadAttention, ATTENTION_MLA: MultiLatentAttention,
                     ATTENTION_IROPE: IRopeAttention}


def attention_class(spec: ArchSpec) -> type[MultiHeadAttention] | type[MultiLatentAttention]:
    return ATTENTION_CLASSES[spec.attention]
