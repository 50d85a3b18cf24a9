// Decode attention over the paged KV cache: the C API, the work split and the merge; the per-unit
// arithmetic is attention.inc, compiled here for scalar code and in attention_avx2.cpp /
// attention_avx512.cpp for those ISAs.
//
// Every query row t of a sequence sees context indices [lo, hi): hi = its own index + 1 (causal),
// lo = hi - window when a sliding window applies. A sequence with kTileMinRows query rows or more
// (a prompt) goes in tiles (attention_tiled.inc): units of a kv head and a block of its tokens,
// each finished in place. The others (decode) are (row, kv head) units; when there are fewer than
// a few per thread (one sequence, few kv heads, MLA's one latent head), each context is cut into
// runs of at least kMinRun keys, computed apart and merged here (flash-decoding).
// Softmax and accumulation are float32 throughout; sinks (gpt-oss) join the denominator.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "kv_quant.h"
#include "smk.h"

namespace smk {
namespace scalar_attn {

struct V {
    static constexpr int W = 1;
    using vf = float;
    static vf zero() { return 0.f; }
    static vf set1(float x) { return x; }
    static vf load(const float* p) { return *p; }
    static vf load_bf16(const uint16_t* p) {
        uint32_t bits = uint32_t(*p) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        return f;
    }
    static vf load_i8(const int8_t* p) { return float(*p); }
    static vf load_e4m3(const uint8_t* p) { return fp8_e4m3_to_f32(*p); }
    static vf load_e5m2(const uint8_t* p) { return fp8_e5m2_to_f32(*p); }
    static float half(uint16_t h) { return fp16_to_f32(h); }
    static void store(float* p, vf v) { *p = v; }
    static vf add(vf a, vf b) { return a + b; }
    static vf sub(vf a, vf b) { return a - b; }
    static vf fmadd(vf a, vf b, vf c) { return a * b + c; }
    static vf max(vf a, vf b) { return a > b ? a : b; }
    static float hsum(vf v) { return v; }
    static float hmax(vf v) { return v; }
    static void hsum8(const vf* a, float* out) { for (int i = 0; i < 8; ++i) out[i] = a[i]; }
    static vf div(vf a, vf b) { return a / b; }
    static vf mul(vf a, vf b) { return a * b; }
    static vf fnmadd(vf a, vf b, vf c) { return c - a * b; }
    static vf min(vf a, vf b) { return a < b ? a : b; }
    static vf lt_select(vf a, vf b, vf x, vf y) { return a < b ? x : y; }
    static vf round(vf x) { return std::nearbyint(x); }
    static vf pow2(vf n) { return std::ldexp(1.f, int(n)); }
};

#include "attention.inc"
#include "attention_tiled.inc"

}  // namespace scalar_attn

void init_attention_scalar(Kernels& k) {
    k.attn_unit = scalar_attn::unit;
    k.attn_tile = scalar_attn::tile;
    k.f32_dot = scalar_attn::f32_dot;
    k.glu = scalar_attn::glu;
}

}  // namespace smk

using namespace smk;

namespace {

constexpr int kMinRun = 256;  // keys per run of a split context: below this the merge costs more
constexpr int kTileMinRows = 8;  // query rows of a sequence from which tiles beat per-row units
constexpr int kTileRows = 64;    // rows (tokens x the heads sharing a kv head) a tile unit aims at

// A list of units shared out across the pool, each thread taking the next one.
template <class Unit>
struct UnitJob {
    void (*const fn)(const Unit&);
    std::vector<Unit>& units;
    std::atomic<int> next{0};
};

template <class Unit>
void unit_job(void* p, int) {
    auto* j = static_cast<UnitJob<Unit>*>(p);
    for (;;) {
        const int i = j->next.fetch_add(1, std::memory_order_relaxed);
        if (i >= int(j->units.size())) return;
        j->fn(j->units[i]);
    }
}

}  // namespace

