// The router's choice, natively: router logits [T, E] -> each token's experts ids [T, K] and float32
// weights [T, K], as attention_service/model/routing.py `route` computes them in torch (five calls,
// ~18 µs a decode layer, for a few hundred flops).
//
//   softmax:         p = softmax(logits); ids = top-k of p (plus a selection bias when given); w = p[ids]
//   sigmoid:         the same with p = sigmoid(logits) (DeepSeek-V3, Llama 4)
//   softmax_weight:  ids = top-k of the raw logits; w = softmax over those k (gpt-oss)
//   then w /= sum(w) when renormalized, and w *= scale.
//
// Grouped selection (DeepSeek's expert groups) is not here: the caller keeps torch's route for it.
// Ids come best first, as torch.topk's; equal scores keep the lower id first.
#include <algorithm>
#include <cmath>
#include <vector>

#include "smk.h"

namespace {

// The k best of scores[0..n), best first (ties: lower index first), into ids.
void top_k(const float* scores, int n, int k, int32_t* ids) {
    for (int j = 0; j < k; ++j) {
        int best = -1;
        for (int e = 0; e < n; ++e) {
            bool taken = false;
            for (int i = 0; i < j && !taken; ++i) taken = ids[i] == e;
            if (!taken && (best < 0 || scores[e] > scores[best])) best = e;
        }
        ids[j] = best;
    }
}

}  // namespace

// Returns 0, or -2 for a malformed call (k outside 1..E, an unknown gating).
SMK_API int smk_route(const SmkRouting* R, const float* logits, int T, int32_t* ids, float* weights) {
    const int E = R->E, K = R->K;
    if (K <= 0 || K > E || R->gating < 0 || R->gating > 2 || T < 0) return -2;
    thread_local std::vector<float> p, chosen;  // per layer of every decode step: no allocation each call
    p.resize(size_t(E));
    chosen.resize(size_t(E));
    for (int t = 0; t < T; ++t) {
        const float* l = logits + size_t(t) * E;
        int32_t* id = ids + size_t(t) * K;
        float* w = weights + size_t(t) * K;
        if (R->gating == 2) {
            top_k(l, E, K, id);
            const float m = l[id[0]];
            float sum = 0.f;
            for (int j = 0; j < K; ++j) sum += (w[j] = std::exp(l[id[j]] - m));
            for (int j = 0; j < K; ++j) w[j] /= sum;
        } else {
            if (R->gating == 1) {
                for (int e = 0; e < E; ++e) p[e] = 1.f / (1.f + std::exp(-l[e]));
            } else {
                const float m = *std::max_element(l, l + E);
                float sum = 0.f;
                for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - m));
                for (int e = 0; e < E; ++e) p[e] /= sum;
            }
            const float* score = p.data();
            if (R->selection_bias) {
                for (int e = 0; e < E; ++e) chosen[e] = p[e] + R->selection_bias[e];
                score = chosen.data();
            }
            top_k(score, E, K, id);
            for (int j = 0; j < K; ++j) w[j] = p[id[j]];
            if (R->renormalize) {
                float sum = 0.f;
                for (int j = 0; j < K; ++j) sum += w[j];
                for (int j = 0; j < K; ++j) w[j] /= sum;
            }
        }
        for (int j = 0; j < K; ++j) w[j] *= R->scale;
    }
    return 0;
}
