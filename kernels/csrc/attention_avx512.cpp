// Decode attention (attention.inc) for AVX-512 (Skylake-SP, Zen 4 and later): 16 floats a register.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "kv_quant.h"
#include "smk.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif

namespace smk {
namespace avx512_attn {

struct V {
    static constexpr int W = 16;
    using vf = __m512;
    static vf zero() { return _mm512_setzero_ps(); }
    static vf set1(float x) { return _mm512_set1_ps(x); }
    static vf load(const float* p) { return _mm512_loadu_ps(p); }
    static vf load_bf16(const uint16_t* p) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    static vf load_i8(const int8_t* p) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
    // fp8 bytes widened to halves: e5m2 is a half's top byte; e4m3's bits, placed under a half's
    // 5-bit exponent, are its value times 2^-8
    static vf load_e5m2(const uint8_t* p) {
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
    }
    static vf load_e4m3(const uint8_t* p) {
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                          _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
        return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
    }
    static float half(uint16_t h) { return _cvtsh_ss(h); }
    static void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
    static vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
    static vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
    static vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
    static vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
    static float hsum(vf v) { return _mm512_reduce_add_ps(v); }
    static float hmax(vf v) { return _mm512_reduce_max_ps(v); }
    static void hsum8(const vf* a, float* out) {
        __m256 b[8];
        for (int i = 0; i < 8; ++i)
            b[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm512_extractf32x8_ps(a[i], 1));
        const __m256 h01 = _mm256_hadd_ps(b[0], b[1]), h23 = _mm256_hadd_ps(b[2], b[3]);
        const __m256 h45 = _mm256_hadd_ps(b[4], b[5]), h67 = _mm256_hadd_ps(b[6], b[7]);
        const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
        const __m256 lo = _mm256_permute2f128_ps(h0123, h4567, 0x20), hi = _mm256_permute2f128_ps(h0123, h4567, 0x31);
        _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
    }
    static vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
    static vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
    static vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
    static vf min(vf a, vf b) { return _mm512_min_ps(a, b); }
    static vf lt_select(vf a, vf b, vf x, vf y) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x); }
    static vf round(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static vf pow2(vf n) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
    }
};

#include "attention.inc"
#include "attention_tiled.inc"

}  // namespace avx512_attn
}  // namespace smk

#include "target_pop.h"

void smk::init_attention_avx512(Kernels& k) {
    k.attn_unit = avx512_attn::unit;
    k.attn_tile = avx512_attn::tile;
    k.f32_dot = avx512_attn::f32_dot;
    k.glu = avx512_attn::glu;
}

#endif  // x86
