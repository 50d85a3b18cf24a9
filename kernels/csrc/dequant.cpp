// Dequantization of every GGML format kernels.quants supports (and IQ4_NL / IQ4_XS, whose reference is
// gguf-py's), bit-identical to it in float32:
// the same float operations in the same order (the build uses -ffp-contract=off, so no fused
// multiply-add changes a rounding). Rows are shared out across the thread pool.

#include "iq_grids.h"
#include "smk.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SMK_X86 1
#endif

namespace smk {
namespace {

// Each writes one block's values to y.
void dq_q8_0(const uint8_t* b, float* y) {
    const float d = ld_fp16(b);
    for (int l = 0; l < 32; ++l) y[l] = d * float(int8_t(b[2 + l]));
}
void dq_q4_0(const uint8_t* b, float* y) {
    const float d = ld_fp16(b);
    for (int l = 0; l < 16; ++l) {
        y[l] = float((b[2 + l] & 15) - 8) * d;
        y[l + 16] = float((b[2 + l] >> 4) - 8) * d;
    }
}
void dq_q4_1(const uint8_t* b, float* y) {
    const float d = ld_fp16(b), m = ld_fp16(b + 2);
    for (int l = 0; l < 16; ++l) {
        y[l] = float(b[4 + l] & 15) * d + m;
        y[l + 16] = float(b[4 + l] >> 4) * d + m;
    }
}
void dq_q5_0(const uint8_t* b, float* y) {
    const float d = ld_fp16(b);
    const uint32_t qh = ld_u32(b + 2);
    for (int l = 0; l < 16; ++l) {
        y[l] = float(int((b[6 + l] & 15) | ((qh >> l) & 1) << 4) - 16) * d;
        y[l + 16] = float(int((b[6 + l] >> 4) | ((qh >> (l + 16)) & 1) << 4) - 16) * d;
    }
}
void dq_q5_1(const uint8_t* b, float* y) {
    const float d = ld_fp16(b), m = ld_fp16(b + 2);
    const uint32_t qh = ld_u32(b + 4);
    for (int l = 0; l < 16; ++l) {
        y[l] = float((b[8 + l] & 15) | ((qh >> l) & 1) << 4) * d + m;
        y[l + 16] = float((b[8 + l] >> 4) | ((qh >> (l + 16)) & 1) << 4) * d + m;
    }
}
void dq_mxfp4(const uint8_t* b, float* y) {
    const float s = e8m0_half(b[0]);
    for (int l = 0; l < 16; ++l) {
        y[l] = float(kMxfp4[b[1 + l] & 15]) * s;
        y[l + 16] = float(kMxfp4[b[1 + l] >> 4]) * s;
    }
}
void dq_q2_k(const uint8_t* b, float* y) {
    const float d = ld_fp16(b + 80), dmin = ld_fp16(b + 82);
    for (int i = 0; i < 256; ++i) {
        const int h = i / 128, s = (i / 32) % 4, l = i % 32;
        const int q = (b[16 + h * 32 + l] >> (2 * s)) & 3;
        const uint8_t sc = b[i / 16];
        const float dl = d * float(sc & 15), ml = dmin * float(sc >> 4);
        y[i] = dl * float(q) - ml;
    }
}
void dq_q3_k(const uint8_t* b, float* y) {
    const float d = ld_fp16(b + 108);
    const uint8_t* s = b + 96;
    float dl[16];
    for (int i = 0; i < 16; ++i) {
        const int low = i < 8 ? s[i] & 15 : s[i - 8] >> 4;
        const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        dl[i] = d * float((low | high << 4) - 32);
    }
    for (int i = 0; i < 256; ++i) {
        const int h = i / 128, sh = (i / 32) % 4, l = i % 32;
        const int low = (b[32 + h * 32 + l] >> (2 * sh)) & 3;
        const int hbit = (b[l] >> (i / 32)) & 1;
        y[i] = dl[i / 16] * float((low | hbit << 2) - 4);
    }
}
template <bool Q5>
void dq_q45_k(const uint8_t* b, float* y) {
    const float d = ld_fp16(b), dmin = ld_fp16(b + 2);
    uint8_t sc[8], mn[8];
    k4_scales(b + 4, sc, mn);
    const uint8_t* qs = b + (Q5 ? 48 : 16);
    for (int j = 0; j < 8; ++j) {
        const float dj = d * float(sc[j]), mj = dmin * float(mn[j]);
        const uint8_t* q = qs + 32 * (j / 2);
        for (int l = 0; l < 32; ++l) {
            int u = (j & 1) ? q[l] >> 4 : q[l] & 15;
            if (Q5) u |= ((b[16 + l] >> j) & 1) << 4;
            y[32 * j + l] = dj * float(u) - mj;
        }
    }
}
void dq_q6_k(const uint8_t* b, float* y) {
    const float d = ld_fp16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int h = 0; h < 2; ++h)
        for (int kk = 0; kk < 4; ++kk) {
            const uint8_t* ql = b + 64 * h + 32 * (kk % 2);
            const uint8_t* qh = b + 128 + 32 * h;
            for (int l = 0; l < 32; ++l) {
                const int i = h * 128 + kk * 32 + l;
                const int lo = (kk / 2) ? ql[l] >> 4 : ql[l] & 15;
                const int q = (lo | ((qh[l] >> (2 * kk)) & 3) << 4) - 32;
                y[i] = (d * float(sc[i / 16])) * float(q);
            }
        }
}
// The IQ4 codes index a table: the 16 products d * code first (the same float operations as
// per value, so the same bits), then one lookup per value (3-4x faster than converting each).
inline void iq4_block(float d, const uint8_t* qs, float* y) {
    float tab[16];
    for (int i = 0; i < 16; ++i) tab[i] = d * float(kIq4nl[i]);
    for (int l = 0; l < 16; ++l) {
        y[l] = tab[qs[l] & 15];
        y[l + 16] = tab[qs[l] >> 4];
    }
}
void dq_iq4_nl(const uint8_t* b, float* y) { iq4_block(ld_fp16(b), b + 2, y); }
void dq_iq4_xs(const uint8_t* b, float* y) {
    const float d = ld_fp16(b);
    for (int ib = 0; ib < 8; ++ib) iq4_block(d * float(iq4xs_scale(b, ib)), b + 8 + 16 * ib, y + 32 * ib);
}
#ifdef SMK_X86
// With AVX2 (any ISA but scalar in use): the codes of a block looked up with two pshufb, widened
// and converted 8 at a time, times d: the same product per value, 2x faster than the table again.
__attribute__((target("avx2"))) inline void iq4_block_avx2(float d, const uint8_t* qs, float* y) {
    const __m128i tbl = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nl));
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), m4 = _mm_set1_epi8(0x0f);
    const __m128i v[2] = {_mm_shuffle_epi8(tbl, _mm_and_si128(x, m4)),
                          _mm_shuffle_epi8(tbl, _mm_and_si128(_mm_srli_epi16(x, 4), m4))};
    const __m256 dv = _mm256_set1_ps(d);
    for (int h = 0; h < 2; ++h) {
        _mm256_storeu_ps(y + 16 * h, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v[h]))));
        _mm256_storeu_ps(y + 16 * h + 8, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v[h], 8)))));
    }
}
__attribute__((target("avx2"))) void dq_iq4_nl_avx2(const uint8_t* b, float* y) { iq4_block_avx2(ld_fp16(b), b + 2, y); }
__attribute__((target("avx2"))) void dq_iq4_xs_avx2(const uint8_t* b, float* y) {
    const float d = ld_fp16(b);
    for (int ib = 0; ib < 8; ++ib) iq4_block_avx2(d * float(iq4xs_scale(b, ib)), b + 8 + 16 * ib, y + 32 * ib);
}
#endif

