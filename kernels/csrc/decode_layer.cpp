// The attention half of a decode layer as one call (multi-head attention families: Qwen2/3-MoE,
// Mixtral, OLMoE, gpt-oss): what torch did in some twenty calls per layer, each costing more
// than its arithmetic on a few rows.
//
//   x [T, D] float32, the residual stream, updated in place:
//     h = rms_norm(x) ; q, k, v = h @ (Wq, Wk, Wv)^T (+ biases, activations quantized once)
//     q/k norm (per head or over the whole projection) ; rope on the first rope_dims of each head
//     k, v -> the KV cache at the new slots ; a = attention(q, cache) ; x += a @ Wo^T (+ bias)
//   h [T, D] = rms_norm(x) with the FFN's norm, and logits [T, E] = h @ router^T (+ bias), float32.
//
// The routed experts, the shared expert and the FFN's residual add stay with the caller. Numbers
// are float32 throughout; the torch path's one difference is that it rounds the normed input to
// bfloat16 before the quantized linears quantize it. In a step of one sequence the projections take
// their input in two int8 terms (smk_matmul_multi_residual), as the quantized linears do then.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "kv_quant.h"
#include "smk.h"

extern "C" int smk_matmul_multi(int n_w, const int* types, const uint8_t* const* ws, const size_t* wstrides,
                                const int* ns, int k, const float* x, size_t xstride, int m, float* out, size_t ostride);
extern "C" int smk_matmul_multi_residual(int n_w, const int* types, const uint8_t* const* ws, const size_t* wstrides,
                                const int* ns, int k, const float* x, size_t xstride, int m, float* out, size_t ostride);
extern "C" int smk_attention(const float* q, int T, int H, int G, int Dk, int Dv, const void* k, int64_t k_row_stride,
                             int64_t k_head_stride, const void* v, int64_t v_row_stride, int64_t v_head_stride,
                             int kv_type, const uint16_t* k_scales, int64_t k_scale_row, int64_t k_scale_head,
                             const uint16_t* v_scales, int64_t v_scale_row, int64_t v_scale_head,
                             const int64_t* slots, const int64_t* seqs, int n_seqs, const int64_t* q_index,
                             float scale, int window, const float* sinks, float* out);

using namespace smk;

struct SmkQuantLinear {  // a weight as the GGUF stores it, with an optional float32 bias
    const uint8_t* w;
    int64_t row_bytes;
    int32_t type, rows, cols;
    const float* bias;
};

struct SmkAttnLayer {
    int32_t D, H, G, Dk, Dv;
    float eps;
    const float* attn_norm;  // [D]
    const float* ffn_norm;   // [D]
    SmkQuantLinear q, k, v, o;
    int32_t qk_norm;         // 0 none, 1 per head ([Dk] weights), 2 over the projection ([H*Dk], [G*Dk])
    const float* q_norm;
    const float* k_norm;
    int32_t rope_dims, rope_interleaved;  // pairs (i, i + dims/2), or (2i, 2i+1) when interleaved
    float scale;
    int32_t window;          // sliding window in tokens, 0: none
    const float* sinks;      // [H] or null
    void* k_pool;            // [G, slots, Dk]
    void* v_pool;            // [G, slots, Dv]
    int64_t k_row, k_head, v_row, v_head;  // strides in elements
    int32_t kv_type;         // 0 float32, 30 bfloat16, 8 q8_0, kKvFp8E4M3, kKvFp8E5M2 (kv_quant.h)
    const float* router;     // [E, D] float32, or null (a dense FFN layer)
    const float* router_bias;
    int32_t E;
    uint16_t* k_scales;      // q8_0: float16 scales [G, slots, Dk / 32] (v: [G, slots, Dv / 32]); else null
    uint16_t* v_scales;
    int64_t k_scale_row, k_scale_head, v_scale_row, v_scale_head;  // strides in elements
};

struct SmkDecodeStep {  // what every layer of one step shares
    int32_t T;
    const int64_t* new_slots;  // [T]
    const float* cos;          // [T, rope_dims]: the rotation's pair layout, magnitude included
    const float* sin;          // [T, rope_dims]: signed (-sin for a pair's first member)
    const int64_t* slots;      // the attention context (kernels/decode_attention.py)
    const int64_t* seqs;
    int32_t n_seqs;
    const int64_t* q_index;
};

