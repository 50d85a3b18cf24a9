"""The file's own NextN/MTP block (DeepSeek-V3's multi-token prediction, GLM-4.5's NextN): a
decoder layer past the last one that predicts the token after next.

As llama.cpp's `graph_mtp` (and vLLM's MTP proposer) run it, for the row of position i:

    x = eh_proj([enorm(E(t[i+1])), hnorm(h[i])])      h[i]: the main model's final-normed hidden state
    x = x + attention(attn_norm(x))                   the block's own KV cache, positions as the main model's
    x = x + ffn(ffn_norm(x))                          MoE: its routed experts go to the expert backend
    g = shared_head_norm(x);  logits = head(g)        predicts t[i+2]

E and head are the block's own `embed_tokens` / `shared_head_head` where the file has them, else the
main model's. Drafting further than one token feeds g back as the next row's h (llama.cpp's
`h_nextn`). The transformer's own attention and FFN code computes the layer: the block is layer
`index` of the file to the expert backend, layer 0 of its own one-layer cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splitmoe.attention_service.model.batch import StepBatch
from splitmoe.attention_service.model.kv_cache import KVCache
from splitmoe.attention_service.model.layers import linear
from splitmoe.attention_service.model.transformer import MoETransformer
from splitmoe.attention_service.model.weight_loader import WeightLoader
from splitmoe.attention_service.model.weights import LayerWeights, load_layer
from splitmoe.kernels.linear import LinearWeight, QuantEmbedding
from splitmoe.modelfile.architectures.base import ArchSpec
from splitmoe.modelfile.gguf_file import GGUFError, GGUFFile
from splitmoe.modelfile.hparams import ModelConfig


@dataclass
class NextNWeights:
    index: int                       # the block's layer number in the file (= the main layers' count)
    layer: LayerWeights              # an ordinary decoder layer (MoE in every file seen)
    eh_proj: LinearWeight            # [D, 2D]: (embedding, hidden) -> D
    enorm: torch.Tensor
    hnorm: torch.Tensor
    head_norm: torch.Tensor
    embedding: torch.Tensor | QuantEmbedding | None  # None: the main model's
    head: LinearWeight | None                        # None: the main model's output


def load_nextn(g: GGUFFile, spec: ArchSpec, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> NextNWeights:
    """The first NextN block of the file (as llama.cpp, one is run however many the file has)."""
    if not cfg.num_nextn_layers:
        raise GGUFError(f"{g.path.name}: no NextN/MTP block ({g.arch}.nextn_predict_layers is 0 or absent): "
                        "--speculative mtp needs a file that carries one (GLM-4.5, GLM-4.7-Flash, DeepSeek "
                        "files converted with their MTP layers)")
    load, i, D = WeightLoader(g, dtype, device), cfg.num_layers, cfg.hidden_size
    p, vocab = f"blk.{i}.nextn.", (cfg.vocab_size, D)
    return NextNWeights(
        index=i,
        layer=load_layer(load, spec, cfg, i),
        eh_proj=load.linear(p + "eh_proj.weight", (D, 2 * D)),
        enorm=load.norm(p + "enorm.weight", (D,)),
        hnorm=load.norm(p + "hnorm.weight", (D,)),
        head_norm=load.norm(p + "shared_head_norm.weight", (D,)) if g.has(p + "shared_head_norm.weight") else None,
        embedding=load.embedding(p + "embed_tokens.weight", vocab) if g.has(p + "embed_tokens.weight") else None,
        head=load.linear_optional(p + "shared_head_head.weight", vocab),
    )


class NextNBlock:
    """Runs the block over rows of (hidden, next token) pairs, on the main model's code and experts."""

    def __init__(self, model: MoETransformer, weights: NextNWeights):
        self.model, self.w = model, weights
        self.cfg = model.cfg
        self.embedding = weights.embedding if weights.embedding is not None else model.weights.token_embedding
        self.head = weights.head if weights.head is not None else model.weights.output
        self.head_norm = weights.head_norm if weights.head_norm is not None else model.weights.output_norm

    def kv_entry_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.model.kv_entry_shapes()

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor, batch: StepBatch,
                kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(g [T, D] float32, the shared head's normed output; float32 logits of `batch.logits_rows`).

        hidden [T, D]: each row's h (the main model's, or the block's own g when drafting on);
        next_tokens [T]: each row's t[i+1]. Writes the rows' KV into `kv` (one layer)."""
        m, w, eps = self.model, self.w, self.cfg.norm_eps
        e = m.norm(self.embedding[next_tokens].float(), w.enorm, eps)
        h = m.norm(hidden.float(), w.hnorm, eps)
        x = linear(torch.cat([e, h], dim=-1).to(m.dtype), w.eh_proj).float()
        x = m.attention_block(0, w.layer, x, batch, kv)
        x = x + m.ffn(w.index, w.layer, m.ffn_norm(w.layer, x), batch, self.cfg.num_experts_used)
        g = m.norm(x, self.head_norm, eps)
        return g, linear(g[batch.logits_rows].to(m.dtype), self.head).float()