// The 2- and 3-bit IQ formats: the per-16 scale as gguf-py computes it, times the signed value
// (float multiplication rounds symmetrically: the same bits as gguf-py's scale * grid * sign).
template <class F>
void dq_iq(const uint8_t* b, float* y) {
    const float d = F::d(b);
    int8_t v[32];
    int s[2];
    for (int ib = 0; ib < 8; ++ib) {
        iq_values<F>(b, ib, v, s);
        for (int h = 0; h < 2; ++h) {
            const float db = F::dq(d, s[h]);
            for (int l = 16 * h; l < 16 * h + 16; ++l) y[32 * ib + l] = db * float(v[l]);
        }
    }
}
#ifdef SMK_X86
// With AVX2: each group's 8 signed values widened and converted in registers (measured 1.2-4.5x
// the portable loop above, level with Q4_K's dequantization).
template <class F>
__attribute__((target("avx2"))) void dq_iq_avx2(const uint8_t* b, float* y) {
    const float d = F::d(b);
    for (int ib = 0; ib < 8; ++ib) {
        int s[2];
        F::scales(b, ib, s);
        for (int c = 0; c < 4; ++c) {
            const uint64_t x = iq_signed(F::grid(b, ib, c), kByteMasks.m[F::sign(b, ib, c)]);
            const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(static_cast<long long>(x))));
            _mm256_storeu_ps(y + 32 * ib + 8 * c, _mm256_mul_ps(_mm256_set1_ps(F::dq(d, s[c / 2])), v));
        }
    }
}
#endif
#ifdef SMK_X86
// With AVX-512 (an avx512* ISA in use): the formats of the attention projections and the experts of
// the common files, 16 values a vector, the same float operations per value as the loops above (a
// multiplication, then a subtraction: never fused), so the same bits. A prompt dequantizes each
// attention projection per call (kernels/linear.py): the loops above ran at ~5.8 G values a second
// for Q4_K and ~1.7 for Q6_K on a Zen 5 core, these at several times that.
#define SMK_DQ512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
SMK_DQ512 inline __m512i u8x16(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <bool Q5>
SMK_DQ512 void dq_q45_k_avx512(const uint8_t* b, float* y) {
    const float d = ld_fp16(b), dmin = ld_fp16(b + 2);
    uint8_t sc[8], mn[8];
    k4_scales(b + 4, sc, mn);
    const uint8_t* qs = b + (Q5 ? 48 : 16);
    const __m512i m4 = _mm512_set1_epi32(15), one = _mm512_set1_epi32(1);
    for (int j = 0; j < 8; ++j) {
        const __m512 dj = _mm512_set1_ps(d * float(sc[j])), mj = _mm512_set1_ps(dmin * float(mn[j]));
        const uint8_t* q = qs + 32 * (j / 2);
        for (int h = 0; h < 2; ++h) {
            __m512i u = u8x16(q + 16 * h);
            u = (j & 1) ? _mm512_srli_epi32(u, 4) : _mm512_and_si512(u, m4);
            if (Q5) {
                const __m512i hb = _mm512_and_si512(_mm512_srli_epi32(u8x16(b + 16 + 16 * h), j), one);
                u = _mm512_or_si512(u, _mm512_slli_epi32(hb, 4));
            }
            _mm512_storeu_ps(y + 32 * j + 16 * h, _mm512_sub_ps(_mm512_mul_ps(dj, _mm512_cvtepi32_ps(u)), mj));
        }
    }
}
SMK_DQ512 void dq_q6_k_avx512(const uint8_t* b, float* y) {
    const float d = ld_fp16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const __m512i m4 = _mm512_set1_epi32(15), m2 = _mm512_set1_epi32(3), off = _mm512_set1_epi32(32);
    for (int h = 0; h < 2; ++h)
        for (int kk = 0; kk < 4; ++kk) {
            const uint8_t* ql = b + 64 * h + 32 * (kk % 2);
            const uint8_t* qh = b + 128 + 32 * h;
            for (int half = 0; half < 2; ++half) {
                __m512i lo = u8x16(ql + 16 * half);
                lo = (kk / 2) ? _mm512_srli_epi32(lo, 4) : _mm512_and_si512(lo, m4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(u8x16(qh + 16 * half), 2 * kk), m2);
                const __m512i q = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), off);
                const int i0 = h * 128 + kk * 32 + 16 * half;
                _mm512_storeu_ps(y + i0, _mm512_mul_ps(_mm512_set1_ps(d * float(sc[i0 / 16])), _mm512_cvtepi32_ps(q)));
            }
        }
}
SMK_DQ512 void dq_q8_0_avx512(const uint8_t* b, float* y) {
    const __m512 d = _mm512_set1_ps(ld_fp16(b));
    for (int h = 0; h < 2; ++h) {
        const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * h)));
        _mm512_storeu_ps(y + 16 * h, _mm512_mul_ps(d, _mm512_cvtepi32_ps(q)));
    }
}
// n (a multiple of 16) floats to bfloat16 bits as f32_to_bf16 rounds them (to nearest even, NaN as torch).
SMK_DQ512 void to_bf16_avx512(const float* x, uint16_t* y, int n) {
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), qnan = _mm512_set1_epi32(0x7fc0);
    for (int i = 0; i < n; i += 16) {
        const __m512i b = _mm512_castps_si512(_mm512_loadu_ps(x + i));
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, abs), inf);
        __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, half), _mm512_and_si512(_mm512_srli_epi32(b, 16), one));
        r = _mm512_mask_mov_epi32(_mm512_srli_epi32(r, 16), nan, qnan);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), _mm512_cvtepi32_epi16(r));
    }
}
#undef SMK_DQ512
#endif
void dq_f16(const uint8_t* b, float* y) { *y = ld_fp16(b); }
void dq_bf16(const uint8_t* b, float* y) {
    uint32_t bits = uint32_t(b[0] | b[1] << 8) << 16;
    std::memcpy(y, &bits, 4);
}
void dq_f32(const uint8_t* b, float* y) { std::memcpy(y, b, 4); }