namespace {

void rms_norm_rows(const float* x, int rows, int n, const float* w, float eps, float* out) {
    for (int r = 0; r < rows; ++r) rms_norm_row(x + size_t(r) * n, n, w, eps, out + size_t(r) * n);
}

void write_kv(void* pool, int kv_type, int64_t row_stride, int64_t head_stride, uint16_t* scales, int64_t scale_row,
              int64_t scale_head, int64_t slot, const float* src, int heads, int dim) {
    const int eb = kv_elem_bytes(kv_type);
    for (int g = 0; g < heads; ++g) {
        const int64_t at = g * head_stride + slot * row_stride;
        kv_store_row(kv_type, src + size_t(g) * dim, dim, static_cast<uint8_t*>(pool) + size_t(at) * eb,
                     scales ? scales + g * scale_head + slot * scale_row : nullptr);
    }
}

struct RouterJob {
    F32DotRowsFn dot;
    const float* w;
    const float* x;
    int E, D, T;
    float* out;
    int chunk;
    std::atomic<int> next{0};
};

void router_job(void* p, int) {
    auto* j = static_cast<RouterJob*>(p);
    for (;;) {
        const int r0 = j->next.fetch_add(j->chunk, std::memory_order_relaxed);
        if (r0 >= j->E) return;
        const int r1 = std::min(j->E, r0 + j->chunk);
        j->dot(j->w, size_t(j->D), r0, r1, j->D, j->x, size_t(j->D), j->T, j->out + r0, size_t(j->E));
    }
}

}  // namespace

// See the file's comment. x [T, D] in/out; h [T, D] and logits [T, E] out (logits unused when the
// layer has no router). Returns 0, or a negative error code.
// LoRA adapters on q/k/v/output (attention_service/model/lora.py): the caller adds each adapted row's
// delta where the products are, without a second pass over the layer. Stage 0: in = the normed input
// [T, D], out = the q|k|v products [T, nq + nk + nv] before biases, norms and rope; stage 1: in = the
// attention output [T, H*Dv], out = its output-projection product [T, D] before the residual add.
// Nonzero from the hook fails the call.

