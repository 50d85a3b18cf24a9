"""Attention over the paged KV cache for accelerators (CUDA): static shapes, no host syncs.

The CPU path (attention.py `grouped_attention`, mla.py `latent_attention`, the native kernels in
kernels/decode_attention.py) reads positions and slots on the host to skip keys and to take views
of consecutive slots; on a GPU each such read is a sync, and a shape that follows the data cannot
be captured in a CUDA graph. These functions keep every shape a function of the tensors' shapes
alone and build masks by comparing device tensors, so a decode step can be captured once per
(batch, context bucket) and replayed with new contents of the same tensors:

* `paged_decode_attention`: query rows over slot tables padded to one context length C; the
  whole padded context is gathered and masked (the cost: K/V as [G, B, C, D] float32).
* `paged_latent_decode_attention`: the same for MLA's absorbed form (one shared latent head).
* `prompt_attention_sdpa`: `grouped_attention`'s contract through torch's scaled_dot_product_attention,
  whose memory-efficient kernel never holds a prompt's [H, T, C] scores.

All of them compute scores, softmax and the weighted sum in float32, as the CPU paths do.
Shape legend: B query rows, T prompt tokens, H query heads, G kv heads, R = H/G, C context
positions, S pool slots, D key dims, Dv value dims, L latent dims.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Decode attention reads the padded context this many positions at a time (online softmax beyond
# one chunk): what bounds its memory to rows x chunk.
CONTEXT_CHUNK_TOKENS = 1024
# Head dims the memory-efficient SDPA kernel takes without padding them itself (a multiple of 4
# float32s is its minimum; 8 also suits the half-precision kernels).
_SDPA_HEAD_ALIGNMENT = 8


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slot_table: torch.Tensor,
                           context_lens: torch.Tensor, q_positions: torch.Tensor, scale: float, *,
                           window_tokens: int = 0, chunk_tokens: int = 0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """[B, H, Dv] in q's dtype: each query row's attention over its sequence's cached context.

    q [B, H, D]; k_pool [G, S, D] and v_pool [G, S, Dv] are the KV cache's pools (float32 or
    bfloat16), query head h reading kv head h // R. slot_table [B, C] int64: row b's slot of each
    context position, valid below context_lens[b] [B] and padded with any slot of the pool after
    (its values must be finite: they are multiplied by a zero weight). q_positions [B]: each row's
    own position; it sees positions c <= q_position and c < context_len, and only those from
    `visible_from` on (sliding window, or Llama 4's chunk). Several rows may share a sequence
    (each with its own table row). sinks [H]: a logit per head in the softmax's denominator that
    adds no value (gpt-oss). A row that sees nothing (context_len 0: a padding row) gives zeros.
    A window wins over a chunk where both are set, as in `visible_from`. Every tensor lives on
    q's device. Memory: K and V gathered as float32 [G, B, c, D] and [G, B, c, Dv], scores [H, B, c],
    for c = min(C, CONTEXT_CHUNK_TOKENS) (longer contexts in chunks: `_attend_in_chunks`).
    """
    B, H, D = q.shape
    G, C, Dv = k_pool.shape[0], slot_table.shape[1], v_pool.shape[-1]
    _check_rows(B, H, G, slot_table, context_lens, q_positions)
    R = H // G
    qf = (q.float() * scale).view(B, G, R, D).transpose(0, 1)  # [G, B, R, D]
    sink = None if sinks is None else sinks.float().view(G, 1, R, 1)

    def scores_of(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked scores [G, B, R, c] and values [G, B, c, Dv] of context positions start..end-1."""
        table = slot_table[:, start:end]
        scores = torch.matmul(qf, _gather_context(k_pool, table).mT)
        visible = _decode_mask(start, end, context_lens, q_positions, window_tokens, chunk_tokens)
        return scores.masked_fill_(~visible[None, :, None, :], float("-inf")), _gather_context(v_pool, table)

    out = _attend_in_chunks(scores_of, C, sink)  # [G, B, R, Dv]
    return out.transpose(0, 1).reshape(B, H, Dv).to(q.dtype)


def paged_latent_decode_attention(q: torch.Tensor, latent_pool: torch.Tensor, slot_table: torch.Tensor,
                                  context_lens: torch.Tensor, q_positions: torch.Tensor, scale: float,
                                  latent_dims: int) -> torch.Tensor:
    """[B, H, L] in q's dtype: `paged_decode_attention` for MLA's absorbed queries (mla.py
    `latent_attention`): every head attends over the one shared latent, q [B, H, L+R] against
    latent_pool [S, L+R] rows, whose first `latent_dims` dims are also the values. Causal only."""
    B, H, _ = q.shape
    C = slot_table.shape[1]
    _check_rows(B, H, 1, slot_table, context_lens, q_positions)
    qf = q.float()

    def scores_of(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        latents = _gather_context(latent_pool, slot_table[:, start:end])  # [B, c, L+R]
        scores = torch.matmul(qf, latents.mT).mul_(scale)  # [B, H, c]
        visible = _decode_mask(start, end, context_lens, q_positions)
        return scores.masked_fill_(~visible[:, None, :], float("-inf")), latents[..., :latent_dims]

    return _attend_in_chunks(scores_of, C).to(q.dtype)


def _attend_in_chunks(scores_of, num_positions: int, sink: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(scores) @ values over the context, CONTEXT_CHUNK_TOKENS positions at a time.

    `scores_of(start, end)` gives the masked scores [..., c] and values [..., c, Dv] of positions
    start..end-1. One chunk: a plain softmax. More: an online softmax (a running maximum and sum,
    earlier partial sums rescaled), so the gathered context and the scores never exceed one
    chunk, whatever the padded width: memory is rows x chunk, not rows x the longest context.
    The chunks are a Python loop over a fixed width, so the shapes stay fixed (CUDA graphs)."""
    if num_positions <= CONTEXT_CHUNK_TOKENS:
        scores, values = scores_of(0, num_positions)
        return torch.matmul(_softmax(scores, sink), values)
    top = total = out = None
    for start in range(0, num_positions, CONTEXT_CHUNK_TOKENS):
        scores, values = scores_of(start, min(num_positions, start + CONTEXT_CHUNK_TOKENS))
        chunk_top = scores.amax(-1, keepdim=True)
        new_top = chunk_top if top is None else torch.maximum(top, chunk_top)
        new_top = torch.where(torch.isfinite(new_top), new_top, torch.zeros_like(new_top))  # rows that see nothing yet
        weights = torch.exp(scores - new_top)
        if top is None:
            total, out = weights.sum(-1, keepdim=True), torch.matmul(weights, values)
        else:
            rescale = torch.exp(top - new_top)
            total = total * rescale + weights.sum(-1, keepdim=True)
            out = out * rescale + torch.matmul(weights, values)
        top = new_top
    if sink is not None:
        total = total + torch.exp(sink - top)
    return out / total.clamp_min(torch.finfo(torch.float32).tiny)


def prompt_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                          scale: float, *, window_tokens: int = 0, sinks: torch.Tensor | None = None,
                          first_position: int = 0, chunk_tokens: int = 0) -> torch.Tensor:
    """attention.py `grouped_attention` (same arguments, same result) through torch's
    scaled_dot_product_attention: q [T, H, D], k [G, C, D] and v [G, C, Dv] in the KV cache's
    layout holding positions first_position..first_position+C-1. Returns [T, H, Dv] in q's dtype.

    Computed in float32 whatever the inputs: on CUDA, float32 inputs with a mask select the
    memory-efficient kernel, which keeps scores and probabilities in float32 (flash takes only
    half precision). bfloat16 scores or probabilities flipped routing decisions on the project's
    fixtures (DBRX's, Llama 4's: bench/RESULTS.md), so the GPU keeps the CPU's precision.

    Grouped heads are not expanded: the R query heads of a kv head go in SDPA's batch dim, the kv
    heads broadcast over it as a stride-0 view (enable_gqa would route a masked call to the math
    kernel, which holds all scores). Sinks become one extra key: see `_with_sink_key`.
    """
    T, H, D = q.shape
    G, C, Dv = k.shape[0], k.shape[1], v.shape[-1]
    R = H // G
    context = torch.arange(first_position, first_position + C, device=q.device)
    visible = _visibility_mask(context, q_positions, window_tokens, chunk_tokens)  # [T, C]
    if sinks is None:
        queries = q.float().reshape(T, G, R, D).permute(2, 1, 0, 3)  # [R, G, T, D]
        keys, values = k.float(), v.float()
    else:
        queries, keys, values, visible = _with_sink_key(q, k, v, sinks, scale, visible)
    out = F.scaled_dot_product_attention(queries, keys.expand(R, -1, -1, -1), values.expand(R, -1, -1, -1),
                                         attn_mask=visible, scale=scale)  # [R, G, T, Dv]
    return out.permute(2, 1, 0, 3).reshape(T, H, Dv).to(q.dtype)


def _check_rows(B: int, H: int, G: int, slot_table: torch.Tensor, context_lens: torch.Tensor,
                q_positions: torch.Tensor) -> None:
    """Shapes only (never values: reading them would sync)."""
    if H % G or slot_table.dim() != 2 or slot_table.shape[0] != B or context_lens.shape != (B,) \
            or q_positions.shape != (B,):
        raise ValueError(f"paged attention: q of {B} rows x {H} heads over {G} kv heads needs slot_table [{B}, C], "
                         f"context_lens [{B}] and q_positions [{B}]; got {tuple(slot_table.shape)}, "
                         f"{tuple(context_lens.shape)}, {tuple(q_positions.shape)}")


def _gather_context(pool: torch.Tensor, slot_table: torch.Tensor) -> torch.Tensor:
    """float32 [G, B, C, D] of a pool [G, S, D] ([B, C, D] of a pool [S, D]) at slot_table [B, C]:
    one gather of fixed shape, converted once."""
    slot_dim = pool.dim() - 2
    rows = pool.index_select(slot_dim, slot_table.reshape(-1))
    return rows.view(*pool.shape[:slot_dim], *slot_table.shape, pool.shape[-1]).float()


def _visibility_mask(context: torch.Tensor, q_positions: torch.Tensor, window_tokens: int = 0,
                     chunk_tokens: int = 0) -> torch.Tensor:
    """bool [N, C]: which context positions [C] each query at q_positions [N] sees: none after
    itself, none before attention.py's `visible_from` (a window wins over a chunk there too)."""
    positions = q_positions[:, None]
    visible = context[None, :] <= positions
    if window_tokens:
        visible &= context[None, :] > positions - window_tokens
    elif chunk_tokens:
        visible &= context[None, :] >= torch.div(positions, chunk_tokens, rounding_mode="floor") * chunk_tokens
    return visible


def _decode_mask(start: int, end: int, context_lens: torch.Tensor, q_positions: torch.Tensor, window_tokens: int = 0,
                 chunk_tokens: int = 0) -> torch.Tensor:
    """bool [B, end - start]: what each decode row sees of its table row's positions start..end-1:
    its visible positions that its sequence has (the table's padding after context_lens is masked)."""
    context = torch.arange(start, end, device=q_positions.device)
    return _visibility_mask(context, q_positions, window_tokens, chunk_tokens) & (context < context_lens[:, None])


def _softmax(scores: torch.Tensor, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dim, with `sink` (broadcast to [..., 1]) joining the denominator only;
    a row masked throughout gives zeros, not NaN (so padding rows of a captured batch stay finite)."""
    top = scores.amax(-1, keepdim=True)
    if sink is not None:
        top = torch.maximum(top, sink)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    if sink is not None:
        total += torch.exp(sink - top)
    return weights.div_(total.clamp_min_(torch.finfo(torch.float32).tiny))


def _with_sink_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float,
                   visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SDPA's inputs ([R, G, T, D+E] queries, [G, C+1, D+E] keys, [G, C+1, Dv] values, [T, C+1]
    mask) with one extra key per kv head whose score is each query head's sink logit and whose
    value is zero: softmax over [scores, sink] with the sink adding nothing, as grouped_attention.

    SDPA has no sink term, and a per-head additive mask column would make the mask [H, T, C+1]
    (gigabytes for a long prompt). Instead each query gets E extra dims holding a one-hot of its
    head within the group (E >= R, rounded so D+E suits the kernel) and the extra key holds
    sink/scale in them: scale·(q'·k') = sink for that key, and the real keys' extra dims are zero.
    """
    T, H, D = q.shape
    G, C, Dv = k.shape[0], k.shape[1], v.shape[-1]
    R = H // G
    E = (D + R + _SDPA_HEAD_ALIGNMENT - 1) // _SDPA_HEAD_ALIGNMENT * _SDPA_HEAD_ALIGNMENT - D
    queries = torch.zeros(R, G, T, D + E, dtype=torch.float32, device=q.device)
    queries[..., :D] = q.reshape(T, G, R, D).permute(2, 1, 0, 3)
    queries[..., D : D + R] = torch.eye(R, device=q.device)[:, None, None, :]
    keys = torch.zeros(G, C + 1, D + E, dtype=torch.float32, device=k.device)
    keys[:, :C, :D] = k
    keys[:, C, D : D + R] = sinks.float().view(G, R) / scale
    values = torch.zeros(G, C + 1, Dv, dtype=torch.float32, device=v.device)
    values[:, :C] = v
    return queries, keys, values, F.pad(visible, (0, 1), value=True)
