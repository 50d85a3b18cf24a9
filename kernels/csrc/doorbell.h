// proto/doorbell.py's wire format for its two C++ ends: the expert service's hop loop
// (expert_service/csrc/hop_server.cpp) and the attention side's direct hop
// (attention_service/expert_backends/csrc/direct_hop.cpp).
#pragma once

#include <time.h>

#include <cstdint>
#include <cstring>

namespace smk::doorbell {

constexpr uint8_t KIND_FORWARD = 2;
constexpr uint8_t STATUS_OK = 0;
constexpr int NUM_SLOTS = 2;
constexpr int REQUEST_BYTES = 32;     // <BBHiIIIQHH
constexpr int REPLY_BYTES = 40;       // <BBxxxxxxQQQQ
constexpr int MAX_MESSAGE = 4096;
constexpr uint8_t WIRE_BFLOAT16 = 2;  // splitmoe.v1.DType

// CLOCK_MONOTONIC: both ends stamp a hop on it (one host), as the Python ends do.
inline uint64_t now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

template <class T> T rd(const uint8_t* p) { T v; std::memcpy(&v, p, sizeof(T)); return v; }
template <class T> void wr(uint8_t* p, T v) { std::memcpy(p, &v, sizeof(T)); }

}  // namespace smk::doorbell
