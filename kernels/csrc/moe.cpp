// One MoE layer's hosted experts in one call: quantize the tokens once, then
//   phase 1: gate and up rows of every active expert against that expert's tokens (one work
//            list over all experts, shared out across the pool),
//   phase 2: biases, activation and re-quantization of the [slots, ffn] intermediates,
//   phase 3: down projection split by output rows, each thread owning disjoint rows of `out`
//            and summing weight * value over every (expert, slot), so no atomics are needed.
// Each phase is one pool dispatch: three barriers per layer, however many experts are active.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "smk.h"

namespace smk {
void quantize_rows(const float* x, size_t xstride, int n, int k, uint8_t* rec);
}

using namespace smk;

struct SmkExpert {
    const uint8_t* gate;
    const uint8_t* up;
    const uint8_t* down;
    int64_t gate_stride, up_stride, down_stride;
    int32_t gate_type, up_type, down_type, activation;  // activation: 0 silu, 1 swiglu_oai
    const float* gate_bias;
    const float* up_bias;
    const float* down_bias;
};

namespace {

struct MoeCtx {
    const SmkExpert* experts;
    int D, F;
    const Kernels* K;
    // active experts: expert slot range [start[a], start[a] + count[a]) in slot order
    std::vector<int> act_expert, act_start, act_count;
    std::vector<int> slot_tok;
    std::vector<float> slot_w;
    std::vector<Act> xacts, hacts;
    float* G = nullptr;  // [S, F] gate, then the activation
    float* U = nullptr;  // [S, F] up
    uint8_t* hrec = nullptr;
    float* out = nullptr;
    int S = 0, max_count = 0;
    // work lists
    int p1_chunk = 0, p1_per_expert = 0, p3_chunk = 0;
    std::atomic<int> next1{0}, next2{0}, next3{0};
};

void phase1(void* p, int) {
    auto* c = static_cast<MoeCtx*>(p);
    const int n_items = int(c->act_expert.size()) * c->p1_per_expert;
    for (;;) {
        const int item = c->next1.fetch_add(1, std::memory_order_relaxed);
        if (item >= n_items) return;
        const int a = item / c->p1_per_expert;
        const int r0 = (item % c->p1_per_expert) * c->p1_chunk, r1 = std::min(c->F, r0 + c->p1_chunk);
        const SmkExpert& e = c->experts[c->act_expert[a]];
        const int s0 = c->act_start[a], m = c->act_count[a];
        const Act* acts = c->xacts.data() + s0;
        dot_for(*c->K, e.gate_type)(e.gate, size_t(e.gate_stride), r0, r1, c->D, acts, m, c->G + size_t(s0) * c->F + r0, size_t(c->F));
        dot_for(*c->K, e.up_type)(e.up, size_t(e.up_stride), r0, r1, c->D, acts, m, c->U + size_t(s0) * c->F + r0, size_t(c->F));
    }
}

void activate_slot(MoeCtx* c, int a, int s) {
    const SmkExpert& e = c->experts[c->act_expert[a]];
    float* g = c->G + size_t(s) * c->F;
    c->K->glu(g, c->U + size_t(s) * c->F, e.gate_bias, e.up_bias, c->F, e.activation == 1 ? kGluSwigluOai : kGluSilu);
    c->K->quantize(g, size_t(c->F), 1, c->F, c->hrec + size_t(s) * act_bytes(c->F));
}

void phase2(void* p, int) {
    auto* c = static_cast<MoeCtx*>(p);
    const int n_act = int(c->act_expert.size());
    for (;;) {
        const int s = c->next2.fetch_add(1, std::memory_order_relaxed);
        if (s >= c->S) return;
        // the active expert owning slot s
        int a = int(std::upper_bound(c->act_start.begin(), c->act_start.begin() + n_act, s) - c->act_start.begin()) - 1;
        activate_slot(c, a, s);
    }
}

void phase3(void* p, int) {
    auto* c = static_cast<MoeCtx*>(p);
    const int n_items = (c->D + c->p3_chunk - 1) / c->p3_chunk;
    float* tmp = reinterpret_cast<float*>(scratch(5, sizeof(float) * size_t(c->max_count) * c->p3_chunk));
    for (;;) {
        const int item = c->next3.fetch_add(1, std::memory_order_relaxed);
        if (item >= n_items) return;
        const int r0 = item * c->p3_chunk, r1 = std::min(c->D, r0 + c->p3_chunk), nr = r1 - r0;
        for (size_t a = 0; a < c->act_expert.size(); ++a) {
            const SmkExpert& e = c->experts[c->act_expert[a]];
            const int s0 = c->act_start[a], m = c->act_count[a];
            dot_for(*c->K, e.down_type)(e.down, size_t(e.down_stride), r0, r1, c->F, c->hacts.data() + s0, m, tmp, size_t(nr));
            for (int i = 0; i < m; ++i) {
                const float w = c->slot_w[s0 + i];
                float* o = c->out + size_t(c->slot_tok[s0 + i]) * c->D + r0;
                const float* y = tmp + size_t(i) * nr;
                if (e.down_bias) {
                    for (int r = 0; r < nr; ++r) o[r] += w * (y[r] + e.down_bias[r0 + r]);
                } else {
                    for (int r = 0; r < nr; ++r) o[r] += w * y[r];
                }
            }
        }
    }
}

}  // namespace

