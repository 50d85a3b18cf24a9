// AVX2 + FMA kernels (Haswell and later, Zen): one 32-value block per 256-bit register.
// Same arithmetic as the AVX-512 kernels (dot_avx512.inc), half the width.
#if defined(__x86_64__) || defined(__i386__)  // other CPUs get the scalar kernels only
#include <immintrin.h>

#include <cstring>

#include "iq_grids.h"
#include "smk.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,bmi2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
#endif

namespace smk {
namespace avx2 {
namespace {

inline __m256i ld256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
constexpr int kPrefetch = 2048;  // as in dot_avx512.inc
inline void prefetch_block(const uint8_t* b, int bytes) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetch + o), _MM_HINT_T0);
}
inline float half(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
// 16 quant bytes -> 32 values: low nibbles (elements 0-15), then high nibbles (16-31).
inline __m256i nibbles(const uint8_t* q) {
    __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i m4 = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), m4), _mm_and_si128(x, m4));
}
// 0xff in byte l where bit l of the 32-bit mask is set.
inline __m256i bits_to_bytes(uint32_t bits) {
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)),
                                    _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                     2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bm = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bm), bm);
}

// One decoded 32-value block: value = D * S16[lane] * V (signed) or D * S16 * U + M (unsigned).
struct Blk {
    __m256i W;    // V (signed formats) or U
    __m256i S16;  // int16 scale per pair of values
    float D, M;
};
struct SbState {};  // decoder state (none needed by the 32-value formats)

inline __m256i ones16() { return _mm256_set1_epi16(1); }

struct D_Q8_0 {
    static constexpr bool SIGNED = true, MIN = false;
    static void dec(const uint8_t* row, int j, SbState&, Blk& b) {
        const uint8_t* p = row + size_t(j) * 34;
        b.W = ld256(p + 2); b.S16 = ones16(); b.D = half(p); b.M = 0.f;
    }
};
struct D_Q4_0 {
    static constexpr bool SIGNED = true, MIN = false;
    static void dec(const uint8_t* row, int j, SbState&, Blk& b) {
        const uint8_t* p = row + size_t(j) * 18;
        b.W = _mm256_sub_epi8(nibbles(p + 2), _mm256_set1_epi8(8)); b.S16 = ones16(); b.D = half(p); b.M = 0.f;
    }
};
struct D_Q4_1 {
    static constexpr bool SIGNED = false, MIN = true;
    static void dec(const uint8_t* row, int j, SbState&, Blk& b) {
        const uint8_t* p = row + size_t(j) * 20;
        b.W = nibbles(p + 4); b.S16 = ones16(); b.D = half(p); b.M = half(p + 2);
    }
};
struct D_Q5_0 {
    static constexpr bool SIGNED = true, MIN = false;
    static void dec(const uint8_t* row, int j, SbState&, Blk& b) {
        const uint8_t* p = row + size_t(j) * 22;
        __m256i u = _mm256_or_si256(nibbles(p + 6), _mm256_and_si256(bits_to_bytes(ld_u32(p + 2)), _mm256_set1_epi8(16)));
        b.W = _mm256_sub_epi8(u, _mm256_set1_epi8(16)); b.S16 = ones16(); b.D = half(p); b.M = 0.f;
    }
};
struct D_Q5_1 {
    static constexpr bool SIGNED = false, MIN = true;
    static void dec(const uint8_t* row, int j, SbState&, Blk& b) {
        const uint8_t* p = row + size_t(j) * 24;
        b.W = _mm256_or_si256(nibbles(p + 8), _mm256_and_si256(bits_to_bytes(ld_u32(p + 4)), _mm256_set1_epi8(16)));
        b.S16 = ones16(); b.D = half(p); b.M = half(p + 2);
    }
};
struct D_MXFP4 {
    static constexpr bool SIGNED = true, MIN = false;
    static void dec(const uint8_t* row, int j, SbState&, Blk& b) {
        const uint8_t* p = row + size_t(j) * 17;
        const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4)));
        b.W = _mm256_shuffle_epi8(tbl, nibbles(p + 1)); b.S16 = ones16(); b.D = e8m0_half(p[0]); b.M = 0.f;
    }
};
// IQ4_NL: the nibbles index the 16 non-linear code points (one pshufb), then a signed format.
inline __m256i iq4_table() {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nl)));
}
struct D_IQ4_NL {
    static constexpr bool SIGNED = true, MIN = false;
    static void dec(const uint8_t* row, int j, SbState&, Blk& b) {
        const uint8_t* p = row + size_t(j) * 18;
        b.W = _mm256_shuffle_epi8(iq4_table(), nibbles(p + 2)); b.S16 = ones16(); b.D = half(p); b.M = 0.f;
    }
};
// ---- k-quants, a super-block at a time (scales decoded once per super-block) ----------------

