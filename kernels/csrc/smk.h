// SplitMoE native kernels (smk): shared declarations.
//
// Plain C++17, no Python or torch headers: the library is loaded with ctypes (kernels/native.py).
// Weights are read straight from the GGUF block layout, or from copies packed by 16 rows at load
// (repack.cpp); activations are quantized once per call to int8 with one float scale per 32 values
// (see Act below).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#define SMK_API extern "C" __attribute__((visibility("default")))
// For small kernels called per key or row inside a hot loop, which GCC would otherwise keep as calls
// (and then spill their register accumulators to the stack).
#define SMK_ALWAYS_INLINE inline __attribute__((always_inline))

// The router's rule (route.cpp smk_route), shared by its callers.
struct SmkRouting {
    int32_t E, K;
    int32_t gating;       // 0 softmax, 1 sigmoid, 2 softmax_weight (kernels/decode_moe_layer.py Gating)
    int32_t renormalize;
    float scale;
    const float* selection_bias;  // [E] or null: added to choose, not to weigh
};

// The pieces of a decode layer that other sources call: the attention front, alone or with its
// router's choice (decode_layer.cpp), the router (route.cpp), an MoE layer (moe.cpp), and the pool's parking (runtime.cpp).
struct SmkAttnLayer;
struct SmkDecodeStep;
struct SmkExpert;
typedef int (*SmkLoraHook)(int stage, const float* in, float* out);
SMK_API int smk_attn_front(const SmkAttnLayer* L, const SmkDecodeStep* S, float* x, float* h, float* logits,
                           SmkLoraHook lora);
SMK_API int smk_route(const SmkRouting* R, const float* logits, int T, int32_t* ids, float* weights);
SMK_API int smk_attn_front_routed(const SmkAttnLayer* L, const SmkDecodeStep* S, float* x, float* h,
                                  const SmkRouting* R, int32_t* ids, float* weights);
SMK_API int smk_moe_forward(const SmkExpert* experts, const int32_t* expert_index, int num_experts, int D, int F,
                            const float* x, int T, int topk, const int32_t* ids, const float* weights, float* out);
SMK_API void smk_park();