// out[T, D] += sum over slots (t, k) whose expert is hosted of weights[t, k] * FFN(x[t]).
// expert_index[e] is the position of expert e in `experts`, or -1 if it is not hosted; ids
// outside [0, num_experts) are not hosted either. Returns 0 or a negative error code.
SMK_API int smk_moe_forward(const SmkExpert* experts, const int32_t* expert_index, int num_experts, int D, int F,
                            const float* x, int T, int topk, const int32_t* ids, const float* weights, float* out) {
    const Kernels& K = kernels();
    if (D <= 0 || F <= 0 || T < 0 || topk < 0) return -2;
    if (T == 0 || topk == 0) return 0;
    MoeCtx c;
    c.experts = experts; c.D = D; c.F = F; c.K = &K; c.out = out;
    // group the slots by expert (counting sort, stable in slot order)
    std::vector<int> count(size_t(num_experts) + 1, 0);
    auto hosted = [&](int e) { return e >= 0 && e < num_experts && expert_index[e] >= 0; };
    for (int i = 0; i < T * topk; ++i)
        if (hosted(ids[i])) ++count[ids[i]];
    std::vector<int> pos(size_t(num_experts), 0);
    int S = 0;
    for (int e = 0; e < num_experts; ++e) {
        if (!count[e]) continue;
        const SmkExpert& ex = experts[expert_index[e]];
        for (int t : {ex.gate_type, ex.up_type, ex.down_type})
            if (!dot_for(K, t)) return -1;
        c.act_expert.push_back(expert_index[e]);
        c.act_start.push_back(S);
        c.act_count.push_back(count[e]);
        c.max_count = std::max(c.max_count, count[e]);
        pos[e] = S;
        S += count[e];
    }
    if (S == 0) return 0;
    c.S = S;
    c.slot_tok.resize(S);
    c.slot_w.resize(S);
    for (int i = 0; i < T * topk; ++i) {
        const int e = ids[i];
        if (!hosted(e)) continue;
        const int s = pos[e]++;
        c.slot_tok[s] = i / topk;
        c.slot_w[s] = weights[i];
    }
    // quantize the tokens once
    const size_t rbx = act_bytes(D), rbh = act_bytes(F);
    uint8_t* xrec = scratch(1, rbx * T);
    float* gbuf = reinterpret_cast<float*>(scratch(2, sizeof(float) * size_t(S) * F));
    float* ubuf = reinterpret_cast<float*>(scratch(3, sizeof(float) * size_t(S) * F));
    uint8_t* hrec = scratch(4, rbh * S);
    if (!xrec || !gbuf || !ubuf || !hrec) return -3;
    quantize_rows(x, size_t(D), T, D, xrec);
    c.xacts.resize(S);
    c.hacts.resize(S);
    for (int s = 0; s < S; ++s) {
        c.xacts[s] = act_at(xrec + rbx * c.slot_tok[s], D);
        c.hacts[s] = act_at(hrec + rbh * s, F);
    }
    c.G = gbuf;
    c.U = ubuf;
    c.hrec = hrec;
    const int nt = num_threads();
    const int n_active = int(c.act_expert.size());
    // Few, long work items: each item streams its rows of an expert's matrix from memory, and the
    // hardware prefetcher starts cold at every item's first rows. Measured on a decode step's
    // layers (Zen 5, 2 threads): phase 3 at 2 items a thread instead of 8 took 0.454 -> 0.409 ms a
    // layer for 1 token, 5.28 -> 5.04 for 16; phase 1 at 4 instead of 8 (whole experts for 1
    // token) 0.405 -> 0.392. Two items a thread still let a thread that falls behind be helped.
    // phase 1: about 4 items per thread, at least 16 rows each
    {
        int per = std::max(16, (n_active * F + nt * 4 - 1) / (nt * 4));
        per = std::min(F, (per + 15) / 16 * 16);
        c.p1_chunk = per;
        c.p1_per_expert = (F + per - 1) / per;
        if (nt == 1) phase1(&c, 0); else parallel(phase1, &c);
    }
    // phase 2
    if (nt == 1 || size_t(S) * F < (size_t(1) << 14)) {
        phase2(&c, 0);
    } else {
        parallel(phase2, &c);
    }
    // phase 3
    {
        int per = std::max(16, (D + nt * 2 - 1) / (nt * 2));
        c.p3_chunk = std::min(D, (per + 15) / 16 * 16);
        if (nt == 1) phase3(&c, 0); else parallel(phase3, &c);
    }
    return 0;
}