inline __m128i k4_scales_simd(const uint8_t* p) {  // as in dot_avx512.inc
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i low = _mm_and_si128(x, _mm_set1_epi8(0x3f));
    const __m128i top = _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(x, 6), _mm_set1_epi8(0x03)), 4);
    const __m128i cc = _mm_srlv_epi32(_mm_shuffle_epi32(x, 0xaa), _mm_setr_epi32(0, 4, 0, 0));
    const __m128i hi = _mm_or_si128(_mm_and_si128(cc, _mm_set1_epi8(0x0f)), top);
    return _mm_unpacklo_epi32(low, hi);
}
inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

template <bool Q5, int NT>
void k45_tile(const uint8_t* row, int nsb, const Act* A, float* res) {
    constexpr int BYTES = Q5 ? 176 : 144;
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int sb = 0; sb < nsb; ++sb) {
        const uint8_t* b = row + size_t(sb) * BYTES;
        prefetch_block(b, BYTES);
        const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(int(ld_u32(b))));
        const __m128i sm = k4_scales_simd(b + 4);
        const __m256i scx = _mm256_broadcastsi128_si256(sm);
        const __m256 mf = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(sm, sm))),
                                        _mm256_set1_ps(_mm_cvtss_f32(_mm_movehdup_ps(dd))));
        const uint8_t* qs = b + (Q5 ? 48 : 16);
        __m256 sacc[NT];
        for (int t = 0; t < NT; ++t) sacc[t] = _mm256_setzero_ps();
        for (int c = 0; c < 4; ++c) {
            const __m256i q = ld256(qs + 32 * c);
            __m256i U0 = _mm256_and_si256(q, m4), U1 = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if (Q5) {
                const __m256i h = _mm256_srl_epi16(ld256(b + 16), _mm_cvtsi32_si128(2 * c));
                const __m256i one = _mm256_set1_epi8(1);
                U0 = _mm256_or_si256(U0, _mm256_slli_epi16(_mm256_and_si256(h, one), 4));
                U1 = _mm256_or_si256(U1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 1), one), 4));
            }
            // int16 scale lanes: byte 2c (2c+1) of the scales, zero-extended (0x80 gives a zero byte)
            const __m256i S0 = _mm256_shuffle_epi8(scx, _mm256_set1_epi16(short(0x8000 | (2 * c))));
            const __m256i S1 = _mm256_shuffle_epi8(scx, _mm256_set1_epi16(short(0x8000 | (2 * c + 1))));
            for (int t = 0; t < NT; ++t) {
                const int8_t* aq = A[t].q + size_t(sb) * 256 + 64 * c;
                const float* ad = A[t].d + size_t(sb) * 8 + 2 * c;
                const __m256i i0 = _mm256_madd_epi16(_mm256_maddubs_epi16(U0, ld256(aq)), S0);
                const __m256i i1 = _mm256_madd_epi16(_mm256_maddubs_epi16(U1, ld256(aq + 32)), S1);
                sacc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_broadcast_ss(ad), sacc[t]);
                sacc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_broadcast_ss(ad + 1), sacc[t]);
            }
        }
        const __m256 dv = _mm256_set1_ps(_mm_cvtss_f32(dd));
        for (int t = 0; t < NT; ++t) {
            acc[t] = _mm256_fmadd_ps(sacc[t], dv, acc[t]);
            acc[t] = _mm256_fnmadd_ps(mf, _mm256_loadu_ps(A[t].s + size_t(sb) * 8), acc[t]);
        }
    }
    for (int t = 0; t < NT; ++t) res[t] = hsum(acc[t]);
}

