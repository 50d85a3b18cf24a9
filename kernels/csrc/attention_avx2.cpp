// Decode attention (attention.inc) for AVX2 + FMA (Haswell, Zen 1 and later): 8 floats a register.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "kv_quant.h"
#include "smk.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace smk {
namespace avx2_attn {

struct V {
    static constexpr int W = 8;
    using vf = __m256;
    static vf zero() { return _mm256_setzero_ps(); }
    static vf set1(float x) { return _mm256_set1_ps(x); }
    static vf load(const float* p) { return _mm256_loadu_ps(p); }
    static vf load_bf16(const uint16_t* p) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    static vf load_i8(const int8_t* p) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    }
    // fp8 bytes widened to halves (attention_avx512.cpp says how)
    static vf load_e5m2(const uint8_t* p) {
        const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
    }
    static vf load_e4m3(const uint8_t* p) {
        const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                       _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
        return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
    }
    static float half(uint16_t h) { return _cvtsh_ss(h); }
    static void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
    static vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
    static vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
    static vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
    static vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
    static float hsum(vf v) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    static void hsum8(const vf* a, float* out) {
        const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
        const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
        const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
        // each 128-bit lane holds partial sums of heads 0-3 (4-7): add the lanes across
        const __m256 lo = _mm256_permute2f128_ps(h0123, h4567, 0x20), hi = _mm256_permute2f128_ps(h0123, h4567, 0x31);
        _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
    }
    static float hmax(vf v) {
        __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        s = _mm_max_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    static vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
    static vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
    static vf fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
    static vf min(vf a, vf b) { return _mm256_min_ps(a, b); }
    static vf lt_select(vf a, vf b, vf x, vf y) { return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
    static vf round(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static vf pow2(vf n) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
    }
};

#include "attention.inc"
#include "attention_tiled.inc"

}  // namespace avx2_attn
}  // namespace smk

#include "target_pop.h"

void smk::init_attention_avx2(Kernels& k) {
    k.attn_unit = avx2_attn::unit;
    k.attn_tile = avx2_attn::tile;
    k.f32_dot = avx2_attn::f32_dot;
    k.glu = avx2_attn::glu;
}

#endif  // x86