SMK_API int smk_attn_front(const SmkAttnLayer* L, const SmkDecodeStep* S, float* x, float* h, float* logits,
                           SmkLoraHook lora) {
    const int T = S->T, D = L->D, H = L->H, G = L->G, Dk = L->Dk, Dv = L->Dv;
    if (T <= 0 || D <= 0 || H <= 0 || G <= 0 || H % G || Dk <= 0 || Dv <= 0 || L->rope_dims > Dk ||
        L->rope_dims % 2 || L->rope_dims > 1024)
        return -2;
    if (kv_elem_bytes(L->kv_type) == 0 || (L->kv_type == T_Q8_0 && (!L->k_scales || !L->v_scales))) return -1;
    const int nq = H * Dk, nk = G * Dk, nv = G * Dv, nqkv = nq + nk + nv;
    // scratch: normed input [T, D], q|k|v [T, nqkv], attention output [T, H*Dv], the queries
    // [T, H*Dk] as attention reads them; slot 7: this function's own (its callees use 0-6)
    float* buf = reinterpret_cast<float*>(
        scratch(7, sizeof(float) * size_t(T) * (size_t(D) + nqkv + size_t(H) * Dv + size_t(nq))));
    if (!buf) return -3;
    float* hn = buf;
    float* qkv = hn + size_t(T) * D;
    float* att = qkv + size_t(T) * nqkv;
    float* qrows = att + size_t(T) * H * Dv;
    rms_norm_rows(x, T, D, L->attn_norm, L->eps, hn);
    // One sequence (a decode token, or a stream's verification rows): the projections in two int8 terms.
    const auto matmul = S->n_seqs == 1 ? smk_matmul_multi_residual : smk_matmul_multi;
    {
        const int types[3] = {L->q.type, L->k.type, L->v.type};
        const uint8_t* ws[3] = {L->q.w, L->k.w, L->v.w};
        const size_t strides[3] = {size_t(L->q.row_bytes), size_t(L->k.row_bytes), size_t(L->v.row_bytes)};
        const int ns[3] = {nq, nk, nv};
        const int rc = matmul(3, types, ws, strides, ns, D, hn, size_t(D), T, qkv, size_t(nqkv));
        if (rc) return rc;
        if (lora && lora(0, hn, qkv)) return -4;
    }
    for (int t = 0; t < T; ++t) {
        float* q = qkv + size_t(t) * nqkv;
        float* k = q + nq;
        float* v = k + nk;
        const SmkQuantLinear* lin[3] = {&L->q, &L->k, &L->v};
        float* part[3] = {q, k, v};
        for (int i = 0; i < 3; ++i)
            if (lin[i]->bias)
                for (int j = 0; j < lin[i]->rows; ++j) part[i][j] += lin[i]->bias[j];
        if (L->qk_norm == 2) {
            rms_norm_rows(q, 1, nq, L->q_norm, L->eps, q);
            rms_norm_rows(k, 1, nk, L->k_norm, L->eps, k);
        } else if (L->qk_norm == 1) {
            rms_norm_rows(q, H, Dk, L->q_norm, L->eps, q);
            rms_norm_rows(k, G, Dk, L->k_norm, L->eps, k);
        }
        if (L->rope_dims) {
            const float* cs = S->cos + size_t(t) * L->rope_dims;
            const float* sn = S->sin + size_t(t) * L->rope_dims;
            rope_heads(q, H, Dk, L->rope_dims, L->rope_interleaved, cs, sn);
            rope_heads(k, G, Dk, L->rope_dims, L->rope_interleaved, cs, sn);
        }
        write_kv(L->k_pool, L->kv_type, L->k_row, L->k_head, L->k_scales, L->k_scale_row, L->k_scale_head,
                 S->new_slots[t], k, G, Dk);
        write_kv(L->v_pool, L->kv_type, L->v_row, L->v_head, L->v_scales, L->v_scale_row, L->v_scale_head,
                 S->new_slots[t], v, G, Dv);
    }
    for (int t = 0; t < T; ++t) std::memcpy(qrows + size_t(t) * nq, qkv + size_t(t) * nqkv, sizeof(float) * nq);
    int rc = smk_attention(qrows, T, H, G, Dk, Dv, L->k_pool, L->k_row, L->k_head, L->v_pool, L->v_row,
                           L->v_head, L->kv_type, L->k_scales, L->k_scale_row, L->k_scale_head, L->v_scales,
                           L->v_scale_row, L->v_scale_head, S->slots, S->seqs, S->n_seqs, S->q_index, L->scale, L->window,
                           L->sinks, att);
    if (rc) return rc;
    {  // x += att @ Wo^T (+ bias): the product into hn's space (free now), then the add
        const int type = L->o.type;
        const uint8_t* w = L->o.w;
        const size_t stride = size_t(L->o.row_bytes);
        const int n = D;
        rc = matmul(1, &type, &w, &stride, &n, H * Dv, att, size_t(H) * Dv, T, hn, size_t(D));
        if (rc) return rc;
        if (lora && lora(1, att, hn)) return -4;
        for (int t = 0; t < T; ++t)
            for (int i = 0; i < D; ++i) x[size_t(t) * D + i] += hn[size_t(t) * D + i] + (L->o.bias ? L->o.bias[i] : 0.f);
    }
    rms_norm_rows(x, T, D, L->ffn_norm, L->eps, h);
    if (L->router) {
        RouterJob j;
        j.dot = kernels().f32_dot; j.w = L->router; j.x = h; j.E = L->E; j.D = D; j.T = T; j.out = logits;
        const int nt = num_threads();
        j.chunk = std::max(4, (L->E + 2 * nt - 1) / (2 * nt) + 3) / 4 * 4;
        if (nt == 1 || L->E <= j.chunk) router_job(&j, 0); else parallel(router_job, &j);
        if (L->router_bias)
            for (int t = 0; t < T; ++t)
                for (int e = 0; e < L->E; ++e) logits[size_t(t) * L->E + e] += L->router_bias[e];
    }
    return 0;
}

// The front with its router's choice instead of its logits: ids [T, K] int32 and weights [T, K]
// (route.cpp), what a decode layer fused with its experts takes on to (decode_moe_layer.cpp, and
// attention_service/expert_backends/csrc/direct_hop.cpp). Same returns as smk_attn_front.
SMK_API int smk_attn_front_routed(const SmkAttnLayer* L, const SmkDecodeStep* S, float* x, float* h,
                                  const SmkRouting* R, int32_t* ids, float* weights) {
    if (!L->router || L->E != R->E) return -2;
    thread_local std::vector<float> logits;
    logits.resize(size_t(S->T) * L->E);
    const int rc = smk_attn_front(L, S, x, h, logits.data(), nullptr);
    return rc ? rc : smk_route(R, logits.data(), S->T, ids, weights);
}