template <int NT>
void q6k_tile(const uint8_t* row, int nsb, const Act* A, float* res) {
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f), m3 = _mm256_set1_epi8(0x03), c32 = _mm256_set1_epi8(32);
    alignas(32) int16_t sc[16];
    for (int sb = 0; sb < nsb; ++sb) {
        const uint8_t* b = row + size_t(sb) * 210;
        prefetch_block(b, 210);
        _mm256_store_si256(reinterpret_cast<__m256i*>(sc), _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
        __m256 sacc[NT];
        for (int t = 0; t < NT; ++t) sacc[t] = _mm256_setzero_ps();
        for (int h = 0; h < 2; ++h) {
            const __m256i ql0 = ld256(b + 64 * h), ql1 = ld256(b + 64 * h + 32), qh = ld256(b + 128 + 32 * h);
            for (int kk = 0; kk < 4; ++kk) {
                const int sub = 4 * h + kk;
                const __m256i ql = kk & 1 ? ql1 : ql0;
                const __m256i lo = _mm256_and_si256(kk >= 2 ? _mm256_srli_epi16(ql, 4) : ql, m4);
                const __m256i hb = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * kk)), m3), 4);
                const __m256i v = _mm256_sub_epi8(_mm256_or_si256(lo, hb), c32);
                const __m256i U = _mm256_sign_epi8(v, v);
                const __m256i S = _mm256_set_m128i(_mm_set1_epi16(sc[2 * sub + 1]), _mm_set1_epi16(sc[2 * sub]));
                for (int t = 0; t < NT; ++t) {
                    const __m256i a = _mm256_sign_epi8(ld256(A[t].q + size_t(sb) * 256 + 32 * sub), v);
                    const __m256i i32 = _mm256_madd_epi16(_mm256_maddubs_epi16(U, a), S);
                    sacc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), _mm256_broadcast_ss(A[t].d + size_t(sb) * 8 + sub), sacc[t]);
                }
            }
        }
        const __m256 dv = _mm256_set1_ps(half(b + 208));
        for (int t = 0; t < NT; ++t) acc[t] = _mm256_fmadd_ps(sacc[t], dv, acc[t]);
    }
    for (int t = 0; t < NT; ++t) res[t] = hsum(acc[t]);
}

// IQ4_XS: 8 sub-blocks of 32 with IQ4_NL's nibble layout and a 6-bit scale each (ls - 32), applied
// by the int16 madd (|maddubs| <= 2 * 127 * 127 = 32258, times |ls - 32| <= 32: no overflow).
template <int NT>
void iq4xs_tile(const uint8_t* row, int nsb, const Act* A, float* res) {
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    const __m256i tbl = iq4_table();
    for (int sb = 0; sb < nsb; ++sb) {
        const uint8_t* b = row + size_t(sb) * 136;
        prefetch_block(b, 136);
        __m256 sacc[NT];
        for (int t = 0; t < NT; ++t) sacc[t] = _mm256_setzero_ps();
        for (int ib = 0; ib < 8; ++ib) {
            const __m256i v = _mm256_shuffle_epi8(tbl, nibbles(b + 8 + 16 * ib));
            const __m256i U = _mm256_sign_epi8(v, v);
            const __m256i S = _mm256_set1_epi16(short(iq4xs_scale(b, ib)));
            for (int t = 0; t < NT; ++t) {
                const __m256i a = _mm256_sign_epi8(ld256(A[t].q + size_t(sb) * 256 + 32 * ib), v);
                const __m256i i32 = _mm256_madd_epi16(_mm256_maddubs_epi16(U, a), S);
                sacc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), _mm256_broadcast_ss(A[t].d + size_t(sb) * 8 + ib), sacc[t]);
            }
        }
        const __m256 dv = _mm256_set1_ps(half(b));
        for (int t = 0; t < NT; ++t) acc[t] = _mm256_fmadd_ps(sacc[t], dv, acc[t]);
    }
    for (int t = 0; t < NT; ++t) res[t] = hsum(acc[t]);
}

// The 2- and 3-bit IQ formats (iq_grids.h): per 32 values, grid entries (unsigned magnitudes)
// gathered by index from general registers, a sign mask per 8 values moved onto the activation
// ((a ^ m) - m), and the odd scales 2 s + 1 (per 16 values) applied by the int16 madd
// (|maddubs| <= 2 * 62 * 127; times 31 fits int32).
inline long long ll(uint64_t x) { return static_cast<long long>(x); }
template <class F>
inline void iq_block(const uint8_t* b, int s, __m256i& W, __m256i& S, __m256i& S16) {
    W = _mm256_set_epi64x(ll(F::grid(b, s, 3)), ll(F::grid(b, s, 2)), ll(F::grid(b, s, 1)), ll(F::grid(b, s, 0)));
    S = _mm256_set_epi64x(ll(kByteMasks.m[F::sign(b, s, 3)]), ll(kByteMasks.m[F::sign(b, s, 2)]),
                          ll(kByteMasks.m[F::sign(b, s, 1)]), ll(kByteMasks.m[F::sign(b, s, 0)]));
    int s2[2];
    F::scales(b, s, s2);
    S16 = _mm256_set_m128i(_mm_set1_epi16(short(2 * s2[1] + 1)), _mm_set1_epi16(short(2 * s2[0] + 1)));
}