typedef void (*BlockFn)(const uint8_t*, float*);

// Whether the ISA in use (which SPLITMOE_KERNELS_ISA may lower) has AVX2.
bool use_avx2() {
#ifdef SMK_X86
    return std::strcmp(kernels().name, "scalar") != 0;
#else
    return false;
#endif
}
// Whether it has AVX-512 (the avx512bw and avx512vnni kernel sets).
bool use_avx512() {
#ifdef SMK_X86
    return std::strncmp(kernels().name, "avx512", 6) == 0;
#else
    return false;
#endif
}

BlockFn block_fn(int type) {
    switch (type) {
        case T_F32: return dq_f32;
        case T_F16: return dq_f16;
        case T_BF16: return dq_bf16;
        case T_Q4_0: return dq_q4_0;
        case T_Q4_1: return dq_q4_1;
        case T_Q5_0: return dq_q5_0;
        case T_Q5_1: return dq_q5_1;
        case T_MXFP4: return dq_mxfp4;
        case T_Q2_K: return dq_q2_k;
        case T_Q3_K: return dq_q3_k;
#ifdef SMK_X86
        case T_Q8_0: return use_avx512() ? dq_q8_0_avx512 : dq_q8_0;
        case T_Q4_K: return use_avx512() ? dq_q45_k_avx512<false> : dq_q45_k<false>;
        case T_Q5_K: return use_avx512() ? dq_q45_k_avx512<true> : dq_q45_k<true>;
        case T_Q6_K: return use_avx512() ? dq_q6_k_avx512 : dq_q6_k;
#else
        case T_Q8_0: return dq_q8_0;
        case T_Q4_K: return dq_q45_k<false>;
        case T_Q5_K: return dq_q45_k<true>;
        case T_Q6_K: return dq_q6_k;
#endif
#ifdef SMK_X86
        case T_IQ4_NL: return use_avx2() ? dq_iq4_nl_avx2 : dq_iq4_nl;
        case T_IQ4_XS: return use_avx2() ? dq_iq4_xs_avx2 : dq_iq4_xs;
#else
        case T_IQ4_NL: return dq_iq4_nl;
        case T_IQ4_XS: return dq_iq4_xs;
#endif
#ifdef SMK_X86
        case T_IQ2_XXS: return use_avx2() ? dq_iq_avx2<IQ2XXS> : dq_iq<IQ2XXS>;
        case T_IQ2_XS: return use_avx2() ? dq_iq_avx2<IQ2XS> : dq_iq<IQ2XS>;
        case T_IQ2_S: return use_avx2() ? dq_iq_avx2<IQ2S> : dq_iq<IQ2S>;
        case T_IQ3_XXS: return use_avx2() ? dq_iq_avx2<IQ3XXS> : dq_iq<IQ3XXS>;
        case T_IQ1_S: return use_avx2() ? dq_iq_avx2<IQ1S> : dq_iq<IQ1S>;
        case T_IQ1_M: return use_avx2() ? dq_iq_avx2<IQ1M> : dq_iq<IQ1M>;
        case T_IQ3_S: return use_avx2() ? dq_iq_avx2<IQ3S> : dq_iq<IQ3S>;
#else
        case T_IQ2_XXS: return dq_iq<IQ2XXS>;
        case T_IQ2_XS: return dq_iq<IQ2XS>;
        case T_IQ2_S: return dq_iq<IQ2S>;
        case T_IQ3_XXS: return dq_iq<IQ3XXS>;
        case T_IQ1_S: return dq_iq<IQ1S>;
        case T_IQ1_M: return dq_iq<IQ1M>;
        case T_IQ3_S: return dq_iq<IQ3S>;
#endif
        default: return nullptr;
    }
}

