// A decode layer whose experts are on one co-located expert service, in one call: the attention
// front (kernels/csrc/decode_layer.cpp), the router's choice (route.cpp), the hop over the
// shared-memory doorbell (proto/doorbell.py is the protocol; expert_service/csrc/hop_server.cpp
// answers it), and the FFN's residual add. The layer call's Python (planning, the link's tickets,
// the parts' sum) cost ~110 µs a layer on a decode step around a ~400 µs hop.
//
// Python chooses the target (attention_service/expert_backends/direct_hop.py: a free, announced
// slot of a healthy service's link, nothing else in flight) and books the answered hop. What can
// go wrong in the hop is only reported: the front has run, so the caller sends the layer's
// experts again by the usual path.
#include <sys/socket.h>
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "doorbell.h"
#include "smk.h"

struct SmkHopTarget {  // direct_hop.py _HopTarget
    int32_t fd;              // the doorbell socket: blocking, its receive timeout set (SO_RCVTIMEO)
    int32_t slot;
    uint8_t* region;         // the slot's mapping, `region_bytes` long
    int64_t region_bytes;
    int64_t hidden_at, ids_at, weights_at, output_at;  // proto/doorbell.py slot_layout's offsets
    int32_t layer, wire_dtype;  // the hidden states' wire dtype: bfloat16
    uint64_t seq;
    int64_t* counts;         // [experts] tokens routed to each, added to once answered; or null
};

struct SmkHopResult {  // CLOCK_MONOTONIC ns, as ShmLink's ticket and the service's reply keep them
    uint64_t start_ns, sent_ns, submitted_ns, wait_ns, observed_ns;
    uint64_t service_start_ns, service_end_ns, compute_ns;
    int32_t error_bytes;     // the service's error message, in `error` (status not OK)
    int32_t failed_errno;    // the hop failed: why (0: EOF or a malformed reply)
};

using namespace smk;
using namespace smk::doorbell;

// x [T, D] float32, updated in place. h [T, D] out: the FFN's normed input rounded to bfloat16 (as
// sent); ids [T, K] int32 and weights [T, K] out: the routing. Returns 0 (x += the experts' sum),
// 1 (the hop failed: x has the attention only; h, ids, weights valid), 2 (the service answered
// with an error: its message in `error`, x has the attention only), or a negative error code.
SMK_API int smk_decode_remote_layer(const SmkAttnLayer* L, const SmkDecodeStep* S, int T, int D,
                                    const SmkRouting* R, const SmkHopTarget* H, float* x, float* h, int32_t* ids,
                                    float* weights, SmkHopResult* res, char* error, int error_cap) {
    const int K = R->K;
    if (T <= 0 || D <= 0 || H->output_at + int64_t(T) * D * 2 > H->region_bytes) return -2;
    const int rc = smk_attn_front_routed(L, S, x, h, R, ids, weights);
    if (rc) return rc;
    res->start_ns = now_ns();
    uint16_t* hidden = reinterpret_cast<uint16_t*>(H->region + H->hidden_at);
    for (size_t i = 0; i < size_t(T) * D; ++i) {
        hidden[i] = f32_to_bf16(h[i]);
        h[i] = bf16_to_f32(hidden[i]);
    }
    std::memcpy(H->region + H->ids_at, ids, sizeof(int32_t) * size_t(T) * K);
    std::memcpy(H->region + H->weights_at, weights, sizeof(float) * size_t(T) * K);
    uint8_t request[REQUEST_BYTES];
    request[0] = KIND_FORWARD;
    request[1] = uint8_t(H->wire_dtype);
    wr<uint16_t>(request + 2, uint16_t(H->slot));
    wr<int32_t>(request + 4, H->layer);
    wr<uint32_t>(request + 8, uint32_t(T));
    wr<uint32_t>(request + 12, uint32_t(K));
    wr<uint32_t>(request + 16, uint32_t(D));
    wr<uint64_t>(request + 20, H->seq);
    wr<uint16_t>(request + 28, 0);  // no region announcement: the slot is known to the service
    wr<uint16_t>(request + 30, 0);  // no traceparent: spans go nowhere
    smk_park();  // the expert service computes next: this process's idle workers must not spin
    res->sent_ns = now_ns();
    if (send(H->fd, request, REQUEST_BYTES, MSG_NOSIGNAL) != REQUEST_BYTES) {
        res->failed_errno = errno;
        return 1;
    }
    res->submitted_ns = now_ns();
    uint8_t reply[MAX_MESSAGE];
    res->wait_ns = now_ns();
    ssize_t n;
    do {
        n = recv(H->fd, reply, sizeof(reply), 0);
    } while (n < 0 && errno == EINTR);
    res->observed_ns = now_ns();
    if (n < REPLY_BYTES || reply[0] != KIND_FORWARD || rd<uint64_t>(reply + 8) != H->seq) {
        res->failed_errno = n < 0 ? errno : 0;
        return 1;
    }
    res->service_start_ns = rd<uint64_t>(reply + 16);
    res->service_end_ns = rd<uint64_t>(reply + 24);
    res->compute_ns = rd<uint64_t>(reply + 32);
    if (H->counts)
        for (int i = 0; i < T * K; ++i) ++H->counts[ids[i]];
    if (reply[1] != STATUS_OK) {
        res->error_bytes = int(std::min<ssize_t>(n - REPLY_BYTES, error_cap));
        std::memcpy(error, reply + REPLY_BYTES, size_t(res->error_bytes));
        return 2;
    }
    const uint16_t* out = reinterpret_cast<const uint16_t*>(H->region + H->output_at);
    for (size_t i = 0; i < size_t(T) * D; ++i) x[i] += bf16_to_f32(out[i]);
    return 0;
}