template <class F, int NT>
void iq_grid_tile(const uint8_t* row, int nsb, const Act* A, float* res) {
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; ++sb) {
        const uint8_t* b = row + size_t(sb) * F::BYTES;
        prefetch_block(b, F::BYTES);
        __m256 sacc[NT];
        for (int t = 0; t < NT; ++t) sacc[t] = _mm256_setzero_ps();
        for (int ib = 0; ib < 8; ++ib) {
            __m256i W, S, S16;
            iq_block<F>(b, ib, W, S, S16);
            for (int t = 0; t < NT; ++t) {
                const __m256i a = ld256(A[t].q + size_t(sb) * 256 + 32 * ib);
                const __m256i i32 = _mm256_madd_epi16(_mm256_maddubs_epi16(W, _mm256_sub_epi8(_mm256_xor_si256(a, S), S)), S16);
                sacc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), _mm256_broadcast_ss(A[t].d + size_t(sb) * 8 + ib), sacc[t]);
            }
        }
        const __m256 dv = _mm256_set1_ps(F::d(b) * F::DS);
        for (int t = 0; t < NT; ++t) acc[t] = _mm256_fmadd_ps(sacc[t], dv, acc[t]);
    }
    for (int t = 0; t < NT; ++t) res[t] = hsum(acc[t]);
}

template <bool Q5> struct TK45 { template <int NT> static void run(const uint8_t* r, int k, const Act* a, float* o) { k45_tile<Q5, NT>(r, k / 256, a, o); } };
struct TIQ4XS { template <int NT> static void run(const uint8_t* r, int k, const Act* a, float* o) { iq4xs_tile<NT>(r, k / 256, a, o); } };
template <class F> struct TIQX { template <int NT> static void run(const uint8_t* r, int k, const Act* a, float* o) { iq_grid_tile<F, NT>(r, k / 256, a, o); } };
struct TQ6 { template <int NT> static void run(const uint8_t* r, int k, const Act* a, float* o) { q6k_tile<NT>(r, k / 256, a, o); } };
template <class Tl>
void rows(const uint8_t* w, size_t wstride, int r0, int r1, int k, const Act* acts, int m, float* out, size_t ostride) {
    float res[4];
    // Token tiles outermost: one tile's activations stay in L1 while the chunk's rows pass by
    // (as dot_avx512.inc's rows_driver).
    for (int t0 = 0; t0 < m; t0 += 4) {
        const int nt = m - t0 < 4 ? m - t0 : 4;
        for (int r = r0; r < r1; ++r) {
            const uint8_t* row = w + size_t(r) * wstride;
            switch (nt) {
                case 4: Tl::template run<4>(row, k, acts + t0, res); break;
                case 3: Tl::template run<3>(row, k, acts + t0, res); break;
                case 2: Tl::template run<2>(row, k, acts + t0, res); break;
                default: Tl::template run<1>(row, k, acts + t0, res); break;
            }
            for (int t = 0; t < nt; ++t) out[size_t(t0 + t) * ostride + (r - r0)] = res[t];
        }
    }
}

template <class Dec, int NT>
void tile(const uint8_t* row, int nblk, const Act* A, float* res) {
    __m256 acc[NT];
    float accm[NT];
    for (int t = 0; t < NT; ++t) { acc[t] = _mm256_setzero_ps(); accm[t] = 0.f; }
    SbState st;
    Blk b;
    for (int j = 0; j < nblk; ++j) {
        Dec::dec(row, j, st, b);
        const __m256i U = Dec::SIGNED ? _mm256_sign_epi8(b.W, b.W) : b.W;
        for (int t = 0; t < NT; ++t) {
            __m256i a = ld256(A[t].q + size_t(j) * 32);
            if (Dec::SIGNED) a = _mm256_sign_epi8(a, b.W);
            const __m256i i32 = _mm256_madd_epi16(_mm256_maddubs_epi16(U, a), b.S16);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), _mm256_set1_ps(b.D * A[t].d[j]), acc[t]);
            if (Dec::MIN) accm[t] += b.M * A[t].s[j];
        }
    }
    for (int t = 0; t < NT; ++t) {
        __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1));
        v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        v = _mm_add_ss(v, _mm_movehdup_ps(v));
        res[t] = _mm_cvtss_f32(v) + accm[t];
    }
}