struct DqJob {
    BlockFn fn;
    TypeInfo ti;
    const uint8_t* w;
    size_t wstride;
    int k;
    const int64_t* rows;
    int nrows;
    bool bf16;
    bool vector_bf16;  // bf16 rounded 16 values a vector (AVX-512, whole vectors a block)
    void* out;
};

void dq_range(const DqJob& j, int i0, int i1) {
    float tmp[256];
    const int nb = j.k / j.ti.elems;
    for (int i = i0; i < i1; ++i) {
        const int64_t src = j.rows ? j.rows[i] : i;
        const uint8_t* row = j.w + size_t(src) * j.wstride;
        if (!j.bf16) {
            float* y = static_cast<float*>(j.out) + size_t(i) * j.k;
            for (int b = 0; b < nb; ++b) j.fn(row + size_t(b) * j.ti.bytes, y + size_t(b) * j.ti.elems);
        } else {
            uint16_t* y = static_cast<uint16_t*>(j.out) + size_t(i) * j.k;
            for (int b = 0; b < nb; ++b) {
                j.fn(row + size_t(b) * j.ti.bytes, tmp);
#ifdef SMK_X86
                if (j.vector_bf16) {
                    to_bf16_avx512(tmp, y + size_t(b) * j.ti.elems, j.ti.elems);
                    continue;
                }
#endif
                for (int l = 0; l < j.ti.elems; ++l) y[size_t(b) * j.ti.elems + l] = f32_to_bf16(tmp[l]);
            }
        }
    }
}

}  // namespace
}  // namespace smk

