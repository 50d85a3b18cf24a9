"""Multi-head attention with grouped KV heads over the paged cache (Qwen, Mixtral, OLMoE, gpt-oss,
DBRX, DeepSeek-MoE).

An architecture names its attention kind in its ArchSpec (attention_kinds.py maps kinds to classes);
each class loads its own weights, declares its KV cache entries and computes one layer. MLA
(DeepSeek) is another such class.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitmoe.attention_service.model.batch import SeqSlice, StepBatch
from splitmoe.attention_service.model.device_attention import paged_decode_attention, prompt_attention_sdpa
from splitmoe.attention_service.model.kv_cache import KVCache
from splitmoe.attention_service.model.layers import Rope, linear, rms_norm, softmax_scale
from splitmoe.attention_service.model.weight_loader import WeightLoader
from splitmoe.kernels import native
from splitmoe.kernels.decode_attention import decode_attention
from splitmoe.kernels.decode_layer import AttentionFront, DecodeStep, QkNorm
from splitmoe.kernels.linear import LinearGroup, LinearWeight, QuantLinear
from splitmoe.modelfile.architectures.base import ArchSpec
from splitmoe.modelfile.hparams import NORM_RMS, ModelConfig

# Query rows per chunk of the score matrix: at most this many float32 scores [rows, C] at once.
SCORES_PER_CHUNK = 1 << 22
# Steps in which no sequence brings more new tokens than this take the native decode layer (the
# attention half of each layer as one call); prompts keep torch's GEMMs for their projections.
NATIVE_DECODE_ROWS = 4
# A step verifying drafts (engine/speculation.py) takes it up to this many rows a sequence: each row
# then computes exactly as a one-token decode step would (the same kernels, row by row), so the
# verified tokens are the ones decoding one at a time gives, in bfloat16 too; and it is cheaper
# than the prompt path (6-layer Qwen3 shape, Zen 5: 5 rows 14.0 against 15.6 ms, 9 rows 21.1 against 22.8).
NATIVE_VERIFY_ROWS = 16


def use_native_attention(kv: KVCache) -> bool:
    """Whether attention over the cache runs natively (kernels.decode_attention, which takes prompts
    in tiles): the fast mode on the CPU, whatever the cache's format (bfloat16, or 8 bits read in
    place). The float32 mode keeps the torch path, the exact reference."""
    return kv.dtype == torch.bfloat16 and kv.device.type == "cpu" and native.AVAILABLE


def use_native_decode(batch: StepBatch, kv: KVCache) -> bool:
    """Whether this step's layers run their attention half as one native call each: decode-sized
    steps with native attention."""
    limit = NATIVE_VERIFY_ROWS if batch.verification else NATIVE_DECODE_ROWS
    return use_native_attention(kv) and 0 < batch.max_new_tokens <= limit


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
              scale: float, *, window_tokens: int = 0, sinks: torch.Tensor | None = None,
              first_position: int = 0, chunk_tokens: int = 0) -> torch.Tensor:
    """Causal attention of new queries over the context, computed in float32.

    q [T, H, D] at absolute `q_positions` [T]; k [C, G, D] and v [C, G, Dv] hold positions
    `first_position`..`first_position`+C-1. `window_tokens` > 0: each query sees only itself and
    the window_tokens-1 positions before it (sliding window). `chunk_tokens` > 0: each query sees
    only the positions of its own chunk of that many, from the chunk's start (Llama 4's chunked
    attention). `sinks` [H]: one learned logit per head that joins the softmax denominator and adds
    no value (gpt-oss).
    Returns [T, H, Dv] in q's dtype.
    """
    return grouped_attention(q, k.transpose(0, 1), v.transpose(0, 1), q_positions, scale,
                             window_tokens=window_tokens, sinks=sinks, first_position=first_position,
                             chunk_tokens=chunk_tokens)


def visible_from(position: int, window_tokens: int = 0, chunk_tokens: int = 0) -> int:
    """The oldest position a query at `position` sees (before clamping at 0): its sliding window's
    first, or its chunk's start. Never decreases with the position, which the chunking relies on."""
    if window_tokens:
        return position - window_tokens + 1
    if chunk_tokens:
        return position // chunk_tokens * chunk_tokens
    return 0


