// A whole MoE decode layer in one call, for experts hosted in this process: the attention front
// (decode_layer.cpp), the router's choice (route.cpp), the routed experts (moe.cpp) and the FFN's
// residual add. Between those, torch took some twenty calls a layer (the route, dtype round trips,
// the expert backend's bookkeeping, the add), ~85 µs of a ~700 µs layer on a decode step.
//
// Rounded as the per-op path rounds (attention_service/model/transformer.py `ffn`): the experts read
// the FFN's normed input rounded to bfloat16, and their sum is rounded to bfloat16 before the add,
// where `round_bf16` says the model computes in bfloat16.
#include <cstring>
#include <vector>

#include "smk.h"

struct SmkLocalExperts {  // one layer's experts, all in this process (kernels/native.py MoELayer.pointers)
    const SmkExpert* experts;
    const int32_t* index;
    int32_t num_experts, D, F;
    int64_t* counts;        // [num_experts] tokens routed to each, added to; or null
    int32_t round_bf16;
};

namespace {

inline float round_bf16(float v) { return smk::bf16_to_f32(smk::f32_to_bf16(v)); }  // as torch's float32 -> bfloat16

}  // namespace

// x [T, D] float32, updated in place: + attention, + the routed experts' sum. T = S's rows.
// ids [T, K] int32 out (the routing, for the caller's statistics). Returns 0 or a negative error code.
SMK_API int smk_decode_moe_layer(const SmkAttnLayer* L, const SmkDecodeStep* S, int T, const SmkRouting* R,
                                 const SmkLocalExperts* M, float* x, int32_t* ids) {
    const int D = M->D, K = R->K;
    if (T <= 0 || D <= 0 || R->E != M->num_experts) return -2;
    thread_local std::vector<float> h, weights, out;
    h.resize(size_t(T) * D);
    weights.resize(size_t(T) * K);
    out.assign(size_t(T) * D, 0.f);
    int rc = smk_attn_front_routed(L, S, x, h.data(), R, ids, weights.data());
    if (rc) return rc;
    if (M->counts)
        for (int i = 0; i < T * K; ++i) ++M->counts[ids[i]];
    if (M->round_bf16)
        for (float& v : h) v = round_bf16(v);
    rc = smk_moe_forward(M->experts, M->index, M->num_experts, D, M->F, h.data(), T, K, ids, weights.data(),
                         out.data());
    if (rc) return rc;
    for (size_t i = 0; i < out.size(); ++i) x[i] += M->round_bf16 ? round_bf16(out[i]) : out[i];
    return 0;
}
