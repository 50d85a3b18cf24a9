// The KV cache's 8-bit formats (`--kv-cache-dtype`), value by value: writing a row (the native
// decode layer stores each new token's keys and values) and reading one value back (the kernels'
// odd tails; their vector loads are each ISA's V). The writes give what torch gives for the same
// row in attention_service/model/kv_formats.py (which writes prompts), bit for bit, so a token's
// cache entry does not depend on which path wrote it:
//   q8_0: per 32 values d = amax / 127 (float32), q = round-half-even(x * (1 / d)), d stored as
//         float16 (round to nearest even), as llama.cpp's blocks with torch's rounding;
//   fp8:  clamped to the format's largest finite value, then rounded to nearest even, subnormals
//         included (c10's float8 conversions).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "smk.h"

namespace smk {

constexpr int kQ8Block = 32;

inline uint32_t f32_bits(float f) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    return b;
}

// float32 -> float16, round to nearest even; beyond the largest half (65504) the result is inf.
inline uint16_t f32_to_fp16(float f) {
    uint32_t a = f32_bits(f);
    const uint16_t sign = uint16_t((a >> 16) & 0x8000);
    a &= 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00;   // NaN
    if (a >= 0x477ff000u) return sign | 0x7c00;  // 65520 and up round to inf
    if (a < 0x38800000u)                          // below 2^-14: a subnormal half, in units of 2^-24
        return sign | uint16_t(std::nearbyint(std::fabs(f) * 16777216.f));
    a -= 112u << 23;  // rebias the exponent (127 -> 15)
    a += 0xfffu + ((a >> 13) & 1);
    return sign | uint16_t(a >> 13);
}

// float32 -> a one-byte float with M mantissa bits and exponent bias B (e4m3: 3, 7; e5m2: 2, 15),
// round to nearest even; |f| must be within the format's finite range (the caller clamps).
template <int M, int B>
inline uint8_t f32_to_fp8(float f) {
    uint32_t a = f32_bits(f);
    const uint8_t sign = uint8_t((a >> 24) & 0x80);
    a &= 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7f;  // NaN
    const float mag = std::fabs(f);
    if (mag < std::ldexp(1.f, 1 - B))  // a subnormal: whole units of 2^(1 - B - M)
        return sign | uint8_t(std::nearbyint(std::ldexp(mag, B - 1 + M)));
    constexpr int drop = 23 - M;
    a -= uint32_t(127 - B) << 23;
    a += ((1u << (drop - 1)) - 1) + ((a >> drop) & 1);
    return sign | uint8_t(a >> drop);
}

constexpr float kFp8E4M3Max = 448.f, kFp8E5M2Max = 57344.f;

inline float fp8_e4m3_to_f32(uint8_t b) {
    // the same bits placed in a half (5 exponent bits, bias 15) are the value times 2^-8
    return fp16_to_f32(uint16_t((b & 0x80) << 8 | (b & 0x7f) << 7)) * 256.f;
}
inline float fp8_e5m2_to_f32(uint8_t b) { return fp16_to_f32(uint16_t(b) << 8); }

// One row of `dim` float32 values into the cache's format at dst (values) and, for q8_0, scales
// (dim / 32 halves; dim a multiple of 32, which the cache checks at creation).
inline void kv_store_row(int kv_type, const float* x, int dim, void* dst, uint16_t* scales) {
    switch (kv_type) {
        case T_F32:
            std::memcpy(dst, x, sizeof(float) * size_t(dim));
            return;
        case T_BF16: {
            uint16_t* d = static_cast<uint16_t*>(dst);
            for (int i = 0; i < dim; ++i) d[i] = f32_to_bf16(x[i]);
            return;
        }
        case kKvFp8E4M3: {
            uint8_t* d = static_cast<uint8_t*>(dst);
            for (int i = 0; i < dim; ++i) d[i] = f32_to_fp8<3, 7>(std::fmin(std::fmax(x[i], -kFp8E4M3Max), kFp8E4M3Max));
            return;
        }
        case kKvFp8E5M2: {
            uint8_t* d = static_cast<uint8_t*>(dst);
            for (int i = 0; i < dim; ++i) d[i] = f32_to_fp8<2, 15>(std::fmin(std::fmax(x[i], -kFp8E5M2Max), kFp8E5M2Max));
            return;
        }
        case T_Q8_0: {
            int8_t* q = static_cast<int8_t*>(dst);
            for (int b = 0; b < dim / kQ8Block; ++b) {
                const float* xb = x + size_t(b) * kQ8Block;
                float amax = 0.f;
                for (int i = 0; i < kQ8Block; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
                const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
                for (int i = 0; i < kQ8Block; ++i)
                    q[b * kQ8Block + i] = int8_t(std::fmin(std::fmax(std::nearbyint(xb[i] * inv), -127.f), 127.f));
                scales[b] = f32_to_fp16(d);
            }
            return;
        }
        default:
            return;
    }
}

inline int kv_elem_bytes(int kv_type) {
    switch (kv_type) {
        case T_F32: return 4;
        case T_BF16: return 2;
        case T_Q8_0: case kKvFp8E4M3: case kKvFp8E5M2: return 1;
        default: return 0;
    }
}

}  // namespace smk
