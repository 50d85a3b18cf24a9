// Rotary position embedding of float32 head rows, out[i] = x[i] cos[i] + x[partner(i)] sin[i] over the
// first `dims` of each head (sin signed as the pair's rotation wants it, attention_service/model/
// layers.py's Rope.tables), the rest copied: the products and the sum rounded as torch rounds them, so
// the same bits as the torch path. The decode front (decode_layer.cpp) rotates through the same
// routine; a prompt's q and k went through some ten torch calls, ~0.85 ms a layer for a 512-token
// prompt of 32 + 4 heads of 128 (2 Zen 5 cores).
#include <atomic>
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

namespace {
struct RopeJob {
    const float* x;
    int64_t heads, t_stride, h_stride;
    int head_dim, dims, rows, chunk;
    bool interleaved;
    const float* cos;
    const float* sin;
    float* out;
    std::atomic<int> next{0};
};

void rope_rows(const RopeJob& j, int r0, int r1) {
    for (int r = r0; r < r1; ++r) {
        const int64_t t = r / j.heads, h = r % j.heads;
        rope_row(j.x + t * j.t_stride + h * j.h_stride, j.head_dim, j.dims, j.interleaved, j.cos + t * j.dims,
                 j.sin + t * j.dims, j.out + size_t(r) * j.head_dim);
    }
}

void rope_job(void* p, int) {
    auto* j = static_cast<RopeJob*>(p);
    for (;;) {
        const int r0 = j->next.fetch_add(j->chunk, std::memory_order_relaxed);
        if (r0 >= j->rows) return;
        rope_rows(*j, r0, r0 + j->chunk < j->rows ? r0 + j->chunk : j->rows);
    }
}
}  // namespace

// x: T x heads rows of head_dim floats, row (t, h) at x + t * t_stride + h * h_stride; cos, sin:
// [T, dims]; out: [T, heads, head_dim] contiguous, not overlapping x. Returns 0, or -2 for bad sizes.
SMK_API int smk_rope(const float* x, int64_t T, int64_t heads, int64_t t_stride, int64_t h_stride, int head_dim,
                     int dims, int interleaved, const float* cos, const float* sin, float* out) {
    if (T < 0 || heads <= 0 || head_dim <= 0 || dims <= 0 || dims > head_dim || dims % 2 || T * heads > INT32_MAX)
        return -2;
    RopeJob j;
    j.x = x; j.heads = heads; j.t_stride = t_stride; j.h_stride = h_stride; j.head_dim = head_dim; j.dims = dims;
    j.rows = int(T * heads); j.interleaved = interleaved != 0; j.cos = cos; j.sin = sin; j.out = out;
    if (j.rows == 0) return 0;
    const int nt = num_threads();
    j.chunk = (j.rows + nt * 4 - 1) / (nt * 4);
    if (nt == 1 || int64_t(j.rows) * head_dim < (int64_t(1) << 15)) {
        rope_rows(j, 0, j.rows);
    } else {
        parallel(rope_job, &j);
    }
    return 0;
}
