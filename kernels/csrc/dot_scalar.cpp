// Portable reference kernels: activation quantization and row dots for every native format.
// Every SIMD kernel computes the same integer sums per 32-value block, so these also serve as
// the tests' cross-check and as the fallback on CPUs without AVX2.
#include <cmath>

#include "iq_grids.h"
#include "smk.h"

namespace smk {

const int8_t kMxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
const int8_t kIq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

TypeInfo type_info(int type) {
    switch (type) {
        case T_F32: return {1, 4};
        case T_F16: return {1, 2};
        case T_BF16: return {1, 2};
        case T_Q4_0: return {32, 18};
        case T_Q4_1: return {32, 20};
        case T_Q5_0: return {32, 22};
        case T_Q5_1: return {32, 24};
        case T_Q8_0: return {32, 34};
        case T_MXFP4: return {32, 17};
        case T_Q2_K: return {256, 84};
        case T_Q3_K: return {256, 110};
        case T_Q4_K: return {256, 144};
        case T_Q5_K: return {256, 176};
        case T_Q6_K: return {256, 210};
        case T_IQ4_NL: return {32, 18};
        case T_IQ4_XS: return {256, 136};
        case T_IQ2_XXS: return {256, IQ2XXS::BYTES};
        case T_IQ2_XS: return {256, IQ2XS::BYTES};
        case T_IQ2_S: return {256, IQ2S::BYTES};
        case T_IQ3_XXS: return {256, IQ3XXS::BYTES};
        case T_IQ1_S: return {256, IQ1S::BYTES};
        case T_IQ1_M: return {256, IQ1M::BYTES};
        case T_IQ3_S: return {256, IQ3S::BYTES};
        default: return {0, 0};
    }
}

namespace {

void quantize_scalar(const float* x, size_t xstride, int n, int k, uint8_t* rec) {
    const size_t kp = act_kpad(k), rb = act_bytes(k);
    for (int i = 0; i < n; ++i) {
        const float* xr = x + size_t(i) * xstride;
        uint8_t* r = rec + size_t(i) * rb;
        Act a = act_at(r, k);
        int8_t* q = const_cast<int8_t*>(a.q);
        float* dx = const_cast<float*>(a.dx);
        float* d = const_cast<float*>(a.d);
        float* s = const_cast<float*>(a.s);
        for (size_t j = 0; j < kp / 32; ++j) {
            if (j * 32 >= size_t(k)) {
                std::memset(q + j * 32, 0, 32);
                for (int l = 0; l < 8; ++l) dx[j * 8 + l] = 0.f;
                d[j] = s[j] = 0.f;
                continue;
            }
            const float* xb = xr + j * 32;
            float amax = 0.f;
            for (int l = 0; l < 32; ++l) amax = std::fmax(amax, std::fabs(xb[l]));
            const float dj = amax / 127.f;
            const float id = amax > 0.f ? 127.f / amax : 0.f;
            int sum = 0;
            for (int l = 0; l < 32; ++l) {
                float v = std::nearbyint(xb[l] * id);
                v = std::fmin(127.f, std::fmax(-127.f, v));
                q[j * 32 + l] = int8_t(v);
                sum += int(v);
            }
            d[j] = dj;
            s[j] = dj * float(sum);
            for (int l = 0; l < 8; ++l) dx[j * 8 + l] = dj;
        }
    }
}

// One 32-value block of a weight row, decoded: value[i] = D * isc[i / 16] * v[i] + M.
struct Block32 {
    int8_t v[32];
    int isc[2];
    float D, M;
};

inline void nib32(const uint8_t* qs, int8_t* v, int off) {
    for (int l = 0; l < 16; ++l) {
        v[l] = int8_t((qs[l] & 15) - off);
        v[l + 16] = int8_t((qs[l] >> 4) - off);
    }
}

// Decoders: block j (of 32 values) of one row.
struct DecQ4_0 {
    static void dec(const uint8_t* row, int j, Block32& b) {
        const uint8_t* p = row + j * 18;
        nib32(p + 2, b.v, 8);
        b.isc[0] = b.isc[1] = 1; b.D = ld_fp16(p); b.M = 0.f;
    }
};
struct DecQ4_1 {
    static void dec(const uint8_t* row, int j, Block32& b) {
        const uint8_t* p = row + j * 20;
        nib32(p + 4, b.v, 0);
        b.isc[0] = b.isc[1] = 1; b.D = ld_fp16(p); b.M = ld_fp16(p + 2);
    }
};
struct DecQ5_0 {
    static void dec(const uint8_t* row, int j, Block32& b) {
        const uint8_t* p = row + j * 22;
        uint32_t qh = ld_u32(p + 2);
        nib32(p + 6, b.v, 0);
        for (int l = 0; l < 32; ++l) b.v[l] = int8_t((b.v[l] | ((qh >> l) & 1) << 4) - 16);
        b.isc[0] = b.isc[1] = 1; b.D = ld_fp16(p); b.M = 0.f;
    }
};
struct DecQ5_1 {
    static void dec(const uint8_t* row, int j, Block32& b) {
        const uint8_t* p = row + j * 24;
        uint32_t qh = ld_u32(p + 4);
        nib32(p + 8, b.v, 0);
        for (int l = 0; l < 32; ++l) b.v[l] = int8_t(b.v[l] | ((qh >> l) & 1) << 4);
        b.isc[0] = b.isc[1] = 1; b.D = ld_fp16(p); b.M = ld_fp16(p + 2);
    }
};
struct DecQ8_0 {
    static void dec(const uint8_t* row, int j, Block32& b) {
        const uint8_t* p = row + j * 34;
        std::memcpy(b.v, p + 2, 32);
        b.isc[0] = b.isc[1] = 1; b.D = ld_fp16(p); b.M = 0.f;
    }
};
struct DecMXFP4 {
    static void dec(const uint8_t* row, int j, Block32& b) {
        const uint8_t* p = row + j * 17;
        for (int l = 0; l < 16; ++l) {
            b.v[l] = kMxfp4[p[1 + l] & 15];
            b.v[l + 16] = kMxfp4[p[1 + l] >> 4];
        }
        b.isc[0] = b.isc[1] = 1; b.D = e8m0_half(p[0]); b.M = 0.f;
    }
};
// IQ4_NL: d | 16 nibble bytes (low nibbles elements 0-15, high 16-31), each indexing kIq4nl.
inline void iq4_nib32(const uint8_t* qs, int8_t* v) {
    for (int l = 0; l < 16; ++l) {
        v[l] = kIq4nl[qs[l] & 15];
        v[l + 16] = kIq4nl[qs[l] >> 4];
    }
}
struct DecIQ4_NL {
    static void dec(const uint8_t* row, int j, Block32& b) {
        const uint8_t* p = row + j * 18;
        iq4_nib32(p + 2, b.v);
        b.isc[0] = b.isc[1] = 1; b.D = ld_fp16(p); b.M = 0.f;
    }
};
// IQ4_XS: sub-block j % 8 of a super-block has IQ4_NL's nibble layout at qs + 16 (j % 8).
struct DecIQ4_XS {
    static void dec(const uint8_t* row, int j, Block32& b) {
        const uint8_t* p = row + (j / 8) * 136;
        iq4_nib32(p + 8 + 16 * (j % 8), b.v);
        b.isc[0] = b.isc[1] = iq4xs_scale(p, j % 8);
        b.D = ld_fp16(p); b.M = 0.f;
    }
};
// The 2- and 3-bit IQ formats (iq_grids.h): value = d * DS * (2 s + 1) * v.
template <class F>
struct DecIQ {
    static void dec(const uint8_t* row, int j, Block32& b) {
        const uint8_t* p = row + (j / 8) * F::BYTES;
        int s[2];
        iq_values<F>(p, j % 8, b.v, s);
        b.isc[0] = 2 * s[0] + 1;
        b.isc[1] = 2 * s[1] + 1;
        b.D = F::d(p) * F::DS; b.M = 0.f;
    }
};
template <bool Q5>
struct DecQ45K {
    static void dec(const uint8_t* row, int j, Block32& b) {
        const int bytes = Q5 ? 176 : 144;
        const uint8_t* p = row + (j / 8) * bytes;
        const int sub = j % 8, c = sub / 2, hi = sub % 2;
        uint8_t sc[8], mn[8];
        k4_scales(p + 4, sc, mn);
        const uint8_t* qs = p + (Q5 ? 48 : 16) + c * 32;
        for (int l = 0; l < 32; ++l) {
            int u = hi ? qs[l] >> 4 : qs[l] & 15;
            if (Q5) u |= ((p[16 + l] >> sub) & 1) << 4;
            b.v[l] = int8_t(u);
        }
        b.isc[0] = b.isc[1] = sc[sub];
        b.D = ld_fp16(p);
        b.M = -(ld_fp16(p + 2) * float(mn[sub]));
    }
};
struct DecQ6_K {
    static void dec(const uint8_t* row, int j, Block32& b) {
        const uint8_t* p = row + (j / 8) * 210;
        const int sub = j % 8, h = sub / 4, kk = sub % 4;
        const uint8_t* ql = p + h * 64 + (kk % 2) * 32;
        const uint8_t* qh = p + 128 + h * 32;
        for (int l = 0; l < 32; ++l) {
            int lo = (kk / 2) ? ql[l] >> 4 : ql[l] & 15;
            int hb = (qh[l] >> (2 * kk)) & 3;
            b.v[l] = int8_t((lo | hb << 4) - 32);
        }
        const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
        b.isc[0] = sc[2 * sub];
        b.isc[1] = sc[2 * sub + 1];
        b.D = ld_fp16(p + 208);
        b.M = 0.f;
    }
};

template <class Dec>
void dot_rows(const uint8_t* w, size_t wstride, int r0, int r1, int k, const Act* acts, int m,
              float* out, size_t ostride) {
    Block32 b;
    for (int r = r0; r < r1; ++r) {
        const uint8_t* row = w + size_t(r) * wstride;
        for (int t = 0; t < m; ++t) out[size_t(t) * ostride + (r - r0)] = 0.f;
        for (int j = 0; j < k / 32; ++j) {
            Dec::dec(row, j, b);
            for (int t = 0; t < m; ++t) {
                const int8_t* q = acts[t].q + j * 32;
                int s0 = 0, s1 = 0;
                for (int l = 0; l < 16; ++l) s0 += int(b.v[l]) * q[l];
                for (int l = 16; l < 32; ++l) s1 += int(b.v[l]) * q[l];
                float v = b.D * (acts[t].d[j] * float(s0 * b.isc[0] + s1 * b.isc[1])) + b.M * acts[t].s[j];
                out[size_t(t) * ostride + (r - r0)] += v;
            }
        }
    }
}

}  // namespace

void init_scalar(Kernels& K) {
    K.name = "scalar";
    K.quantize = quantize_scalar;
    for (auto& f : K.dot) f = nullptr;
    K.dot[T_Q4_0] = dot_rows<DecQ4_0>;
    K.dot[T_Q4_1] = dot_rows<DecQ4_1>;
    K.dot[T_Q5_0] = dot_rows<DecQ5_0>;
    K.dot[T_Q5_1] = dot_rows<DecQ5_1>;
    K.dot[T_Q8_0] = dot_rows<DecQ8_0>;
    K.dot[T_MXFP4] = dot_rows<DecMXFP4>;
    K.dot[T_Q4_K] = dot_rows<DecQ45K<false>>;
    K.dot[T_Q5_K] = dot_rows<DecQ45K<true>>;
    K.dot[T_Q6_K] = dot_rows<DecQ6_K>;
    K.dot[T_IQ4_NL] = dot_rows<DecIQ4_NL>;
    K.dot[T_IQ4_XS] = dot_rows<DecIQ4_XS>;
    K.dot[T_IQ2_XXS] = dot_rows<DecIQ<IQ2XXS>>;
    K.dot[T_IQ2_XS] = dot_rows<DecIQ<IQ2XS>>;
    K.dot[T_IQ2_S] = dot_rows<DecIQ<IQ2S>>;
    K.dot[T_IQ3_XXS] = dot_rows<DecIQ<IQ3XXS>>;
    K.dot[T_IQ1_S] = dot_rows<DecIQ<IQ1S>>;
    K.dot[T_IQ1_M] = dot_rows<DecIQ<IQ1M>>;
    K.dot[T_IQ3_S] = dot_rows<DecIQ<IQ3S>>;
}

}  // namespace smk