// out[T, H, Dv] = softmax(scale * q k^T (+ sink)) v per query row over its visible context.
//   seqs[4 * s .. 4 * s + 3] = first query row, query rows, offset of its slots in `slots`, context length
//   q_index[t]: the context index of row t's own token (it sees indices <= q_index[t])
//   window > 0: row t sees only indices > q_index[t] - window; sinks: [H] or null
// kv_type: 0 (float32), 30 (bfloat16), 8 (q8_0: int8 values, and float16 scales [..., slots, D / 32]
// given by pointer and strides in scales), kKvFp8E4M3 or kKvFp8E5M2. Returns 0, or a negative error code.
SMK_API int smk_attention(const float* q, int T, int H, int G, int Dk, int Dv,
                          const void* k, int64_t k_row_stride, int64_t k_head_stride,
                          const void* v, int64_t v_row_stride, int64_t v_head_stride, int kv_type,
                          const uint16_t* k_scales, int64_t k_scale_row, int64_t k_scale_head,
                          const uint16_t* v_scales, int64_t v_scale_row, int64_t v_scale_head,
                          const int64_t* slots, const int64_t* seqs, int n_seqs, const int64_t* q_index,
                          float scale, int window, const float* sinks, float* out) {
    if (T < 0 || H <= 0 || G <= 0 || H % G || Dk <= 0 || Dv <= 0 || n_seqs < 0) return -2;
    const int eb = kv_elem_bytes(kv_type);
    if (eb == 0) return -1;
    if (kv_type == T_Q8_0 && (!k_scales || !v_scales || Dk % kQ8Block || Dv % kQ8Block)) return -1;
    AttnArgs a;
    a.q = q; a.T = T; a.H = H; a.G = G; a.R = H / G; a.Dk = Dk; a.Dv = Dv;
    a.k = k; a.k_row_stride = k_row_stride; a.k_head_stride = k_head_stride;
    a.v = v; a.v_row_stride = v_row_stride; a.v_head_stride = v_head_stride;
    a.kv_type = kv_type;
    a.elem_bytes = eb;
    const bool q8 = kv_type == T_Q8_0;
    a.k_scales = q8 ? k_scales : nullptr; a.k_scale_row = k_scale_row; a.k_scale_head = k_scale_head;
    a.v_scales = q8 ? v_scales : nullptr; a.v_scale_row = v_scale_row; a.v_scale_head = v_scale_head;
    a.slots = slots;
    a.scale = scale;
    const int R = a.R;
    const Kernels& K = kernels();
    const int nthreads = num_threads();
    // (row, head group) ranges, then how many runs each is cut into
    struct Range { int t, g; int64_t slot_base; int lo, hi; };
    std::vector<Range> ranges;
    std::vector<AttnTile> tiles;
    int64_t keys = 0;
    for (int s = 0; s < n_seqs; ++s) {
        const int64_t t0 = seqs[4 * s], nt = seqs[4 * s + 1], base = seqs[4 * s + 2], ctx = seqs[4 * s + 3];
        if (t0 < 0 || nt < 0 || t0 + nt > T || ctx < 0) return -2;
        if (nt >= kTileMinRows) {
            for (int64_t t = t0; t < t0 + nt; ++t)
                if (q_index[t] < 0 || q_index[t] >= ctx) return -2;  // a tile reads every row's own key
            const int block = std::max(1, kTileRows / R);
            for (int64_t b = t0; b < t0 + nt; b += block) {
                const int n = int(std::min<int64_t>(block, t0 + nt - b));
                for (int g = 0; g < G; ++g) tiles.push_back({&a, g, int(b), n, window, slots + base, q_index, sinks, out});
            }
            continue;
        }
        for (int64_t t = t0; t < t0 + nt; ++t) {
            const int64_t hi = std::min<int64_t>(q_index[t] + 1, ctx);
            const int64_t lo = window > 0 ? std::max<int64_t>(0, q_index[t] - window + 1) : 0;
            for (int g = 0; g < G; ++g) ranges.push_back({int(t), g, base, int(lo), int(std::max(lo, hi))});
            keys += std::max<int64_t>(0, hi - lo) * G;
        }
    }
    if (!tiles.empty()) {
        // the costliest first (the prompt's last tokens see the most keys), so the pool ends together
        const auto cost = [&](const AttnTile& u) {
            const int64_t first = window > 0 ? std::max<int64_t>(0, q_index[u.t0] - window + 1) : 0;
            return (q_index[u.t0 + u.nt - 1] + 1 - first) * u.nt;
        };
        std::stable_sort(tiles.begin(), tiles.end(), [&](const AttnTile& x, const AttnTile& y) { return cost(x) > cost(y); });
        UnitJob<AttnTile> job{K.attn_tile, tiles};
        if (nthreads == 1 || tiles.size() == 1) {
            unit_job<AttnTile>(&job, 0);
        } else {
            parallel(unit_job<AttnTile>, &job);
        }
    }
    if (ranges.empty()) return 0;
    const int wanted = 4 * nthreads;
    int pieces = 1;
    if (!ranges.empty() && int(ranges.size()) < wanted) pieces = (wanted + int(ranges.size()) - 1) / int(ranges.size());
    std::vector<AttnUnit> units;
    std::vector<int> first_unit(ranges.size() + 1, 0);
    units.reserve(ranges.size() * size_t(pieces));
    for (size_t i = 0; i < ranges.size(); ++i) {
        const Range& r = ranges[i];
        first_unit[i] = int(units.size());
        const int n = r.hi - r.lo;
        const int run = std::max(kMinRun, (n + pieces - 1) / pieces);
        for (int c0 = r.lo; c0 < r.hi; c0 += run) {
            AttnUnit u;
            u.args = &a; u.q = q + (size_t(r.t) * H + size_t(r.g) * R) * Dk; u.g = r.g;
            u.slot_base = r.slot_base; u.c0 = c0; u.c1 = std::min(r.hi, c0 + run);
            units.push_back(u);
        }
    }
    first_unit[ranges.size()] = int(units.size());
    std::vector<float> part(units.size() * size_t(R) * (2 + size_t(Dv)));
    for (size_t i = 0; i < units.size(); ++i) {
        float* p = part.data() + i * size_t(R) * (2 + size_t(Dv));
        units[i].max = p; units[i].sum = p + R; units[i].acc = p + 2 * R;
    }
    UnitJob<AttnUnit> job{K.attn_unit, units};
    if (nthreads == 1 || units.size() <= 1 || keys * int64_t(Dk + Dv) * R < (int64_t(1) << 15)) {
        unit_job<AttnUnit>(&job, 0);
    } else {
        parallel(unit_job<AttnUnit>, &job);
    }
    // merge each range's runs: out = sum_i acc_i * e^(max_i - M) / (sum_i sum_i * e^(max_i - M) + e^(sink - M))
    for (size_t i = 0; i < ranges.size(); ++i) {
        const Range& rg = ranges[i];
        for (int r = 0; r < R; ++r) {
            const int h = rg.g * R + r;
            float* o = out + (size_t(rg.t) * H + size_t(h)) * Dv;
            float M = sinks ? sinks[h] : -INFINITY;
            for (int u = first_unit[i]; u < first_unit[i + 1]; ++u) M = std::max(M, units[u].max[r]);
            float denom = sinks ? std::exp(sinks[h] - M) : 0.f;
            std::fill(o, o + Dv, 0.f);
            if (M == -INFINITY) continue;  // nothing visible and no sink: zeros
            for (int u = first_unit[i]; u < first_unit[i + 1]; ++u) {
                const float f = std::exp(units[u].max[r] - M);
                denom += units[u].sum[r] * f;
                const float* acc = units[u].acc + size_t(r) * Dv;
                for (int d = 0; d < Dv; ++d) o[d] += acc[d] * f;
            }
            const float inv = 1.f / denom;
            for (int d = 0; d < Dv; ++d) o[d] *= inv;
        }
    }
    return 0;
}

// n rows of dim float32 values (contiguous) into the KV cache format kv_type as the native decode
// layer writes them (kv_quant.h): values at dst (row i at dst + i * dim values), q8_0's scales at
// scales (row i at scales + i * dim / 32). For tests: the same bits as kv_formats.py's torch writes.
SMK_API int smk_kv_quantize(int kv_type, const float* x, int64_t n, int dim, void* dst, uint16_t* scales) {
    const int eb = kv_elem_bytes(kv_type);
    if (eb == 0 || n < 0 || dim <= 0 || (kv_type == T_Q8_0 && (dim % kQ8Block || !scales))) return -1;
    for (int64_t i = 0; i < n; ++i)
        kv_store_row(kv_type, x + size_t(i) * dim, dim, static_cast<uint8_t*>(dst) + size_t(i) * dim * eb,
                     kv_type == T_Q8_0 ? scales + size_t(i) * (dim / kQ8Block) : nullptr);
    return 0;
}
