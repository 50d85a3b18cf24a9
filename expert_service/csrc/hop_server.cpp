// The expert service's shared-memory hop loop without Python (proto/doorbell.py is the protocol):
// receive a REQUEST header on the doorbell socket, run the MoE layer on the slot's tensors, write
// the output into the slot, send the REPLY header, put the pool's workers to sleep, and again.
//
// Python keeps everything rare or slow: the handshake before the loop starts, mapping a slot's
// region (its ownership checks), traced hops, float32 hops, hops too large for the native layer
// (prefill: the dequantize-and-GEMM route), hosted experts without a native kernel, and every
// error. For those the loop hands the message to a callback that answers it on the socket itself.
#include <sys/socket.h>
#include <time.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <vector>

#include "doorbell.h"
#include "smk.h"

using namespace smk;
using namespace smk::doorbell;

namespace {

constexpr size_t ALIGN = 64;  // proto/shm.py ALIGN_BYTES

size_t align_up(size_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

}  // namespace

// One MoE layer as this shard hosts it natively (every hosted expert has a native kernel).
struct SmkHopLayer {
    const SmkExpert* experts;
    const int32_t* index;  // [num_experts]: position in `experts`, -1 where not hosted
    int32_t num_experts, D, F, max_tokens;  // max_tokens: larger hops go to Python (prefill's route)
};

// What the process serves and counts, shared by its connections; the shard is replaced whole.
struct SmkHopServer {
    std::shared_mutex mu;              // hops hold it shared; a new shard takes it exclusively
    std::vector<SmkHopLayer> layers;   // by layer number; experts == nullptr: not native here
    int64_t* token_counts = nullptr;   // [num_blocks, count_experts], HostedShard's, added to atomically
    int32_t num_blocks = 0, count_experts = 0;
    int64_t* totals = nullptr;         // [hops, compute ns]
};

struct SmkHopConn {
    SmkHopServer* server;
    int fd;
    uint8_t* region[NUM_SLOTS] = {nullptr, nullptr};
    size_t region_bytes[NUM_SLOTS] = {0, 0};
    std::atomic<int> computing{0};  // read by the service's shutdown drain
};

typedef int (*SmkHopFallback)(void* ctx, const uint8_t* message, int length);

SMK_API SmkHopServer* smk_hop_server_new(int64_t* token_counts, int num_blocks, int count_experts, int64_t* totals) {
    auto* s = new SmkHopServer();
    s->token_counts = token_counts;
    s->num_blocks = num_blocks;
    s->count_experts = count_experts;
    s->totals = totals;
    return s;
}

SMK_API void smk_hop_server_free(SmkHopServer* s) { delete s; }

// Replace the hosted layers: `layers[i]` for layer number i (experts null where not native).
// Blocks until no hop is computing on the old ones.
SMK_API void smk_hop_server_set_layers(SmkHopServer* s, const SmkHopLayer* layers, int n) {
    std::unique_lock<std::shared_mutex> lk(s->mu);
    s->layers.assign(layers, layers + n);
}

SMK_API SmkHopConn* smk_hop_conn_new(SmkHopServer* s, int fd) {
    auto* c = new SmkHopConn();
    c->server = s;
    c->fd = fd;
    return c;
}

SMK_API void smk_hop_conn_free(SmkHopConn* c) { delete c; }

SMK_API void smk_hop_conn_set_region(SmkHopConn* c, int slot, uint8_t* base, size_t num_bytes) {
    if (slot >= 0 && slot < NUM_SLOTS) {
        c->region[slot] = base;
        c->region_bytes[slot] = num_bytes;
    }
}

SMK_API int smk_hop_conn_computing(const SmkHopConn* c) { return c->computing.load(std::memory_order_relaxed); }

namespace {

// Compute one hop natively into its slot; false when Python must take it (see the file comment).
bool forward_native(SmkHopConn* c, const uint8_t* msg, uint64_t start_ns, uint8_t* reply) {
    const uint8_t dtype = msg[1];
    const int slot = rd<uint16_t>(msg + 2);
    const int layer = rd<int32_t>(msg + 4);
    const uint32_t T = rd<uint32_t>(msg + 8), K = rd<uint32_t>(msg + 12), D = rd<uint32_t>(msg + 16);
    const uint64_t seq = rd<uint64_t>(msg + 20);
    if (rd<uint16_t>(msg + 28) || rd<uint16_t>(msg + 30)) return false;  // a region to map, or a trace
    if (dtype != WIRE_BFLOAT16 || slot >= NUM_SLOTS || !c->region[slot] || T == 0 || K == 0) return false;
    SmkHopServer* s = c->server;
    std::shared_lock<std::shared_mutex> lk(s->mu);
    if (layer < 0 || size_t(layer) >= s->layers.size()) return false;
    const SmkHopLayer& L = s->layers[layer];
    if (!L.experts || int(D) != L.D || int(T) > L.max_tokens) return false;
    const size_t hidden = align_up(size_t(T) * D * 2), routing = align_up(size_t(T) * K * 4);
    if (hidden + 2 * routing + hidden > c->region_bytes[slot]) return false;
    uint8_t* base = c->region[slot];
    const uint16_t* xh = reinterpret_cast<const uint16_t*>(base);
    const int32_t* ids = reinterpret_cast<const int32_t*>(base + hidden);
    const float* weights = reinterpret_cast<const float*>(base + hidden + routing);
    uint16_t* out_h = reinterpret_cast<uint16_t*>(base + hidden + 2 * routing);
    c->computing.store(1, std::memory_order_relaxed);
    const size_t n = size_t(T) * D;
    float* x = reinterpret_cast<float*>(scratch(7, sizeof(float) * 2 * n));
    float* out = x + n;
    for (size_t i = 0; i < n; ++i) x[i] = bf16_to_f32(xh[i]);
    std::memset(out, 0, sizeof(float) * n);
    const uint64_t t0 = now_ns();
    const int rc = smk_moe_forward(L.experts, L.index, L.num_experts, L.D, L.F, x, int(T), int(K), ids, weights, out);
    const uint64_t compute_ns = now_ns() - t0;
    if (rc != 0) {  // a type the kernels lack after all: Python says why
        c->computing.store(0, std::memory_order_relaxed);
        return false;
    }
    for (size_t i = 0; i < n; ++i) out_h[i] = f32_to_bf16(out[i]);
    c->computing.store(0, std::memory_order_relaxed);
    // the tokens each hosted expert took, for the service's load statistics
    if (s->token_counts && layer < s->num_blocks) {
        int64_t* row = s->token_counts + size_t(layer) * s->count_experts;
        for (size_t i = 0; i < size_t(T) * K; ++i) {
            const int e = ids[i];
            if (e >= 0 && e < L.num_experts && e < s->count_experts && L.index[e] >= 0)
                __atomic_fetch_add(row + e, 1, __ATOMIC_RELAXED);
        }
    }
    if (s->totals) {
        __atomic_fetch_add(s->totals, 1, __ATOMIC_RELAXED);
        __atomic_fetch_add(s->totals + 1, int64_t(compute_ns), __ATOMIC_RELAXED);
    }
    std::memset(reply, 0, REPLY_BYTES);
    reply[0] = KIND_FORWARD;
    reply[1] = STATUS_OK;
    wr<uint64_t>(reply + 8, seq);
    wr<uint64_t>(reply + 16, start_ns);
    wr<uint64_t>(reply + 24, now_ns());
    wr<uint64_t>(reply + 32, compute_ns);
    return true;
}

}  // namespace

// Serve the connection until the peer hangs up (0), the socket fails (-errno) or the fallback
// asks to stop (its nonzero return). Call with the GIL released (ctypes does).
SMK_API int smk_hop_serve(SmkHopConn* c, SmkHopFallback fallback, void* ctx) {
    uint8_t msg[MAX_MESSAGE], reply[REPLY_BYTES];
    for (;;) {
        const ssize_t n = recv(c->fd, msg, sizeof(msg), 0);
        if (n == 0) return 0;
        if (n < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        const uint64_t start_ns = now_ns();
        if (n >= REQUEST_BYTES && msg[0] == KIND_FORWARD && forward_native(c, msg, start_ns, reply)) {
            if (send(c->fd, reply, REPLY_BYTES, MSG_NOSIGNAL) != REPLY_BYTES) return errno ? -errno : -1;
        } else {
            const int rc = fallback(ctx, msg, int(n));
            if (rc) return rc;
        }
        smk_park();  // the attention side computes until the next hop: leave it the cores
    }
}