// The 32-value formats through the same row driver as the k-quants.
template <class Dec> struct TBlk { template <int NT> static void run(const uint8_t* r, int k, const Act* a, float* o) { tile<Dec, NT>(r, k / 32, a, o); } };

void quantize_rows256(const float* x, size_t xstride, int n, int k, uint8_t* rec) {
    const size_t kp = act_kpad(k), rb = act_bytes(k);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 lim = _mm256_set1_ps(127.f), nlim = _mm256_set1_ps(-127.f);
    for (int i = 0; i < n; ++i) {
        const float* xr = x + size_t(i) * xstride;
        Act a = act_at(rec + size_t(i) * rb, k);
        int8_t* q = const_cast<int8_t*>(a.q);
        float* dx = const_cast<float*>(a.dx);
        float* d = const_cast<float*>(a.d);
        float* s = const_cast<float*>(a.s);
        for (size_t j = 0; j < kp / 32; ++j) {
            if (j * 32 >= size_t(k)) {
                std::memset(q + j * 32, 0, 32);
                _mm256_storeu_ps(dx + j * 8, _mm256_setzero_ps());
                d[j] = s[j] = 0.f;
                continue;
            }
            __m256 v[4];
            __m256 mx = _mm256_setzero_ps();
            for (int c = 0; c < 4; ++c) {
                v[c] = _mm256_loadu_ps(xr + j * 32 + 8 * c);
                mx = _mm256_max_ps(mx, _mm256_and_ps(v[c], absmask));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float amax = _mm_cvtss_f32(m4);
            const float dj = amax / 127.f;
            const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
            __m256i iv[4];
            for (int c = 0; c < 4; ++c) {
                __m256 r = _mm256_round_ps(_mm256_mul_ps(v[c], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                iv[c] = _mm256_cvtps_epi32(_mm256_min_ps(lim, _mm256_max_ps(nlim, r)));
            }
            __m256i sum = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
            // int32 -> int8 keeping element order (packs interleave 128-bit lanes; fix with a permute)
            __m256i p01 = _mm256_packs_epi32(iv[0], iv[1]), p23 = _mm256_packs_epi32(iv[2], iv[3]);
            __m256i p = _mm256_packs_epi16(p01, p23);
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j * 32), p);
            d[j] = dj;
            s[j] = dj * float(_mm_cvtsi128_si32(s4));
            _mm256_storeu_ps(dx + j * 8, _mm256_set1_ps(dj));
        }
    }
}

}  // namespace
}  // namespace avx2
}  // namespace smk

#include "target_pop.h"

void smk::init_avx2(Kernels& K) {
    using namespace avx2;
    K.name = "avx2";
    K.quantize = quantize_rows256;
    K.dot[T_Q4_K] = rows<TK45<false>>;
    K.dot[T_Q5_K] = rows<TK45<true>>;
    K.dot[T_Q6_K] = rows<TQ6>;
    K.dot[T_Q8_0] = rows<TBlk<D_Q8_0>>;
    K.dot[T_Q4_0] = rows<TBlk<D_Q4_0>>;
    K.dot[T_Q4_1] = rows<TBlk<D_Q4_1>>;
    K.dot[T_Q5_0] = rows<TBlk<D_Q5_0>>;
    K.dot[T_Q5_1] = rows<TBlk<D_Q5_1>>;
    K.dot[T_MXFP4] = rows<TBlk<D_MXFP4>>;
    K.dot[T_IQ4_NL] = rows<TBlk<D_IQ4_NL>>;
    K.dot[T_IQ4_XS] = rows<TIQ4XS>;
    K.dot[T_IQ2_XXS] = rows<TIQX<IQ2XXS>>;
    K.dot[T_IQ2_XS] = rows<TIQX<IQ2XS>>;
    K.dot[T_IQ2_S] = rows<TIQX<IQ2S>>;
    K.dot[T_IQ3_XXS] = rows<TIQX<IQ3XXS>>;
    K.dot[T_IQ1_S] = rows<TIQX<IQ1S>>;
    K.dot[T_IQ1_M] = rows<TIQX<IQ1M>>;
    K.dot[T_IQ3_S] = rows<TIQX<IQ3S>>;
}

#endif  // x86
