// Rotary position embedding of float32 head rows, out[i] = x[i] cos[i] + x[partner(i)] sin[i] over the
// first `dims` of each head (sin signed as the pair's rotation wants it, attention_service/model/
// layers.py's Rope.tables), the rest copied: the products and the sum rounded as torch rounds them, so
// the same bits as the torch path. The decode front (decode_layer.cpp) rotates through the same
// routine; a prompt's q and k went through some ten torch calls, ~0.85 ms a layer for a 512-token
// prompt of 32 + 4 heads of 128 (2 Zen 5 cores).
#include <climits>
#include <cstdint>
#include <cstring>

#include "smk.h"

namespace smk {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void rope_row(const float* x, int head_dim, int dims, bool interleaved, const float* cos, const float* sin, float* out) {
    if (interleaved) {
        for (int i = 0; i < dims; i += 2) {
            const float a0 = x[i] * cos[i], b0 = x[i + 1] * sin[i];
            const float a1 = x[i + 1] * cos[i + 1], b1 = x[i] * sin[i + 1];
            out[i] = a0 + b0;
            out[i + 1] = a1 + b1;
        }
    } else {  // NeoX: partner(i) = i + half in the first half, i - half in the second
        const int half = dims / 2;
        for (int i = 0; i < half; ++i) {
            const float a = x[i] * cos[i], b = x[i + half] * sin[i];
            out[i] = a + b;
        }
        for (int i = half; i < dims; ++i) {
            const float a = x[i] * cos[i], b = x[i - half] * sin[i];
            out[i] = a + b;
        }
    }
    if (out != x && dims < head_dim) std::memcpy(out + dims, x + dims, sizeof(float) * size_t(head_dim - dims));
}

void rope_heads(float* x, int heads, int head_dim, int dims, bool interleaved, const float* cos, const float* sin) {
    float rot[1024];
    for (int h = 0; h < heads; ++h) {
        float* xh = x + size_t(h) * head_dim;
        std::memcpy(rot, xh, sizeof(float) * size_t(dims));  // in place: the partners must be the inputs
        rope_row(rot, dims, dims, interleaved, cos, sin, xh);
    }
}

}  // namespace smk

using namespace smk;

// x: T x heads rows of head_dim floats, row (t, h) at x + t * t_stride + h * h_stride; cos, sin:
// [T, dims]; out: [T, heads, head_dim] contiguous, not overlapping x. Returns 0, or -2 for bad sizes.
SMK_API int smk_rope(const float* x, int64_t T, int64_t heads, int64_t t_stride, int64_t h_stride, int head_dim,
                     int dims, int interleaved, const float* cos, const float* sin, float* out) {
    if (T < 0 || heads <= 0 || head_dim <= 0 || dims <= 0 || dims > head_dim || dims % 2 || T * heads > INT32_MAX)
        return -2;
    const int rows = int(T * heads);
    parallel_rows(rows, int64_t(rows) * head_dim, [&](int r0, int r1) {
        for (int r = r0; r < r1; ++r) {
            const int64_t t = r / heads, h = r % heads;
            rope_row(x + t * t_stride + h * h_stride, head_dim, dims, interleaved != 0, cos + t * dims, sin + t * dims,
                     out + size_t(r) * head_dim);
        }
    });
    return 0;
}
