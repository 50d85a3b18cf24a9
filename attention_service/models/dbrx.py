"""DBRX (132B, 16 experts, top-4): q/k/v in one `attn_qkv` weight, clamped, and LayerNorms.

The fused weight is split by rows at load, and the clamp `attention.clamp_kqv` (required of these
files) bounds all of q, k and v before rope. Rope is NeoX over the whole head. The norm before the
FFN is stored as `attn_output_norm` (HF `norm_2`), which is not applied to the attention output.
Its LayerNorms without bias and its always renormalised top-k are facts of its files that the
file does not state: modelfile/architectures.py (DBRX).
"""
from splitmoe.attention_service.model.arch_spec import ArchSpec
from splitmoe.modelfile.architectures import DBRX

SPEC = ArchSpec(DBRX, fused_qkv=True, ffn_norm="attn_output_norm")