namespace smk {

// GGML type ids (ggml.h / gguf-py GGMLQuantizationType).
enum GgmlType : int {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ2_XXS = 16, T_IQ2_XS = 17,
    T_IQ3_XXS = 18, T_IQ1_S = 19, T_IQ4_NL = 20, T_IQ3_S = 21, T_IQ2_S = 22, T_IQ4_XS = 23, T_IQ1_M = 29,
    T_BF16 = 30, T_MXFP4 = 39,
};

// Elements and bytes per block; 0 if unknown.
struct TypeInfo { int elems; int bytes; };
TypeInfo type_info(int type);

// ---- quantized activations ------------------------------------------------------------------
// One activation row (token) of k values, quantized per block of 32:
//   q[i]       int8, x[i] ~ d[i/32] * q[i], |q| <= 127
//   d[j]       the block's scale
//   s[j]       d[j] * sum(q of block j)  (for the formats with a per-block min/offset)
//   dx[8j..8j+7] d[j] repeated 8 times: one float per int32 lane of a 32-byte dot product, so a
//              512-bit register of 16 such lanes covers two blocks with one aligned load.
// Rows are padded with zero blocks to a multiple of 64 values (kpad), so 64-value kernels never
// read past a row's end for the activations.
//
// The AVX-512 k-quant and MXFP4 kernels also read a second, permuted copy (filled only by their ISA's
// quantize, for the whole 256-value groups of a row; other ISAs leave it unwritten and never read it):
//   qp[256S + 64c + 8s + j] = q[256S + 32s + 8c + j]   (S super-block, c 0..3, s 0..7, j 0..7)
//              i.e. each 64-byte quarter holds 8 values of every 32-block, so the four maddubs
//              results of a super-block can be summed in int16 before one madd with the
//              sub-block scales, and float conversion happens once per super-block;
//   d2[16S + 2s + i] = d[8S + s]  (i 0..1): the scale of each int32 lane of such a dot;
//   s16[i]     d[i/2] * sum(q of the 16 values 16i .. 16i+15) (Q6_K's -32 offset).
struct Act {
    const int8_t* q;
    const float* dx;
    const float* d;
    const float* s;
    const int8_t* qp;
    const float* d2;
    const float* s16;
};

inline size_t act_kpad(int k) { return (size_t(k) + 63) / 64 * 64; }
inline size_t act_round64(size_t n) { return (n + 63) / 64 * 64; }
// Bytes of one activation record (q | dx | d | s | qp | d2 | s16, each 64-byte aligned).
inline size_t act_bytes(int k) {
    size_t kp = act_kpad(k);
    return kp + kp * sizeof(float) / 4 + 2 * act_round64(kp / 32 * sizeof(float)) + kp +
           2 * act_round64(kp / 16 * sizeof(float));
}
inline Act act_at(uint8_t* rec, int k) {
    size_t kp = act_kpad(k);
    const size_t blk = act_round64(kp / 32 * sizeof(float)), half = act_round64(kp / 16 * sizeof(float));
    Act a;
    a.q = reinterpret_cast<const int8_t*>(rec);
    a.dx = reinterpret_cast<const float*>(rec + kp);
    a.d = reinterpret_cast<const float*>(rec + 2 * kp);
    a.s = reinterpret_cast<const float*>(rec + 2 * kp + blk);
    a.qp = reinterpret_cast<const int8_t*>(rec + 2 * kp + 2 * blk);
    a.d2 = reinterpret_cast<const float*>(rec + 3 * kp + 2 * blk);
    a.s16 = reinterpret_cast<const float*>(rec + 3 * kp + 2 * blk + half);
    return a;
}

// ---- kernel table (one per ISA) -------------------------------------------------------------
// Dot weight rows [r0, r1) (row r at w + r * wstride, GGUF block layout, k values) with m
// activation rows: out[t * ostride + (r - r0)] = dot(row r, act t).
typedef void (*DotRowsFn)(const uint8_t* w, size_t wstride, int r0, int r1, int k,
                          const Act* acts, int m, float* out, size_t ostride);
// Quantize n float rows of k values (row i at x + i * xstride) into records at rec + i * act_bytes(k).
typedef void (*QuantizeFn)(const float* x, size_t xstride, int n, int k, uint8_t* rec);

// ---- decode attention (attention.cpp) ------------------------------------------------------
// One call's shapes and KV cache: queries [T, H, Dk] float32, head h = g * R + r for kv head g;
// key row of context slot s and kv head g at k + (g * k_head_stride + s * k_row_stride) elements
// (values likewise; MLA passes the key pool again with Dv < Dk: its latent is also its value).
// The KV cache's fp8 formats (`--kv-cache-dtype fp8_e4m3|fp8_e5m2`): no GGML type has these ids.
constexpr int kKvFp8E4M3 = 240, kKvFp8E5M2 = 241;
struct AttnArgs {
    const float* q;
    int T, H, G, R, Dk, Dv;
    const void* k;
    int64_t k_row_stride, k_head_stride;
    const void* v;
    int64_t v_row_stride, v_head_stride;
    int kv_type;           // T_F32, T_BF16, T_Q8_0 (int8 values, float16 scales below), kKvFp8E4M3/E5M2
    int elem_bytes;        // bytes a value: 4, 2 or 1
    // q8_0 only: the float16 scale of each 32 values; the scales of row (slot s, kv head g) at
    // k_scales + g * k_scale_head + s * k_scale_row (values likewise)
    const uint16_t* k_scales;
    int64_t k_scale_row, k_scale_head;
    const uint16_t* v_scales;
    int64_t v_scale_row, v_scale_head;
    const int64_t* slots;  // every sequence's context slots, concatenated
    float scale;
};
// One work unit: the R heads of kv head g for one query row, over context indices [c0, c1) of the
// slots at args->slots + slot_base. Writes per head the max score, the sum of exp(score - max)
// and the sum of exp(score - max) * value row (unnormalised, for the merge of split contexts).
struct AttnUnit {
    const AttnArgs* args;
    const float* q;  // the R query rows
    int g;
    int64_t slot_base;
    int c0, c1;
    float* max;  // [R]
    float* sum;  // [R]
    float* acc;  // [R, Dv]
};
typedef void (*AttnUnitFn)(const AttnUnit& u);
// One prompt-sized work unit (attention_tiled.inc): kv head g for the query rows [t0, t0 + nt) of
// one sequence, whose context slots start at `slots`; row t sees context indices
// (q_index[t] - window, q_index[t]] (window 0: [0, q_index[t]]). Writes those rows' R heads of out.
struct AttnTile {
    const AttnArgs* args;
    int g, t0, nt, window;
    const int64_t* slots;
    const int64_t* q_index;
    const float* sinks;  // [H] or null
    float* out;          // [T, H, Dv]
};
typedef void (*AttnTileFn)(const AttnTile& u);

// float32 weight rows [r0, r1) (row r at w + r * wstride floats, k values) against m float32
// activation rows (row t at x + t * xstride): out[t * ostride + (r - r0)] = dot. The router's
// product, which stays float32 (routing is where precision matters most).
typedef void (*F32DotRowsFn)(const float* w, size_t wstride, int r0, int r1, int k, const float* x, size_t xstride,
                             int m, float* out, size_t ostride);
// An expert FFN's gated activation over n values, in place: g = act(g + gb) * (u + ub) (gb, ub
// may be null). kind kGluSilu: SiLU; kGluSwigluOai: gpt-oss's clamped SwiGLU, (u + 1) * g * sigmoid(alpha g)
// with g <= limit and |u| <= limit.
enum { kGluSilu = 0, kGluSwigluOai = 1 };
constexpr float kGluOaiAlpha = 1.702f, kGluOaiLimit = 7.0f;
typedef void (*GluFn)(float* g, const float* u, const float* gb, const float* ub, int n, int kind);
// Weights packed at load by 16 rows (repack.cpp): a packed weight's "row stride" is its group
// stride, r0 and r1 are multiples of kPackRows, and row r's output still goes to column r - r0.
constexpr int kPackRows = 16;
constexpr int kQ4KX16Bytes = 64 + 128 + 128 + 2048;  // one group's super-block
constexpr int kQ6KX16Bytes = 32 + 256 + 2048 + 1024 + 32;
// Packed Q6_K's 32-value sub-block s as 384 contiguous bytes at 288 + 384 s: its four low-nibble
// registers (4 s .. 4 s + 3), then its two top-bit registers (pairs 2 s, 2 s + 1), read in that order.
constexpr int q6k_x16_lo(int i) { return 288 + 384 * (i / 4) + 64 * (i % 4); }   // register i, 0..31
constexpr int q6k_x16_hi(int p) { return 288 + 384 * (p / 2) + 256 + 64 * (p % 2); }  // pair p, 0..15
constexpr int kQ80X16Bytes = 32 + 512;     // one group's 32-value block
constexpr int kMxfp4X16Bytes = 16 + 256;  // one group's 32-value block
int packed_unit(int type);  // values a packed block covers: 256 (k-quants), 32 (Q8_0, MXFP4)
int packed_bytes(int type);  // a group's packed block (packed_unit values), 0: no packed layout for the type
// The type field of a packed weight (SmkExpert, smk_matmul_multi): its GGML type with this bit set.
constexpr int kPackedBit = 0x100;

struct Kernels {
    const char* name;
    QuantizeFn quantize;
    DotRowsFn dot[64];  // by GGML type id; null: no native matmul for that type
    DotRowsFn packed[64];     // packed weights (every ISA has at least the portable kernel)
    bool packed_fast[64];     // whether packed[type] is this ISA's SIMD kernel (packing pays)
    AttnUnitFn attn_unit;
    AttnTileFn attn_tile;
    F32DotRowsFn f32_dot;
    GluFn glu;
};

void init_scalar(Kernels& k);
void init_packed_scalar(Kernels& k);  // repack.cpp
void init_avx2(Kernels& k);      // fills only what it implements on top of scalar
void init_avx512(Kernels& k);
void init_avx512vnni(Kernels& k);
void init_avx512vbmi(Kernels& k);  // only the IQ3_XXS entry, over the VNNI table
void init_attention_scalar(Kernels& k);  // attention.cpp and its ISA variants (attention_*.cpp)
void init_attention_avx2(Kernels& k);
void init_attention_avx512(Kernels& k);

const Kernels& kernels();  // the table for the ISA in use
// The kernel for a weight's type field (kPackedBit: packed), or null if there is none.
inline DotRowsFn dot_for(const Kernels& K, int type) {
    const int t = type & ~kPackedBit;
    if (t < 0 || t >= 64 || (type & ~(kPackedBit | 63))) return nullptr;
    return (type & kPackedBit) ? K.packed[t] : K.dot[t];
}

// ---- row routines (the decode front and a prompt's rows alike) -------------------------------
// One row's RMS norm (norm.cpp): out[j] = x[j] / sqrt(mean(x^2) + eps) * w[j], the same bits on every ISA.
void rms_norm_row(const float* x, int n, const float* w, float eps, float* out);
// Rotary embedding of each of `heads` rows of head_dim floats at x, in place, over their first dims
// (rope.cpp): x[i] cos[i] + x[partner(i)] sin[i], rounded as the torch path rounds it.
void rope_heads(float* x, int heads, int head_dim, int dims, bool interleaved, const float* cos, const float* sin);

// ---- thread pool ----------------------------------------------------------------------------
// Runs fn(ctx, tid) on every pool thread and the caller (tid 0) and returns when all are done.
// Work is shared out by the job itself (atomic counters), so any number of participants is
// correct: when the pool is busy with another caller's job, the caller runs the job alone.
typedef void (*JobFn)(void* ctx, int tid);
void parallel(JobFn fn, void* ctx);
int num_threads();

// fn(r0, r1) over rows [0, rows) in chunks shared out across the pool (about 4 a thread), or on the
// calling thread alone for one thread or little work (`values`: what the rows hold together).
template <class Fn>
void parallel_rows(int rows, int64_t values, const Fn& fn) {
    const int nt = num_threads();
    if (nt == 1 || values < (int64_t(1) << 15)) {
        fn(0, rows);
        return;
    }
    struct Job {
        const Fn* fn;
        int rows, chunk;
        std::atomic<int> next{0};
    } job{&fn, rows, (rows + nt * 4 - 1) / (nt * 4)};
    parallel([](void* p, int) {
        auto* j = static_cast<Job*>(p);
        for (;;) {
            const int r0 = j->next.fetch_add(j->chunk, std::memory_order_relaxed);
            if (r0 >= j->rows) return;
            (*j->fn)(r0, r0 + j->chunk < j->rows ? r0 + j->chunk : j->rows);
        }
    }, &job);
}

// A 64-byte aligned buffer of at least n bytes owned by the calling thread, reused across calls
// (no allocation, no fresh pages to fault in per call). `slot` tells apart the buffers one call
// needs at once. Valid until the same thread asks for the same slot again. Slots: 0 the matmuls'
// activations, 1-5 the MoE layer, 6 attention, 7 the attention front, 8-9 the two-term matmul.
constexpr int kScratchSlots = 10;
uint8_t* scratch(int slot, size_t n);

// ---- scalar helpers -------------------------------------------------------------------------
inline float fp16_to_f32(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalize
        int e = -1;
        do { man <<= 1; ++e; } while (!(man & 0x400));
        bits = sign | uint32_t(112 - e) << 23 | ((man & 0x3ff) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
inline float ld_fp16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return fp16_to_f32(h);
}
// MXFP4's E8M0 byte as 2**(e - 128): the doubled e2m1 codes times this give the value.
inline float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? (0x00200000u << e) : (uint32_t(e) - 1) << 23;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
inline uint16_t f32_to_bf16(float f) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN, as torch rounds it
    return uint16_t((b + 0x7fffu + ((b >> 16) & 1)) >> 16);
}
inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
inline uint32_t ld_u32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}
// Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins.
inline void k4_scales(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t a = ld_u32(s), b = ld_u32(s + 4), c = ld_u32(s + 8);
    uint32_t s0 = a & 0x3f3f3f3fu, m0 = b & 0x3f3f3f3fu;
    uint32_t s1 = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
    uint32_t m1 = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
    std::memcpy(sc, &s0, 4); std::memcpy(sc + 4, &s1, 4);
    std::memcpy(mn, &m0, 4); std::memcpy(mn + 4, &m1, 4);
}

// IQ4_XS: the 6-bit scale of 32-value sub-block ib (0..7) of the super-block at b, offset removed.
// Layout: d (fp16) | scales_h (u16, 2 bits per sub-block) | scales_l (4 bytes, a nibble each) | qs[128].
inline int iq4xs_scale(const uint8_t* b, int ib) {
    const unsigned h = unsigned(b[2]) | unsigned(b[3]) << 8;
    return int(((b[4 + ib / 2] >> (4 * (ib % 2))) & 15) | ((h >> (2 * ib)) & 3) << 4) - 32;
}

extern const int8_t kMxfp4[16];  // doubled e2m1 code points
extern const int8_t kIq4nl[16];  // IQ4_NL / IQ4_XS non-linear code points

}  // namespace smk