def host_positions(q_positions: torch.Tensor) -> list[int] | None:
    """The query positions as host ints, which let each chunk of queries skip keys; None on an
    accelerator, where reading them would sync: there every chunk takes the whole context, masked."""
    return q_positions.tolist() if q_positions.device.type == "cpu" else None


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                      scale: float, *, window_tokens: int = 0, sinks: torch.Tensor | None = None,
                      first_position: int = 0, chunk_tokens: int = 0) -> torch.Tensor:
    """`attention` with k [G, C, D] and v [G, C, Dv] in the KV cache's layout.

    Grouped query heads are never expanded: the R = H/G query heads of a kv head become R rows of
    one matrix product with that head's keys, [G, T*R, D] @ [G, D, C], in chunks of query rows
    that bound the score matrix. On the CPU each chunk multiplies only the keys some of its
    queries see (causal: none after its last query; sliding: none before its first one's window)
    and masks only where its queries disagree, so a decode step masks nothing. Float32 k/v are
    read in place; others are converted once. (bfloat16 products, 2.3-2.7x faster here, were
    tried: rounded scores flipped a routing on DBRX's fixture, rounded probabilities one on Llama
    4's, past llama.cpp's own count: bench/RESULTS.md.)
    """
    T, H, D = q.shape
    G, C, Dv = k.shape[0], k.shape[1], v.shape[2]
    R = H // G
    kf, vf = k.float(), v.float()
    qf = q.float() * scale
    if T == 1 and sinks is None and q_positions.device.type == "cpu":  # decode: a few calls
        if window_tokens or chunk_tokens:
            lo = min(C - 1, max(0, visible_from(int(q_positions[0]), window_tokens, chunk_tokens) - first_position))
            kf, vf = kf[:, lo:], vf[:, lo:]
        probs = torch.softmax(torch.bmm(qf.view(G, R, D), kf.mT), dim=-1)
        out = torch.bmm(probs, vf).view(1, H, Dv)
        return out if out.dtype == q.dtype else out.to(q.dtype)
    qf = qf.reshape(T, G, R, D).transpose(0, 1).reshape(G, T * R, D)
    out = torch.empty(G, T * R, Dv, dtype=torch.float32, device=q.device)
    positions = host_positions(q_positions)
    sink = None if sinks is None else sinks.float().view(G, 1, R, 1)
    step = max(1, SCORES_PER_CHUNK // max(1, H * C))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        rows = slice(t0 * R, t1 * R)
        lo, hi, mask_from = 0, C, 0
        if positions is not None:
            p_min, p_max = min(positions[t0:t1]), max(positions[t0:t1])
            hi = max(1, min(C, p_max - first_position + 1))
            if window_tokens or chunk_tokens:
                lo = min(hi - 1, max(0, visible_from(p_min, window_tokens, chunk_tokens) - first_position))
                # no query's window or chunk starts later: causal masking alone
                if visible_from(p_max, window_tokens, chunk_tokens) <= first_position + lo:
                    mask_from = max(0, p_min + 1 - first_position)
            else:
                mask_from = max(0, p_min + 1 - first_position)
        scores = torch.bmm(qf[:, rows], kf[:, lo:hi].mT).view(G, t1 - t0, R, hi - lo)
        if mask_from < hi:  # some key in [mask_from, hi) is out of some query's reach
            start = max(lo, mask_from)
            context = torch.arange(first_position + start, first_position + hi, device=k.device)
            pos = q_positions[t0:t1, None]
            allowed = context[None, :] <= pos
            if window_tokens:
                allowed &= context[None, :] > pos - window_tokens
            elif chunk_tokens:
                allowed &= context[None, :] >= torch.div(pos, chunk_tokens, rounding_mode="floor") * chunk_tokens
            scores[..., start - lo :].masked_fill_(~allowed[None, :, None, :], float("-inf"))
        if sink is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            # softmax over [scores, sink] with the sink's column dropped: a head can put weight
            # on "nothing" instead of on some token.
            top = torch.maximum(scores.amax(-1, keepdim=True), sink)
            probs = torch.exp(scores - top)
            probs /= probs.sum(-1, keepdim=True) + torch.exp(sink - top)
        torch.bmm(probs.view(G, (t1 - t0) * R, hi - lo), vf[:, lo:hi], out=out[:, rows])
    return out.view(G, T, R, Dv).transpose(0, 1).reshape(T, H, Dv).to(q.dtype)


@dataclass
class AttentionWeights:
    q: LinearWeight
    k: LinearWeight
    v: LinearWeight
    out: LinearWeight
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    out_bias: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # [H] float32 (gpt-oss)
    qkv: LinearGroup = field(init=False)  # q, k and v in one call where that is faster

    def __post_init__(self) -> None:
        self.qkv = LinearGroup(self.q, self.k, self.v)


class MultiHeadAttention:
    def __init__(self, cfg: ModelConfig, spec: ArchSpec, device: torch.device, rope_freqs: torch.Tensor | None = None):
        """rope_freqs: the file's `rope_freqs.weight` (llama3-style scaling as per-pair divisors), if any."""
        self.cfg, self.spec = cfg, spec
        self.rope = Rope(cfg.rope_dims, cfg.rope_theta, spec.rope_interleaved, cfg.rope_scaling, device=device,
                         freq_factors=rope_freqs)
        self.scale = softmax_scale(cfg.head_dim)
        if spec.sliding_window_pattern and cfg.sliding_window_tokens <= 0:
            raise ValueError(f"{cfg.arch}: sliding-window layers need {cfg.arch}.attention.sliding_window > 0")

    def chunk_tokens(self, layer: int) -> int:
        """The layer's attention chunk (Llama 4, irope.py), 0 for none."""
        return 0

    def window_tokens(self, layer: int) -> int:
        """The layer's sliding window, 0 for full attention.

        As llama.cpp's swa pattern: in each group of `sliding_window_pattern` layers all but the
        last slide (gpt-oss, pattern 2: even layers slide, as its config's layer_types say).
        """
        n = self.spec.sliding_window_pattern
        return self.cfg.sliding_window_tokens if n and layer % n < n - 1 else 0

    @staticmethod
    def load_weights(load: WeightLoader, spec: ArchSpec, cfg: ModelConfig, p: str) -> AttentionWeights:
        f32 = torch.float32  # biases are tiny: kept float32, added before any rounding
        D, H, G, Dk, Dv = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.value_head_dim

        def bias(name: str, width: int) -> torch.Tensor | None:
            return load(name, (width,), f32) if spec.qkv_bias else load.optional(name, (width,), f32)

        def qk_norm(name: str, heads: int) -> torch.Tensor | None:
            if spec.qk_norm == QkNorm.NONE or (spec.qk_norm_optional and not load.g.has(name)):
                return None
            return load.norm(name, (Dk,) if spec.qk_norm == QkNorm.PER_HEAD else (heads * Dk,))

        if spec.fused_qkv:
            q, k, v = load.linear_parts(p + "attn_qkv.weight", (H * Dk, G * Dk, G * Dv), D)
        else:
            q, k, v = (load.linear(p + f"attn_{n}.weight", (rows, D)) for n, rows in (("q", H * Dk), ("k", G * Dk),
                                                                                        ("v", G * Dv)))
        return AttentionWeights(
            q=q, k=k, v=v, out=load.linear(p + "attn_output.weight", (D, H * Dv)),
            q_bias=bias(p + "attn_q.bias", H * Dk), k_bias=bias(p + "attn_k.bias", G * Dk),
            v_bias=bias(p + "attn_v.bias", G * Dv),
            q_norm=qk_norm(p + "attn_q_norm.weight", H), k_norm=qk_norm(p + "attn_k_norm.weight", G),
            out_bias=load.optional(p + "attn_output.bias", (D,), f32),
            sinks=load.norm(p + "attn_sinks.weight", (H,)) if spec.attention_sinks else None,
        )

    def kv_entry_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.cfg
        return {"k": (c.num_kv_heads, c.head_dim), "v": (c.num_kv_heads, c.value_head_dim)}

    def native_front(self, i: int, w: AttentionWeights, attn_norm: torch.Tensor, ffn_norm: torch.Tensor,
                     router: torch.Tensor | None, router_bias: torch.Tensor | None,
                     kv: KVCache) -> AttentionFront | None:
        """Layer i's attention half as one native call (kernels.decode_layer), or None where a weight
        has no native route (the float32 mode's dense weights, a type the kernels lack)."""
        if not all(isinstance(m, QuantLinear) and m.route == "native" for m in (w.q, w.k, w.v, w.out)):
            return None
        if self.cfg.clamp_kqv or self.cfg.norm != NORM_RMS:  # the native layer has RMSNorm and no clamp
            return None
        if (w.q_norm is None) != (w.k_norm is None):  # one kind for both in the kernel
            return None
        c, pools = self.cfg, kv.native_pools(i)
        return AttentionFront(
            eps=c.norm_eps, attn_norm=attn_norm, ffn_norm=ffn_norm, q=w.q, k=w.k, v=w.v, o=w.out,
            heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim, value_dim=c.value_head_dim,
            biases=(w.q_bias, w.k_bias, w.v_bias, w.out_bias),
            qk_norm=self.spec.qk_norm if w.q_norm is not None else QkNorm.NONE, q_norm=w.q_norm,
            k_norm=w.k_norm, rope_dims=self.rope.dims, rope_interleaved=self.rope.interleaved, scale=self.scale,
            window=self.window_tokens(i), sinks=w.sinks, k_pool=pools["k"], v_pool=pools["v"], router=router,
            router_bias=router_bias)

    def decode_step(self, batch: StepBatch) -> DecodeStep:
        """What every layer's native front reads of this step (rope tables, slots, context)."""
        cos, sin = self.rope.tables(batch.positions)
        return DecodeStep(batch.new_slots, cos, sin, batch.attention_context)

    def __call__(self, i: int, w: AttentionWeights, h: torch.Tensor, batch: StepBatch,
                 kv: KVCache) -> torch.Tensor:
        """h [T, hidden] -> attention output [T, hidden]; writes this step's K/V to the cache."""
        q, k, v = self._project(w, h, batch.lora and (batch.lora, f"blk.{i}."))
        q, k = self._position(i, w, q, k, batch.positions)
        kv.write(i, batch.new_slots, k=k, v=v)
        a = self._attend(i, w, q, batch, kv).flatten(1)
        out = linear(a, w.out, w.out_bias)
        return out if batch.lora is None else batch.lora.add(f"blk.{i}.attn_output.weight", a, out)

    def _project(self, w: AttentionWeights, h: torch.Tensor,
                 lora: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, Dk], k [T, G, Dk], v [T, G, Dv], q/k normed where the architecture norms them.
        `lora`: (StepLora, "blk.N.") when rows of the step use adapters."""
        c, eps = self.cfg, self.cfg.norm_eps
        if isinstance(w.q, QuantLinear):
            h = h.float()  # what the quantized routes take: converted once for q, k and v
        q, k, v = w.qkv(h, (w.q_bias, w.k_bias, w.v_bias))
        if lora is not None:
            step, prefix = lora
            q, k, v = step.add_parts(tuple(f"{prefix}attn_{n}.weight" for n in "qkv"), h, (q, k, v))
        if c.clamp_kqv:
            q, k, v = (t.clamp(-c.clamp_kqv, c.clamp_kqv) for t in (q, k, v))
        if self.spec.qk_norm == QkNorm.FULL:
            q, k = _norm(q, w.q_norm, eps), _norm(k, w.k_norm, eps)
        q = q.view(-1, c.num_heads, c.head_dim)
        k = k.view(-1, c.num_kv_heads, c.head_dim)
        v = v.view(-1, c.num_kv_heads, c.value_head_dim)
        if self.spec.qk_norm == QkNorm.PER_HEAD:
            q, k = _norm(q, w.q_norm, eps), _norm(k, w.k_norm, eps)
        return q, k, v

    def _position(self, i: int, w: AttentionWeights, q: torch.Tensor, k: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k with their positions applied: rope, here."""
        return self.rope(q, positions), self.rope(k, positions)

    def _attend(self, i: int, w: AttentionWeights, q: torch.Tensor, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        """[T, H, Dv]: the new queries over their sequences' cached context."""
        window, chunk = self.window_tokens(i), self.chunk_tokens(i)
        if batch.paged is not None:  # decode on a GPU: every row at once, shapes fixed by the table
            pools, paged = kv.pools(i), batch.paged
            return paged_decode_attention(q, pools["k"], pools["v"], paged.slot_table, paged.context_lens,
                                          batch.positions, self.scale, window_tokens=window, chunk_tokens=chunk,
                                          sinks=w.sinks)
        if use_native_attention(kv):
            pools = kv.native_pools(i)
            # A chunked layer's rows attend over their chunk: a context of its own, one per step.
            context = batch.chunked_attention_context(chunk) if chunk else batch.attention_context
            return decode_attention(context, q, pools["k"], pools["v"], self.scale, window_tokens=window, sinks=w.sinks)
        # On a GPU the flash / memory-efficient kernels of SDPA take the prompts (device_attention.py).
        attend = prompt_attention_sdpa if q.device.type == "cuda" else grouped_attention
        parts, one = [], len(batch.seqs) == 1
        for s in batch.seqs:
            first = _first_visible_position(s, window, chunk)
            # The whole context is the step's own tensor, so the cache recognises it across layers.
            ctx = kv.read_pooled(i, s.context_slots[first:] if first else s.context_slots)
            parts.append(attend(q if one else q[s.start : s.end], ctx["k"], ctx["v"],
                                batch.positions if one else batch.positions[s.start : s.end],
                                self.scale, window_tokens=window, sinks=w.sinks, first_position=first,
                                chunk_tokens=chunk))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The q or k RMSNorm, where the layer has one (an optional norm the file left out: none)."""
    return x if weight is None else rms_norm(x, weight, eps)


def _first_visible_position(s: SeqSlice, window_tokens: int, chunk_tokens: int = 0) -> int:
    """The oldest context position any of the slice's queries sees: a sliding or chunked layer reads
    no more.

    The context holds positions 0..C-1 with the slice's new tokens last (host-side ints, no sync).
    """
    if not window_tokens and not chunk_tokens:
        return 0
    first_query = len(s.context_slots) - (s.end - s.start)
    return max(0, visible_from(first_query, window_tokens, chunk_tokens))
