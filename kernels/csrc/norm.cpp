// RMS norms of float32 rows: out = x * (1 / sqrt(mean(x^2) + eps)) * w, the sum of squares in double
// (each square exact, the sum of a few thousand of them far inside double's precision). The sum runs
// in 16 fixed lanes (element i into lane i % 16, the lanes added in order), which every ISA computes
// the same way: each clone below vectorizes those lanes as wide as it can, so the bits do not depend
// on the CPU. The decode front (decode_layer.cpp) norms through the same routine, so a prompt's rows
// and a decode step's rows are normed alike. A prompt's norms had been torch's: inside a 512-token
// prompt of the 24-layer Qwen3-30B-A3B shape ~0.55 ms for 512 x 2048 and ~1 ms for the per-head q norm
// of 512 x 32 x 128 (2 Zen 5 cores; its OpenMP calls cost more there than alone): 2.3 -> 1.0 ms a layer.
#include <climits>
#include <cmath>
#include <cstdint>

#include "smk.h"

namespace smk {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void rms_norm_row(const float* x, int n, const float* w, float eps, float* out) {
    double lane[16] = {};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; ++l) lane[l] += double(x[i + l]) * double(x[i + l]);
    for (int l = 0; i + l < n; ++l) lane[l] += double(x[i + l]) * double(x[i + l]);
    double ss = 0.0;
    for (int l = 0; l < 16; ++l) ss += lane[l];
    const float inv = 1.0f / std::sqrt(float(ss / n) + eps);
    for (int j = 0; j < n; ++j) out[j] = x[j] * inv * w[j];
}

}  // namespace smk

using namespace smk;

// x: outer x inner rows of n floats, row (o, i) at x + o * outer_stride + i * inner_stride (floats);
// out: the normed rows contiguous, [outer, inner, n]. Returns 0, or -2 for bad sizes.
SMK_API int smk_rms_norm(const float* x, int64_t outer, int64_t inner, int64_t outer_stride, int64_t inner_stride,
                         int n, const float* w, float eps, float* out) {
    if (outer < 0 || inner <= 0 || n <= 0 || outer * inner > INT32_MAX) return -2;
    const int rows = int(outer * inner);
    parallel_rows(rows, int64_t(rows) * n, [&](int r0, int r1) {
        for (int r = r0; r < r1; ++r)
            rms_norm_row(x + (r / inner) * outer_stride + (r % inner) * inner_stride, n, w, eps, out + size_t(r) * n);
    });
    return 0;
}