using namespace smk;

SMK_API int smk_can_dequantize(int type) { return block_fn(type) != nullptr; }

// out[nrows, k] (float32, or bfloat16 bits if out_bf16) = the rows (all n, or rows[i]) of w.
SMK_API int smk_dequantize(int type, const uint8_t* w, size_t wstride, int n, int k, const int64_t* rows,
                           int nrows, int out_bf16, void* out) {
    DqJob j;
    j.fn = block_fn(type);
    if (!j.fn) return -1;
    j.ti = type_info(type);
    if (n < 0 || k <= 0 || k % j.ti.elems || wstride < size_t(k / j.ti.elems) * j.ti.bytes) return -2;
    if (!rows) nrows = n;
    for (int i = 0; rows && i < nrows; ++i)
        if (rows[i] < 0 || rows[i] >= n) return -4;
    if (nrows <= 0) return 0;
    j.w = w; j.wstride = wstride; j.k = k; j.rows = rows; j.nrows = nrows; j.bf16 = out_bf16 != 0; j.out = out;
    j.vector_bf16 = j.bf16 && use_avx512() && j.ti.elems % 16 == 0;
    // one row (an embedding lookup) stays on the calling thread: there is nothing to share out
    parallel_rows(nrows, nrows == 1 ? 0 : int64_t(nrows) * k, [&](int i0, int i1) { dq_range(j, i0, i1); });
    return 0;
}
