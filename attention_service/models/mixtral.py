"""Mixtral 8x7B / 8x22B, stored as GGUF arch `llama` with experts: top-2 of 8, interleaved rope.

Renormalised top-k by default: modelfile/architectures.py (MIXTRAL).
"""
from splitmoe.attention_service.model.arch_spec import ArchSpec
from splitmoe.modelfile.architectures import MIXTRAL

SPEC = ArchSpec(MIXTRAL, rope_interleaved=True)
